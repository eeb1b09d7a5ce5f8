"""``ModelConfig``: the architecture of a GPT-style decoder, in Megatron-Core's terms; ``ModelSourceConfig``:
a role's ``*.model`` section, where its architecture and weights come from.

The HF families map onto it (``megatron_rl.models.<family>``); ``megatron_rl.models.gpt``
turns it into a ``TransformerConfig`` and model chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Optional

from megatron_rl.config.base_config import BaseConfig, check_choice, check_range, suggest
from megatron_rl.config.lora_config import LoRAConfig, resolve_lora

__all__ = ["ModelConfig", "ModelSourceConfig"]

_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names (torch is imported when one is asked for)


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
        check_choice("model.params_dtype", self.params_dtype, _DTYPES)
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
    def dtype(self) -> "torch.dtype":  # noqa: F821 (torch imported here: a config load needs no torch)
        import torch

        return getattr(torch, self.params_dtype)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


@dataclasses.dataclass
class ModelSourceConfig(BaseConfig):
    """``*.model``: where a model's architecture and weights come from (set exactly one of
    ``path`` and ``config``)."""

    path: Optional[str] = None
    """HF checkpoint directory (config.json + safetensors); ``~`` is expanded by the trainer."""
    config: Optional[ModelConfig] = None
    """Inline architecture for a from-scratch model (toy runs); weights are initialised with
    ``megatron.seed``."""
    family: Optional[str] = None
    """HF family an inline model is exported as for vLLM (``qwen3``, ``llama`` ...); required with ``config``."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory; None = ``path``, or, with an inline model, a byte-level BPE tokenizer
    trained on the task's texts with ``config.vocab_size`` entries."""
    override_config: dict = field(default_factory=dict)
    """``ModelConfig`` fields set on top of the checkpoint's (``freeze_router``, ``moe_router_dtype``,
    ``make_vocab_size_divisible_by`` ...) and, as in verl, HF config keys set on the checkpoint's config
    before it is read (under ``model_config`` or at the top: ``max_position_embeddings``, ``attention_dropout``;
    a key the HF config lacks is refused when it is read, ``megatron_rl.models.families.apply_hf_overrides``)."""
    trust_remote_code: bool = False
    """Allow custom modelling code when reading an HF checkpoint or tokenizer."""
    custom_chat_template: Optional[str] = None
    """Jinja chat template replacing the tokenizer's."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """verl 0.9.1's Megatron LoRA (``megatron_rl.config.lora_config.LoRAConfig``); ``lora.rank: 0`` (the default)
    trains every parameter. The actor's only: a critic that runs with ``rank > 0`` is refused (not built)
    before any worker starts (``megatron_rl.trainer.placement.check_lora_roles``)."""
    lora_rank: int = 0
    """verl's older flat form of ``lora.rank`` (0 = off); with it ``lora_alpha``, ``target_modules``,
    ``exclude_modules`` and ``lora_adapter_path`` map onto ``lora.*`` (``lora_config()``). Set one form only."""
    lora_alpha: float = 16
    """Flat form of ``lora.alpha`` (with ``lora_rank > 0``; a flat key set beside ``lora.rank > 0`` is refused)."""
    target_modules: Any = "all-linear"
    """Flat form of ``lora.target_modules``: Megatron linear names, or ``all-linear`` (every one)."""
    exclude_modules: Optional[list] = None
    """Flat form of ``lora.exclude_modules``."""
    lora_adapter_path: Optional[str] = None
    """Flat form of ``lora.adapter_path`` (a PEFT adapter directory the actor's adapters start from)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, Mapping):  # built by keyword: the section as a mapping
            self.lora = resolve_lora({"lora": self.lora}, "model")
        resolve_lora(self, "model")  # both forms set, or a bad flat value: ValueError naming the key
        names = [f.name for f in dataclasses.fields(ModelConfig)]
        wrapped = self.override_config.get("model_config", {})
        if not isinstance(wrapped, Mapping):
            raise ValueError(f"model.override_config.model_config={wrapped!r} must be a mapping of HF config keys")
        if self.config is not None or self.path is None:  # no HF config to set keys on: only ModelConfig fields
            for key in self.override_config:
                if key not in names:
                    raise ValueError(
                        f"model.override_config: unknown ModelConfig field {key!r}{suggest(key, names)} "
                        "(HF config keys apply to a checkpoint given by model.path)"
                    )

    @property
    def is_inline(self) -> bool:
        """True for a from-scratch model described by ``config``."""
        return self.config is not None

    def lora_config(self) -> LoRAConfig:
        """This model's one LoRA setting: ``lora`` itself, or (``lora_rank > 0``) verl's flat keys mapped
        onto a ``LoRAConfig`` (``merge: true``: the flat form has no merge key). Every flat key is looked
        at: one set beside ``lora.rank > 0`` would be ignored, so it is refused (``resolve_lora``)."""
        flat = {
            "lora": self.lora,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": self.target_modules,
            "exclude_modules": self.exclude_modules,
            "lora_adapter_path": self.lora_adapter_path,
        }
        resolved = resolve_lora(flat, "model")
        return resolved if self.lora_rank else self.lora  # the section itself: its readers are its keys
