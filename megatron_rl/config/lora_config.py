"""``LoRAConfig``: verl 0.9.1's ``*.model.lora`` section (Megatron LoRA), and its older flat keys.

verl 0.9.1 writes Megatron LoRA as ``actor_rollout_ref.model.lora.{type, merge, rank, alpha, dropout,
target_modules, exclude_modules, dropout_position, lora_A_init_method, lora_B_init_method,
a2a_experimental, dtype, adapter_path, freeze_*}`` and keeps its FSDP-era flat keys
``model.{lora_rank, lora_alpha, target_modules, exclude_modules, lora_adapter_path}`` beside them.
``resolve_lora`` turns a model section's keys (either form, not both) into one ``LoRAConfig``
(``ModelSourceConfig.lora_config()``); the trainer hands the actor's to its workers
(``megatron_rl.trainer.placement``) and the engine (``megatron_rl.engine.lora_layers``) acts on it. What is not built is refused by name here, before
any worker starts: ``type`` other than ``lora``, ``a2a_experimental``. ``adapter_path`` starts the
adapters from a saved PEFT adapter directory (``megatron_rl.engine.lora_peft.load_peft_adapter``; its
``r`` / ``lora_alpha`` must be ``rank`` / ``alpha``). ``merge: false`` (verl's default) syncs only the adapters into vLLM's LoRA
(``vllm_lora_engine_kwargs`` starts the engine with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from megatron_rl.config.base_config import BaseConfig, check_choice

__all__ = [
    "LoRAConfig",
    "resolve_lora",
    "check_lora_fits",
    "lora_target_shapes",
    "LORA_TARGET_MODULES",
    "LORA_INIT_METHODS",
    "VLLM_LORA_RANKS",
    "vllm_lora_rank",
    "vllm_lora_engine_kwargs",
]

LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's linear names an adapter can wrap (also inside MoE experts)."""
LORA_INIT_METHODS = ("xavier", "normal", "kaiming", "zero")
_DTYPES = (None, "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
_HF_ALL_LINEAR = "all-linear"


@dataclasses.dataclass
class LoRAConfig(BaseConfig):
    """``*.model.lora`` (verl 0.9.1's Megatron LoRA). ``rank: 0`` = no LoRA (train every parameter)."""

    type: str = "lora"
    """Adapter kind: only ``lora`` is built (``dora`` and others are refused)."""
    merge: bool = False
    """Weight sync: True streams the merged weights ``W + alpha/rank * B A`` under their HF names;
    False (verl's default) moves only the adapters into vLLM's LoRA (the engine starts with
    ``enable_lora``; generation uses the adapter; the base weights in vLLM are never touched)."""
    rank: int = 0
    """Adapter rank r; 0 = LoRA off."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout probability on the adapter path."""
    target_modules: list = dataclasses.field(default_factory=lambda: list(LORA_TARGET_MODULES))
    """Megatron linears that get adapters, any of ``LORA_TARGET_MODULES``."""
    exclude_modules: list = dataclasses.field(default_factory=list)
    """Module names (a leaf name or a substring of the full name) left without adapters."""
    dropout_position: str = "pre"
    """``pre``: dropout on the adapter's input; ``post``: on its output."""
    lora_A_init_method: str = "xavier"
    """Initialisation of A, one of ``LORA_INIT_METHODS``."""
    lora_B_init_method: str = "zero"
    """Initialisation of B, one of ``LORA_INIT_METHODS`` (``zero``: the step-0 model is the base)."""
    a2a_experimental: bool = False
    """verl's experimental all-to-all adapter path for MoE experts: not built (refused when True)."""
    dtype: Optional[str] = None
    """Adapter parameter dtype; None = the base weights' dtype."""
    adapter_path: Optional[str] = None
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, e.g. an earlier run's
    ``final_hf/lora_adapter``) whose adapters the actor starts from instead of ``lora_*_init_method``."""
    freeze_vision_model: bool = True
    """verl's multimodal switch; there is no vision tower here (refused when False)."""
    freeze_vision_projection: bool = True
    """verl's multimodal switch; there is no vision projection here (refused when False)."""
    freeze_language_model: bool = True
    """The base language model stays frozen under LoRA (refused when False: that is full fine-tuning)."""

    def __post_init__(self) -> None:
        check_choice("lora.type", self.type, ("lora",))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank: {self.rank!r} is not allowed; an integer >= 0 (0 = LoRA off)")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha: {self.alpha!r} is not allowed; a number > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: {self.dropout!r} is not allowed; 0 <= dropout < 1")
        check_choice("lora.dropout_position", self.dropout_position, ("pre", "post"))
        check_choice("lora.lora_A_init_method", self.lora_A_init_method, LORA_INIT_METHODS)
        check_choice("lora.lora_B_init_method", self.lora_B_init_method, LORA_INIT_METHODS)
        check_choice("lora.dtype", self.dtype, _DTYPES)
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        if isinstance(self.exclude_modules, str):
            self.exclude_modules = [self.exclude_modules]
        self.target_modules = list(self.target_modules or [])
        self.exclude_modules = list(self.exclude_modules or [])
        bad = [t for t in self.target_modules if t not in LORA_TARGET_MODULES]
        if bad:
            raise ValueError(f"lora.target_modules: {bad} not allowed; each one of {list(LORA_TARGET_MODULES)}")
        if self.rank == 0:
            return
        if not self.target_modules:
            raise ValueError(
                "lora.target_modules: [] is not allowed with lora.rank > 0; name at least one of "
                f"{list(LORA_TARGET_MODULES)}"
            )
        refusals = {
            "a2a_experimental": (self.a2a_experimental, "the experimental all-to-all expert adapters are not built"),
            "freeze_language_model": (
                not self.freeze_language_model,
                "LoRA keeps the base frozen; for full fine-tuning set lora.rank=0",
            ),
            "freeze_vision_model": (not self.freeze_vision_model, "there is no vision tower"),
            "freeze_vision_projection": (not self.freeze_vision_projection, "there is no vision projection"),
        }
        for name, (refused, why) in refusals.items():
            if refused:
                raise ValueError(f"lora.{name}={getattr(self, name)!r} is refused with lora.rank={self.rank}: {why}")

    @property
    def enabled(self) -> bool:
        """True when adapters are built (``rank > 0``)."""
        return self.rank > 0


def resolve_lora(model: Mapping[str, Any] | Any, section: str = "actor_rollout_ref.model") -> LoRAConfig:
    """The one ``LoRAConfig`` of a model section (a mapping or an object with the keys as attributes):
    its ``lora`` mapping, or verl's flat keys (``lora_rank``, ``lora_alpha``, ``target_modules``,
    ``exclude_modules``, ``lora_adapter_path``; flat ``target_modules: all-linear`` is every Megatron
    linear). Setting both forms (both ranks > 0) is an error naming the keys. Flat keys carry
    ``merge: true`` (the flat form has no merge key)."""
    get = (
        (lambda k, d=None: model.get(k, d)) if isinstance(model, Mapping) else (lambda k, d=None: getattr(model, k, d))
    )
    nested = get("lora") or {}
    if isinstance(nested, LoRAConfig):
        nested = dataclasses.asdict(nested)
    if not isinstance(nested, Mapping):
        raise ValueError(f"{section}.lora={nested!r} must be a mapping of LoRA keys")
    flat_rank = get("lora_rank", 0) or 0
    if flat_rank and nested.get("rank", 0):
        raise ValueError(
            f"{section}.lora_rank={flat_rank} and {section}.lora.rank={nested.get('rank')} are both set; "
            f"use {section}.lora.* only"
        )
    if not flat_rank and nested.get("rank", 0):  # a flat key beside the lora section would be ignored: refuse it
        for nested_key, flat_key in _FLAT_KEYS.items():
            value = get(flat_key)
            if flat_key != "lora_rank" and not (value is None or value == [] or value == _FLAT_DEFAULTS[flat_key]):
                raise ValueError(
                    f"{section}.{flat_key}={value!r} is verl's older flat form, set beside "
                    f"{section}.lora.rank={nested['rank']}; set {section}.lora.{nested_key} instead"
                )
    if not flat_rank:
        return _build(dict(nested), f"{section}.lora")
    targets = get("target_modules", _HF_ALL_LINEAR)
    if targets in (None, _HF_ALL_LINEAR):
        targets = list(LORA_TARGET_MODULES)
    try:
        return _build(
            {
                "rank": flat_rank,
                "alpha": get("lora_alpha", 16),
                "target_modules": targets,
                "exclude_modules": get("exclude_modules") or [],
                "adapter_path": get("lora_adapter_path"),
                "merge": True,
            },
            section,
        )
    except ValueError as exc:  # name the flat key the user wrote, not the lora.* field it maps onto
        message = str(exc).removeprefix(f"{section}: ")
        for nested, flat in _FLAT_KEYS.items():
            message = message.replace(f"lora.{nested}=", f"{section}.{flat}=").replace(
                f"lora.{nested}:", f"{section}.{flat}:"
            )
        raise ValueError(message) from None


_FLAT_KEYS = {
    "rank": "lora_rank",
    "alpha": "lora_alpha",
    "target_modules": "target_modules",
    "exclude_modules": "exclude_modules",
    "adapter_path": "lora_adapter_path",
}
"""``LoRAConfig`` field -> verl's older flat key on the model section."""
_FLAT_DEFAULTS = {
    "lora_rank": 0,
    "lora_alpha": 16,
    "target_modules": _HF_ALL_LINEAR,
    "exclude_modules": None,
    "lora_adapter_path": None,
}
"""verl 0.9.1's defaults of the flat keys (its generated config sets them beside ``lora``)."""


def _build(values: dict, where: str) -> LoRAConfig:
    names = {f.name for f in dataclasses.fields(LoRAConfig)}
    unknown = sorted(set(values) - names - {"_target_"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed {sorted(names)}")
    values.pop("_target_", None)
    try:
        return LoRAConfig(**values)
    except ValueError as exc:  # name the section the user wrote
        raise ValueError(f"{where}: {exc}") from None


def lora_target_shapes(model_cfg: Any) -> dict[str, list[tuple[int, int]]]:
    """``{target: [(out, in), ...]}`` of a ``ModelConfig``'s full (unsharded) linears, the MoE experts'
    ``linear_fc1``/``linear_fc2`` included (the router is no target)."""
    heads, groups = model_cfg.num_attention_heads, model_cfg.num_query_groups or model_cfg.num_attention_heads
    hidden, head_dim, gate = model_cfg.hidden_size, model_cfg.head_dim, 2 if model_cfg.swiglu else 1
    shapes = {
        "linear_qkv": [((heads + 2 * groups) * head_dim, hidden)],
        "linear_proj": [(hidden, heads * head_dim)],
        "linear_fc1": [],
        "linear_fc2": [],
    }
    widths = (
        [model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size]
        if model_cfg.is_moe
        else [model_cfg.ffn_hidden_size]
    )
    if model_cfg.is_moe and model_cfg.moe_shared_expert_intermediate_size:
        widths.append(model_cfg.moe_shared_expert_intermediate_size)
    for width in widths:
        shapes["linear_fc1"].append((gate * width, hidden))
        shapes["linear_fc2"].append((hidden, width))
    return shapes


def check_lora_fits(lora: LoRAConfig, model_cfg: Any, section: str = "actor_rollout_ref.model.lora") -> None:
    """``ValueError`` naming the key when ``lora.rank`` exceeds a targeted linear's dimensions (before
    any worker starts; the engine checks again on each local shard's full shape)."""
    if not lora.enabled:
        return
    shapes = lora_target_shapes(model_cfg)
    for target in lora.target_modules:
        for out_dim, in_dim in shapes[target]:
            if lora.rank > min(out_dim, in_dim):
                raise ValueError(
                    f"{section}.rank={lora.rank} is larger than {target}'s dimensions "
                    f"({out_dim} x {in_dim}); allowed: 1..{min(out_dim, in_dim)}"
                )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank`` (0 = no LoRA)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"max_lora_rank: {rank!r} is not allowed; an integer >= 0 (0 = no LoRA)")
    if rank == 0:
        return 0
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(
            f"lora.rank: {rank} is not allowed with lora.merge=false; vLLM holds adapters of rank <= "
            f"{VLLM_LORA_RANKS[-1]} (or set lora.merge=true)"
        )
    return fits[0]


def vllm_lora_engine_kwargs(lora: LoRAConfig) -> dict:
    """The ``vllm.LLM`` arguments an adapter-only sync needs (``lora.merge: false``): LoRA on, one
    adapter slot of at least ``lora.rank``; ``{}`` when the merged weights are synced or LoRA is off."""
    if not lora.enabled or lora.merge:
        return {}
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora.rank), "max_loras": 1}
