"""GLM-4.5 / GLM-4.5-Air (HF ``Glm4MoeForCausalLM``): GQA attention with a QKV bias, optional
QK-norm and partial rotary embeddings, first-k dense layers, then sigmoid-routed experts with an
expert bias and a shared expert (DeepSeek-V3's MoE, ``deepseek_v3.MOE_RULES``).

``partial_rotary_factor`` becomes ``rotary_percent`` (the first fraction of each head is rotated,
rotate-half style, in both), ``use_qk_norm`` ``qk_layernorm``, ``attention_bias`` ``add_qkv_bias``
(HF's ``o_proj`` has no bias). Multi-token prediction layers in a hub checkpoint
(``model.layers.{num_hidden_layers + i}``) are handled as DeepSeek-V3's: checked at load, not
trained (a warning), carried through conversion and export bit for bit.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.deepseek_v3 import MOE_RULES, sigmoid_router_kwargs
from megatron_rl.models.extended import ExtendedModelConfig
from megatron_rl.models.families import Family, llama_like_kwargs

__all__ = ["FAMILY"]


def _config_kwargs(cfg: Any) -> dict[str, Any]:
    f = "glm4_moe"
    return dict(
        llama_like_kwargs(f, cfg, partial_rotary=True),
        add_qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        qk_layernorm=bool(getattr(cfg, "use_qk_norm", False)),
        **sigmoid_router_kwargs(f, cfg),
    )


FAMILY = Family(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    config_kwargs=_config_kwargs,
    mlp_rules=MOE_RULES,
    config_class=ExtendedModelConfig,
    mtp_layers=True,
)
