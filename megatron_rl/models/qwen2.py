"""Qwen2 / Qwen2.5: Llama-style decoder with a bias on the Q, K and V projections."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.families import DENSE_MLP_RULES, Family, check_no_sliding_window, llama_like_kwargs


def _config_kwargs(cfg: Any) -> dict[str, Any]:
    check_no_sliding_window("qwen2", cfg)
    return dict(llama_like_kwargs("qwen2", cfg), add_qkv_bias=True)


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    config_kwargs=_config_kwargs,
    mlp_rules=DENSE_MLP_RULES,
)
