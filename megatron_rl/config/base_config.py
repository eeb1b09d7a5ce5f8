"""Typed-config base: dataclasses that also read like an OmegaConf ``DictConfig``.

Algorithm code accepts either a verl-style ``DictConfig`` or one of these dataclasses. Both
answer ``cfg.key``, ``cfg.get("key", default)`` and ``"key" in cfg``, so one code path serves
both. ``from_dict`` builds a config from a mapping (YAML, ``DictConfig``) and rejects unknown
keys, naming the key and the allowed ones.

A section takes its own fields only: its constructor is the dataclass's and ``from_dict`` refuses
a key it has not. verl's keys are translated once, at the edge (``megatron_rl.config.verl``): the
loader's ``RunConfig.from_dict`` / ``schema.build_config`` for a whole run, and for a section on
its own verl's converter (``omega_conf_to_dataclass``) and verl's class names
(``megatron_rl.config.verl.McoreActorConfig(ppo_micro_batch_size=2, ...)``): a ``_target_`` naming a
class that fits is dropped, the deprecated ``ppo_micro_batch_size`` sets the per-GPU size, and
verl-only fields listed in ``megatron_rl.config.compat.INERT_KEYS`` warn when they differ from
verl's default (they have no effect, and are not kept).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping
from typing import Any, Sequence

from megatron_rl.config import read_tracking

__all__ = [
    "BaseConfig",
    "suggest",
    "FrozenConfigError",
    "INTERNAL",
    "ROLLOUT_ENGINES",
    "TRAINING_ENGINES",
    "is_internal",
    "check_built",
    "check_choice",
    "check_range",
]

INTERNAL = {"internal": True}
"""Field metadata of a value the code sets while it runs (e.g. the per-step ``global_batch_info``):
not a configuration key -- a recipe or override cannot set it, and ``dump_config`` leaves it out."""


def is_internal(field: dataclasses.Field) -> bool:
    """True for a field marked ``INTERNAL``."""
    return bool(field.metadata.get("internal"))


def suggest(value: str, allowed) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the entries of ``allowed`` closest to ``value`` (difflib), else ``""``."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def check_choice(field: str, value: Any, allowed: Sequence[Any]) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; choose one of {list(allowed)}")


TRAINING_ENGINES = ("megatron",)
"""Training backends built here (verl's ``*.strategy``); verl's ``fsdp`` and ``fsdp2`` are not."""
ROLLOUT_ENGINES = ("vllm",)
"""Rollout engines built here (verl's ``rollout.name``); verl's ``sglang`` and ``trtllm`` are not."""


def check_built(field: str, value: Any, built: Sequence[str], kind: str) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is one of the ``built`` ``kind`` (e.g.
    "rollout engines"); verl's own choices this project does not build are refused by name, never
    replaced by a built one. verl leaves some of them unset (``'???'``): that is asked for."""
    if value in built:
        return
    if value == "???":
        raise ValueError(
            f"{field}={value!r} is unset (verl's config leaves it to the script); {kind} built here: {list(built)}"
        )
    raise ValueError(f"{field}={value!r} is not built here; {kind} built here: {list(built)}")


def check_range(
    field: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` lies in the given interval."""
    ok = True
    if low is not None:
        ok &= value >= low if low_inclusive else value > low
    if high is not None:
        ok &= value <= high if high_inclusive else value < high
    if not ok:
        lo = "(-inf" if low is None else ("[" if low_inclusive else "(") + f"{low}"
        hi = "inf)" if high is None else f"{high}" + ("]" if high_inclusive else ")")
        raise ValueError(f"{field}={value!r} is out of range; allowed: {lo}, {hi}")


class FrozenConfigError(dataclasses.FrozenInstanceError):
    """A field of a built run config was assigned to (``BaseConfig.freeze``)."""


@dataclasses.dataclass
class BaseConfig:
    """A dataclass with a read-only mapping interface compatible with ``DictConfig``.

    A run's config is built once (``RunConfig``: its sections are frozen when it is) and does not
    change after: assigning to a field raises ``FrozenConfigError`` naming it; code that derives a value
    returns it, or a changed copy (``replace``, ``with_values``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name[:1] != "_" and self.__dict__.get("_frozen"):
            where = self.__dict__.get(read_tracking.PATH_ATTR) or type(self).__name__
            raise FrozenConfigError(
                f"cannot assign {where}.{name}={value!r}: a built run config is immutable; derive a changed "
                "copy instead (config.with_values({'section.key': value}) or section.replace(key=value))"
            )
        object.__setattr__(self, name, value)

    def freeze(self) -> "BaseConfig":
        """Make this section and every section inside it immutable (``FrozenConfigError`` on assignment)."""
        for f in dataclasses.fields(self):
            value = self.__dict__.get(f.name)
            if isinstance(value, BaseConfig):
                value.freeze()
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        """True once ``freeze`` ran (every section of a built ``RunConfig``)."""
        return bool(self.__dict__.get("_frozen"))

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        if not hasattr(self, key):
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: str) -> bool:
        return hasattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def to_dict(self) -> dict[str, Any]:
        """The configuration keys as nested plain data (``INTERNAL`` fields left out): what a recipe
        could hold, and what ``from_dict`` reads back to an equal config."""
        out = {}
        for f in dataclasses.fields(self):
            if is_internal(f):
                continue
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, BaseConfig) else copy.deepcopy(value)
        return out

    def replace(self, **changes: Any) -> "BaseConfig":
        """A copy with ``changes`` (``dataclasses.replace``) that keeps this section's place in the run's tree;
        the copy of a frozen section is frozen too."""
        out = read_tracking.copy_tag(self, dataclasses.replace(self, **changes))
        return out.freeze() if self.frozen else out

    def with_values(self, values: Mapping[str, Any]) -> "BaseConfig":
        """A copy with the fields at the dotted paths of ``values`` set (``{"trainer.default_local_dir":
        "/runs/a"}``), every section on the way copied by ``replace`` and the copy validated as a built one
        is: how code derives a changed config from a built, immutable one. A derived key
        (``DERIVED_KEYS``, e.g. ``actor.rollout_n`` of ``rollout.n``) does not follow its changed source."""
        out = self
        for dotted, value in values.items():
            out = out._with_value(dotted.split("."), value, dotted)
        return out

    def _with_value(self, parts: list[str], value: Any, dotted: str) -> "BaseConfig":
        head, rest = parts[0], parts[1:]
        if head not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(f"{dotted!r}: {type(self).__name__} has no field {head!r}")
        inner = getattr(self, head)
        if rest and not isinstance(inner, BaseConfig):
            raise KeyError(f"{dotted!r}: {head!r} of {type(self).__name__} is not a config section")
        return self.replace(**{head: inner._with_value(rest, value, dotted) if rest else value})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, path: str = "") -> "BaseConfig":
        """Build from a mapping of this section's own keys, recursing into nested config fields; a key it
        has not is an error naming it and the allowed ones (verl's sections: ``megatron_rl.config.verl``)."""
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            try:  # OmegaConf DictConfig without importing omegaconf at module import
                from omegaconf import DictConfig, OmegaConf

                if isinstance(data, DictConfig):
                    data = OmegaConf.to_container(data, resolve=True)
            except ImportError:  # pragma: no cover - omegaconf is a dependency
                pass
        if not isinstance(data, Mapping):
            raise TypeError(f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls) if not is_internal(f)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            full = f"{path}.{key}" if path else str(key)
            if key not in names:
                raise ValueError(f"unknown config key {full!r}; allowed keys: {sorted(names)}")
            sub = _config_class(hints[key])
            if sub is not None and (value is None or isinstance(value, Mapping) or hasattr(value, "items")):
                value = None if value is None else sub.from_dict(value, path=full)
            kwargs[key] = value
        return cls(**kwargs)


def _config_class(hint: Any) -> type[BaseConfig] | None:
    """The BaseConfig subclass inside a type hint (``X`` or ``Optional[X]``), else None."""
    candidates = typing.get_args(hint) or (hint,)
    for cand in candidates:
        if isinstance(cand, type) and issubclass(cand, BaseConfig):
            return cand
    return None


if os.environ.get(read_tracking.TRACK_ENV):  # a process of a tracked test run (the variable is inherited)
    read_tracking.start(os.environ[read_tracking.TRACK_ENV], BaseConfig)
