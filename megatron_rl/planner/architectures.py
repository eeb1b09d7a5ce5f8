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

__all__ = ["KNOWN_ARCHITECTURES", "resolve_architecture", "architecture_from_path"]

KNOWN_ARCHITECTURES: dict[str, ModelConfig] = {
    # Qwen/Qwen3-30B-A3B config.json: every layer MoE.
    "qwen3_30b_a3b": ModelConfig(
        num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
        kv_channels=128, vocab_size=151936, max_position_embeddings=40960, rotary_base=1_000_000.0,
        qk_layernorm=True, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        params_dtype="bfloat16"),
    # Qwen/Qwen3-235B-A22B config.json.
    "qwen3_235b_a22b": ModelConfig(
        num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64, num_query_groups=4,
        kv_channels=128, vocab_size=151936, max_position_embeddings=40960, rotary_base=1_000_000.0,
        qk_layernorm=True, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536,
        params_dtype="bfloat16"),
    # Qwen/Qwen3-32B config.json (the on-policy-distillation teacher of gpu/qwen3_30b_a3b_opd).
    "qwen3_32b": ModelConfig(
        num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64, num_query_groups=8,
        kv_channels=128, vocab_size=151936, max_position_embeddings=40960, rotary_base=1_000_000.0,
        qk_layernorm=True, params_dtype="bfloat16"),
    # meta-llama/Llama-3.1-70B(-Instruct) config.json.
    "llama3_1_70b": ModelConfig(
        num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
        kv_channels=128, vocab_size=128256, max_position_embeddings=131072, rotary_base=500_000.0,
        rope_scaling=True, rope_scaling_factor=8.0, params_dtype="bfloat16"),
}
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


def resolve_architecture(where: str, *, path: Optional[str], config: Any = None,
                         overrides: Mapping[str, Any] | None = None,
                         architecture: Optional[str] = None) -> tuple[ModelConfig, str]:
    """``(ModelConfig, where it came from)`` for a model source; ``ValueError`` naming ``where``
    when the architecture cannot be determined."""
    if config is not None:
        model = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(dict(config))
        return _apply_overrides(model, overrides), "inline config"
    if architecture is not None:
        if architecture not in KNOWN_ARCHITECTURES:
            raise ValueError(f"architecture={architecture!r} is not a known architecture; choose one of "
                             f"{sorted(KNOWN_ARCHITECTURES)}")
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
            f"{sorted(KNOWN_ARCHITECTURES)}; pass --architecture NAME (or a local checkpoint directory)")
    return _apply_overrides(KNOWN_ARCHITECTURES[name], overrides), f"table:{name}"
