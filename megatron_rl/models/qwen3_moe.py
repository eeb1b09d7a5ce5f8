"""Qwen3-MoE: Qwen3 attention (QK-norm) with routed SwiGLU experts in every layer."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.families import (
    Family,
    check_no_sliding_window,
    llama_like_kwargs,
    moe_mlp_rules,
    moe_router_kwargs,
    reject,
)


def _config_kwargs(cfg: Any) -> dict[str, Any]:
    check_no_sliding_window("qwen3_moe", cfg)
    if getattr(cfg, "attention_bias", False):
        reject("qwen3_moe", "attention_bias", cfg.attention_bias, "False")
    # ModelConfig places experts in every layer; HF can interleave dense layers.
    if getattr(cfg, "decoder_sparse_step", 1) != 1:
        reject("qwen3_moe", "decoder_sparse_step", cfg.decoder_sparse_step, "1 (every layer MoE)")
    if getattr(cfg, "mlp_only_layers", None):
        reject("qwen3_moe", "mlp_only_layers", cfg.mlp_only_layers, "[] (every layer MoE)")
    return dict(
        llama_like_kwargs("qwen3_moe", cfg),
        qk_layernorm=True,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        **moe_router_kwargs(cfg, num_experts=cfg.num_experts, norm_topk_prob=bool(cfg.norm_topk_prob)),
    )


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    config_kwargs=_config_kwargs,
    mlp_rules=moe_mlp_rules(
        "mlp.gate.weight", "mlp.experts.{expert}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"
    ),
)
