"""Where ``plan`` gets a model's architecture without loading its weights.

In order: an inline ``ModelConfig`` (toy recipes); an HF checkpoint directory whose
``config.json`` exists (read through the model family, as training would); else a built-in
table of published architectures, chosen by an explicit name or by the checkpoint path's
basename (``~/models/Qwen3-30B-A3B`` -> ``qwen3_30b_a3b``). GPU recipes name checkpoints that
are not on the machine running the dry run, hence the table.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_rl.config.model import ModelConfig
from megatron_rl.models.extended import ExtendedModelConfig

__all__ = ["KNOWN_ARCHITECTURES", "resolve_architecture", "architecture_from_path"]

KNOWN_ARCHITECTURES: dict[str, ModelConfig] = {
    # Qwen/Qwen3-30B-A3B config.json: every layer MoE.
    "qwen3_30b_a3b": ModelConfig(
        num_layers=48,
        hidden_size=2048,
        ffn_hidden_size=6144,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rotary_base=1_000_000.0,
        qk_layernorm=True,
        num_moe_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
        params_dtype="bfloat16",
    ),
    # Qwen/Qwen3-235B-A22B config.json.
    "qwen3_235b_a22b": ModelConfig(
        num_layers=94,
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_attention_heads=64,
        num_query_groups=4,
        kv_channels=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rotary_base=1_000_000.0,
        qk_layernorm=True,
        num_moe_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=1536,
        params_dtype="bfloat16",
    ),
    # Qwen/Qwen3-32B config.json (the on-policy-distillation teacher of gpu/qwen3_30b_a3b_opd).
    "qwen3_32b": ModelConfig(
        num_layers=64,
        hidden_size=5120,
        ffn_hidden_size=25600,
        num_attention_heads=64,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rotary_base=1_000_000.0,
        qk_layernorm=True,
        params_dtype="bfloat16",
    ),
    # meta-llama/Llama-3.1-70B(-Instruct) config.json.
    "llama3_1_70b": ModelConfig(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rotary_base=500_000.0,
        rope_scaling=True,
        rope_scaling_factor=8.0,
        params_dtype="bfloat16",
    ),
}
# deepseek-ai/DeepSeek-V3 (and -R1, same architecture) config.json: MLA, YaRN x40, 3 dense layers then
# 256 sigmoid-routed experts in 8 groups (4 chosen), top-8, one shared expert; 671.0B parameters
# (37.6B active) without the MTP layer.
KNOWN_ARCHITECTURES["deepseek_v3"] = ExtendedModelConfig(
    num_layers=61,
    hidden_size=7168,
    ffn_hidden_size=18432,
    num_attention_heads=128,
    num_query_groups=128,
    kv_channels=128,
    vocab_size=129280,
    max_position_embeddings=163840,
    layernorm_epsilon=1e-6,
    multi_latent_attention=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    rope_type="yarn",
    rotary_scaling_factor=40.0,
    original_max_position_embeddings=4096,
    mscale=1.0,
    mscale_all_dim=1.0,
    num_moe_experts=256,
    moe_router_topk=8,
    moe_ffn_hidden_size=2048,
    moe_shared_expert_intermediate_size=2048,
    moe_layer_freq=(0,) * 3 + (1,) * 58,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
    params_dtype="bfloat16",
)
KNOWN_ARCHITECTURES["deepseek_r1"] = KNOWN_ARCHITECTURES["deepseek_v3"]
# zai-org/GLM-4.5 config.json: GQA 96/8 heads with QKV bias and QK-norm, half-rotary, 3 dense layers
# then 160 sigmoid-routed experts, top-8, one shared expert; 352.8B parameters without the MTP layer.
KNOWN_ARCHITECTURES["glm4_5"] = ExtendedModelConfig(
    num_layers=92,
    hidden_size=5120,
    ffn_hidden_size=12288,
    num_attention_heads=96,
    num_query_groups=8,
    kv_channels=128,
    vocab_size=151552,
    max_position_embeddings=131072,
    rotary_base=1_000_000.0,
    rotary_percent=0.5,
    layernorm_epsilon=1e-5,
    qk_layernorm=True,
    add_qkv_bias=True,
    num_moe_experts=160,
    moe_router_topk=8,
    moe_ffn_hidden_size=1536,
    moe_shared_expert_intermediate_size=1536,
    moe_layer_freq=(0,) * 3 + (1,) * 89,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5,
    params_dtype="bfloat16",
)
# zai-org/GLM-4.5-Air config.json: 1 dense layer then 128 experts, no QK-norm; 106.9B parameters.
KNOWN_ARCHITECTURES["glm4_5_air"] = ExtendedModelConfig(
    num_layers=46,
    hidden_size=4096,
    ffn_hidden_size=10944,
    num_attention_heads=96,
    num_query_groups=8,
    kv_channels=128,
    vocab_size=151552,
    max_position_embeddings=131072,
    rotary_base=1_000_000.0,
    rotary_percent=0.5,
    layernorm_epsilon=1e-5,
    add_qkv_bias=True,
    num_moe_experts=128,
    moe_router_topk=8,
    moe_ffn_hidden_size=1408,
    moe_shared_expert_intermediate_size=1408,
    moe_layer_freq=(0,) + (1,) * 45,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    params_dtype="bfloat16",
)
"""Published architectures (name -> ``ModelConfig``), for checkpoints not present locally."""


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def architecture_from_path(path: str) -> Optional[str]:
    """The table name whose squashed form occurs in the path's basename (longest match), else None.

    ``Qwen3-235B-A22B-Instruct-2507`` -> ``qwen3_235b_a22b``; ``Meta-Llama-3.1-70B`` -> ``llama3_1_70b``.
    """
    base = _squash(Path(os.path.expanduser(str(path)).rstrip("/")).name)
    hits = [name for name in KNOWN_ARCHITECTURES if _squash(name) in base]
    return max(hits, key=len) if hits else None


def _apply_overrides(model: ModelConfig, overrides: Mapping[str, Any] | None) -> ModelConfig:
    return dataclasses.replace(model, **dict(overrides or {})) if overrides else model


def resolve_architecture(
    where: str,
    *,
    path: Optional[str],
    config: Any = None,
    overrides: Mapping[str, Any] | None = None,
    architecture: Optional[str] = None,
) -> tuple[ModelConfig, str]:
    """``(ModelConfig, where it came from)`` for a model source; ``ValueError`` naming ``where``
    when the architecture cannot be determined."""
    if config is not None:
        model = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(dict(config))
        return _apply_overrides(model, overrides), "inline config"
    if architecture is not None:
        if architecture not in KNOWN_ARCHITECTURES:
            raise ValueError(
                f"architecture={architecture!r} is not a known architecture; choose one of "
                f"{sorted(KNOWN_ARCHITECTURES)}"
            )
        return _apply_overrides(KNOWN_ARCHITECTURES[architecture], overrides), f"table:{architecture}"
    if path is None:
        raise ValueError(f"{where}: no model (neither a checkpoint path nor an inline config)")
    local = Path(os.path.expanduser(str(path)))
    if (local / "config.json").is_file():
        from megatron_rl.models.families import get_family, load_hf_config

        hf = load_hf_config(str(local))
        family = get_family(hf)
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        extra = {k: v for k, v in dict(overrides or {}).items() if k in fields}
        model = family.model_config(hf, params_dtype="bfloat16")
        return _apply_overrides(model, extra), f"{local}/config.json"
    name = architecture_from_path(str(path))
    if name is None:
        raise ValueError(
            f"{where}={path!r}: no config.json there and its name matches no known architecture "
            f"{sorted(KNOWN_ARCHITECTURES)}; pass --architecture NAME (or a local checkpoint directory)"
        )
    return _apply_overrides(KNOWN_ARCHITECTURES[name], overrides), f"table:{name}"
