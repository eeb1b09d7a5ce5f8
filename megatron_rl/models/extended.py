"""``ExtendedModelConfig``: ``ModelConfig`` plus the architecture of DeepSeek-V3 / GLM-4.5 / Qwen2-MoE-style models.

The base ``ModelConfig`` (``megatron_rl.config.model``) describes Llama-style decoders. The
frontier MoE families add Multi-Latent Attention (low-rank Q and KV projections with a decoupled
RoPE part, Megatron-Core's ``MLATransformerConfig``), YaRN RoPE inside MLA, sigmoid routing with
an expert bias (aux-loss-free balancing), group-limited routing, a routed scaling factor and a
first-k-dense layer pattern (``moe_layer_freq``) and Qwen2-MoE's sigmoid-gated shared expert. Their
families (``deepseek_v3``, ``glm4_moe``, ``qwen2_moe``)
return this subclass from ``Family.model_config``; ``megatron_rl.models.gpt`` reads
``megatron_kwargs()`` into the ``TransformerConfig`` and ``layer_is_moe`` into the layer specs.
Every field keeps Megatron-Core's name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_rl.config.base_config import check_choice
from megatron_rl.config.model import ModelConfig

__all__ = ["ExtendedModelConfig"]


@dataclasses.dataclass
class ExtendedModelConfig(ModelConfig):
    """``ModelConfig`` with MLA, YaRN, sigmoid/grouped routing and a dense/MoE layer pattern."""

    # --- Multi-Latent Attention ------------------------------------------------
    multi_latent_attention: bool = False
    """MLA (DeepSeek-V2/V3) instead of grouped-query attention."""
    q_lora_rank: Optional[int] = None
    """Rank of the query's low-rank projection; None = a full query projection."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent."""
    qk_head_dim: int = 128
    """Per-head query/key width without RoPE (HF ``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head RoPE width shared by all heads' keys (HF ``qk_rope_head_dim``)."""
    v_head_dim: int = 128
    """Per-head value width."""
    rope_type: str = "rope"
    """MLA's RoPE: ``rope`` or ``yarn``."""
    rotary_scaling_factor: float = 1.0
    """YaRN ``factor``."""
    original_max_position_embeddings: int = 4096
    """YaRN: the pre-extension context length."""
    beta_fast: float = 32.0
    """YaRN ``beta_fast``."""
    beta_slow: float = 1.0
    """YaRN ``beta_slow``."""
    mscale: float = 1.0
    """YaRN ``mscale``."""
    mscale_all_dim: float = 0.0
    """YaRN ``mscale_all_dim`` (also scales the softmax)."""
    mla_latent_norm_epsilon: Optional[float] = None
    """Epsilon of MLA's query / key-value latent norms; None = ``layernorm_epsilon``. HF's DeepSeek-V3
    builds them with 1e-6 whatever ``rms_norm_eps`` says (Moonlight-16B-A3B: 1e-5 elsewhere)."""
    # --- routing and layer pattern ---------------------------------------------
    moe_layer_freq: Optional[tuple[int, ...]] = None
    """Per layer 1 = MoE, 0 = dense MLP of ``ffn_hidden_size`` (first-k-dense); None = every layer MoE."""
    moe_router_score_function: str = "softmax"
    """``softmax`` or ``sigmoid`` (DeepSeek-V3 / GLM-4.5)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only
    (HF ``e_score_correction_bias``); Megatron updates it from the token counts each step."""
    moe_router_bias_update_rate: float = 1e-3
    """Step size of the expert-bias update (Megatron's default; 0 keeps the bias fixed)."""
    moe_router_num_groups: Optional[int] = None
    """Expert groups for group-limited routing (HF ``n_group``); None = no groups."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token may route into (HF ``topk_group``)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the routing weights (HF ``routed_scaling_factor``)."""
    moe_shared_expert_gate: bool = False
    """The shared expert's output is scaled by ``sigmoid(x @ gate)``, a ``[1, hidden]`` weight per layer
    (Qwen2-MoE / Qwen1.5-MoE ``shared_expert_gate``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("model.rope_type", self.rope_type, ("rope", "yarn"))
        check_choice("model.moe_router_score_function", self.moe_router_score_function, ("softmax", "sigmoid"))
        if self.moe_layer_freq is not None:
            self.moe_layer_freq = tuple(int(x) for x in self.moe_layer_freq)
            if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
                raise ValueError(
                    f"model.moe_layer_freq={list(self.moe_layer_freq)} must hold one 0 (dense) or 1 (MoE) "
                    f"per layer (num_layers={self.num_layers})"
                )
        if self.multi_latent_attention and self.attention_backend == "local":
            raise ValueError(
                "model.attention_backend='local' (Megatron's DotProductAttention) cannot run MLA in "
                "Megatron-Core 0.16.1; use 'auto', 'sdpa' or 'te'"
            )
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ValueError(
                "model.moe_shared_expert_gate=True needs a shared expert (model.moe_shared_expert_intermediate_size)"
            )
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ValueError(
                f"model.moe_router_num_groups={self.moe_router_num_groups} and "
                f"model.moe_router_group_topk={self.moe_router_group_topk} must be set together"
            )

    def layer_is_moe(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has routed experts."""
        return self.is_moe and (self.moe_layer_freq is None or bool(self.moe_layer_freq[layer]))

    def layer_params(self, layer: int, *, tp: int = 1, ep: int = 1, etp: Optional[int] = None) -> tuple[int, int]:
        """``(dense, expert)`` parameters of global layer ``layer`` on one rank of the local spec
        (MLA's four projections are column-parallel there; norms and the router are replicated)."""
        etp = etp or tp
        h, heads = self.hidden_size, self.num_attention_heads
        gate = 2 if self.swiglu else 1
        if self.multi_latent_attention:
            q_head = self.qk_head_dim + self.qk_pos_emb_head_dim
            if self.q_lora_rank is None:
                attn = h * heads * q_head // tp
            else:
                attn = (h * self.q_lora_rank + self.q_lora_rank * heads * q_head) // tp + self.q_lora_rank
            attn += (
                h * (self.kv_lora_rank + self.qk_pos_emb_head_dim)
                + self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
            ) // tp + self.kv_lora_rank
            attn += heads * self.v_head_dim * h // tp
        else:
            d, groups = self.head_dim, self.num_query_groups or heads
            qkv = (heads + 2 * groups) * d
            attn = (qkv * h + (qkv if self.add_qkv_bias else 0) + heads * d * h) // tp
            attn += 2 * d if self.qk_layernorm else 0
        dense, expert = attn + 2 * h, 0
        if self.layer_is_moe(layer):
            f = self.moe_ffn_hidden_size or self.ffn_hidden_size
            dense += self.num_moe_experts * h
            expert = (self.num_moe_experts // ep) * (gate + 1) * (f // etp) * h
            if self.moe_shared_expert_intermediate_size:
                dense += (gate + 1) * (self.moe_shared_expert_intermediate_size // tp) * h
                dense += h if self.moe_shared_expert_gate else 0  # the gate, replicated
        else:
            dense += (gate + 1) * (self.ffn_hidden_size // tp) * h
        return dense, expert

    def num_params(self) -> int:
        """All parameters of the model (one rank, no parallelism; untied LM head unless tied)."""
        layers = sum(sum(self.layer_params(i)) for i in range(self.num_layers))
        embed = self.vocab_size * self.hidden_size
        return layers + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def megatron_kwargs(self) -> dict[str, Any]:
        """The ``TransformerConfig`` (``MLATransformerConfig`` with MLA) fields these settings add."""
        out: dict[str, Any] = {}
        if self.multi_latent_attention:
            out.update(
                multi_latent_attention=True,
                q_lora_rank=self.q_lora_rank,
                kv_lora_rank=self.kv_lora_rank,
                qk_head_dim=self.qk_head_dim,
                qk_pos_emb_head_dim=self.qk_pos_emb_head_dim,
                v_head_dim=self.v_head_dim,
                rope_type=self.rope_type,
                rotary_base=self.rotary_base,
                rotary_percent=self.rotary_percent,
                rotary_scaling_factor=self.rotary_scaling_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                mscale=self.mscale,
                mscale_all_dim=self.mscale_all_dim,
                apply_rope_fusion=False,
            )
        if self.is_moe:
            out.update(
                moe_router_score_function=self.moe_router_score_function,
                moe_router_enable_expert_bias=self.moe_router_enable_expert_bias,
                moe_router_bias_update_rate=self.moe_router_bias_update_rate,
                moe_router_num_groups=self.moe_router_num_groups,
                moe_router_group_topk=self.moe_router_group_topk,
                moe_router_topk_scaling_factor=self.moe_router_topk_scaling_factor,
            )
            if self.moe_layer_freq is not None:
                out["moe_layer_freq"] = list(self.moe_layer_freq)
            if self.moe_shared_expert_gate:
                out["moe_shared_expert_gate"] = True
        return out
