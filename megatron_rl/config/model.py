"""``ModelConfig``: the architecture of a GPT-style decoder, in Megatron-Core's terms.

The HF families map onto it (``megatron_rl.models.<family>``); ``megatron_rl.models.gpt``
turns it into a ``TransformerConfig`` and model chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_rl.config.base_config import BaseConfig, check_choice, check_range

__all__ = ["ModelConfig"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class ModelConfig(BaseConfig):
    """Architecture of a GPT-style decoder, in Megatron-Core's terms."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 128
    """Model width."""
    ffn_hidden_size: int = 256
    """Dense MLP width (per gate/up branch with SwiGLU)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads (GQA); None = num_attention_heads (MHA)."""
    kv_channels: Optional[int] = None
    """Head dimension; None = hidden_size // num_attention_heads."""
    vocab_size: int = 512
    """Tokenizer vocabulary (before padding for TP)."""
    make_vocab_size_divisible_by: int = 1
    """Pad the embedding rows to a multiple of this times TP (Megatron-LM uses 128)."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE tables cover."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rotary_percent: float = 1.0
    """Fraction of each head that is rotated."""
    rope_scaling: bool = False
    """Llama-3.x RoPE frequency scaling."""
    rope_scaling_factor: float = 8.0
    """Llama-3.x RoPE scaling factor."""
    normalization: str = "RMSNorm"
    """``RMSNorm`` or ``LayerNorm``."""
    layernorm_epsilon: float = 1e-6
    """Norm epsilon."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys (Qwen3)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection (Qwen2)."""
    add_bias_linear: bool = False
    """Bias on the other linear layers."""
    swiglu: bool = True
    """SwiGLU MLP (gated SiLU); False = GeLU MLP."""
    tie_word_embeddings: bool = False
    """Share input embedding and output layer weights."""
    # --- MoE -----------------------------------------------------------------
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer; None = dense."""
    moe_ffn_hidden_size: Optional[int] = None
    """Expert MLP width; None = ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient."""
    moe_z_loss_coeff: Optional[float] = None
    """Router z-loss coefficient."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``aux_loss``, ``seq_aux_loss``, ``sinkhorn`` or ``none``."""
    moe_router_pre_softmax: bool = False
    """Softmax before top-k (Mixtral: False; Qwen3-MoE: normalised top-k)."""
    moe_router_dtype: Optional[str] = "fp32"
    """Router computation precision: ``fp32`` or ``fp64`` (matters for RL stability); None = model dtype."""
    moe_token_dispatcher_type: str = "alltoall"
    """``alltoall`` or ``allgather``."""
    moe_grouped_gemm: bool = False
    """Grouped GEMM experts (GPU; needs TE or grouped_gemm)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Shared expert width; None = no shared expert."""
    freeze_router: bool = False
    """Keep router weights fixed during RL (a common stabiliser for MoE RL)."""
    # --- numerics --------------------------------------------------------------
    params_dtype: str = "float32"
    """``float32`` (CPU), ``bfloat16`` or ``float16``."""
    attention_backend: str = "auto"
    """``auto`` (TE if importable, else SDPA), ``sdpa``, ``local`` (Megatron's unfused), ``te``."""

    def __post_init__(self) -> None:
        check_choice("model.normalization", self.normalization, ("RMSNorm", "LayerNorm"))
        check_choice("model.params_dtype", self.params_dtype, tuple(_DTYPES))
        check_choice("model.attention_backend", self.attention_backend, ("auto", "sdpa", "local", "te"))
        check_choice("model.moe_token_dispatcher_type", self.moe_token_dispatcher_type, ("alltoall", "allgather"))
        check_choice("model.moe_router_dtype", self.moe_router_dtype, (None, "fp32", "fp64"))
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size"):
            check_range(f"model.{name}", getattr(self, name), low=1)
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be divisible by "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                f"{self.num_attention_heads}; set model.kv_channels"
            )
        if self.num_moe_experts is not None and not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(
                f"model.moe_router_topk={self.moe_router_topk} must be in [1, num_moe_experts={self.num_moe_experts}]"
            )

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads
