"""Qwen3 (dense): Llama-style decoder with per-head RMSNorm on queries and keys (QK-norm)."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.families import (
    DENSE_MLP_RULES,
    Family,
    check_no_sliding_window,
    llama_like_kwargs,
    reject,
)


def _config_kwargs(cfg: Any) -> dict[str, Any]:
    check_no_sliding_window("qwen3", cfg)
    if getattr(cfg, "attention_bias", False):
        # Qwen3's attention_bias also adds an o_proj bias, which Megatron ties to the MLP biases.
        reject("qwen3", "attention_bias", cfg.attention_bias, "False")
    return dict(llama_like_kwargs("qwen3", cfg), qk_layernorm=True)


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    config_kwargs=_config_kwargs,
    mlp_rules=DENSE_MLP_RULES,
)
