"""Llama 2 / 3.x (incl. Llama-3.1 RoPE scaling): dense SwiGLU decoder, GQA, no biases."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.families import DENSE_MLP_RULES, Family, llama_like_kwargs, reject


def _config_kwargs(cfg: Any) -> dict[str, Any]:
    for field in ("attention_bias", "mlp_bias"):
        # Megatron has one switch for all non-QKV linear biases; Llama checkpoints use none.
        if getattr(cfg, field, False):
            reject("llama", field, getattr(cfg, field), "False")
    return llama_like_kwargs("llama", cfg)


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    config_kwargs=_config_kwargs,
    mlp_rules=DENSE_MLP_RULES,
)
