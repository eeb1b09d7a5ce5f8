"""Mixtral: Mistral attention with routed SwiGLU experts (top-k renormalised) in every layer."""

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
    check_no_sliding_window("mixtral", cfg)
    if getattr(cfg, "router_jitter_noise", 0.0):
        reject("mixtral", "router_jitter_noise", cfg.router_jitter_noise, "0.0")
    return dict(
        llama_like_kwargs("mixtral", cfg),
        moe_ffn_hidden_size=cfg.intermediate_size,
        # Mixtral always renormalises its top-k routing weights.
        **moe_router_kwargs(cfg, num_experts=cfg.num_local_experts, norm_topk_prob=True),
    )


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    config_kwargs=_config_kwargs,
    # The hub checkpoints keep the pre-v5 module name block_sparse_moe and w1/w3/w2.
    mlp_rules=moe_mlp_rules(
        "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.", "w1.weight", "w3.weight", "w2.weight"
    ),
)
