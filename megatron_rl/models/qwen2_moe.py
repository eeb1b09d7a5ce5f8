"""Qwen2-MoE / Qwen1.5-MoE (HF ``Qwen2MoeForCausalLM``): Qwen2 attention (QKV bias), softmax-routed
SwiGLU experts plus one shared expert whose output is scaled by ``sigmoid(x @ shared_expert_gate)``.

Megatron-Core's ``SharedExpertMLP`` with ``moe_shared_expert_gate`` computes exactly that
(``mlp.shared_experts.gate_weight [1, hidden]``, replicated over TP). Dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) become a ``moe_layer_freq`` pattern with
``intermediate_size`` MLPs, as HF builds them.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.extended import ExtendedModelConfig
from megatron_rl.models.families import (
    DENSE_MLP_RULES,
    Family,
    check_no_sliding_window,
    llama_like_kwargs,
    moe_mlp_rules,
    moe_router_kwargs,
    reject,
    shared_expert_rules,
)
from parallel.bridge import WeightRule

__all__ = ["FAMILY"]


def _config_kwargs(cfg: Any) -> dict[str, Any]:
    f = "qwen2_moe"
    check_no_sliding_window(f, cfg)
    layers, step = cfg.num_hidden_layers, int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    if dense_only - set(range(layers)):
        reject(f, "mlp_only_layers", sorted(dense_only), f"layer indices in 0..{layers - 1}")
    pattern = tuple(int(i not in dense_only and (i + 1) % step == 0) for i in range(layers))
    if not any(pattern):
        reject(
            f,
            "decoder_sparse_step / mlp_only_layers",
            (step, sorted(dense_only)),
            "a pattern with at least one MoE layer (use the qwen2 family for a dense model)",
        )
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    if not shared:
        reject(f, "shared_expert_intermediate_size", shared, "> 0 (Qwen2-MoE always builds its gated shared expert)")
    return dict(
        llama_like_kwargs(f, cfg),
        add_qkv_bias=bool(getattr(cfg, "qkv_bias", True)),
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
        moe_layer_freq=None if all(pattern) else pattern,
        **moe_router_kwargs(cfg, num_experts=cfg.num_experts, norm_topk_prob=bool(cfg.norm_topk_prob)),
    )


FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    config_kwargs=_config_kwargs,
    mlp_rules=(
        *DENSE_MLP_RULES,  # mlp_only_layers / decoder_sparse_step
        *moe_mlp_rules(
            "mlp.gate.weight", "mlp.experts.{expert}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"
        ),
        *shared_expert_rules("mlp.shared_expert."),
        WeightRule(
            "decoder.layers.{layer}.mlp.shared_experts.gate_weight",
            "model.layers.{layer}.mlp.shared_expert_gate.weight",
        ),
    ),
    config_class=ExtendedModelConfig,
)
