"""The schema machinery under every config: dotted keys checked against the dataclass tree,
nearest-key suggestions, leaf type checks, and ``build_config`` (nested mapping -> dataclasses).

Every key -- in a YAML file, an override, a mapping given to ``RunConfig.from_dict`` --
must exist in the schema; an unknown key is a ``ValueError`` naming it, where it came from and
the nearest valid keys (difflib, plus the same name at other places in the tree). Values are
type-checked per field (ints become floats where a float is expected; nothing else is converted).
verl's own keys are the exception (``megatron_rl.config.verl_keys``): ``_target_`` is checked and
dropped, and a verl key listed in ``INERT_KEYS`` that has no field is kept on its section as an
extra (warned when it differs from verl's default).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import typing
from collections.abc import Mapping
from typing import Any, Optional, Union

from megatron_rl.config import verl_keys as verl
from megatron_rl.config.base_config import BaseConfig, is_internal

__all__ = [
    "build_config",
    "check_key",
    "check_keys",
    "coerce",
    "config_class",
    "fill_derived",
    "plain",
    "all_paths",
    "field_hint",
]


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type hint of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not is_internal(f)}


def config_class(hint: Any) -> Optional[type]:
    """The ``BaseConfig`` subclass in ``X`` or ``Optional[X]``, else None."""
    for cand in typing.get_args(hint) or (hint,):
        if isinstance(cand, type) and issubclass(cand, BaseConfig):
            return cand
    return None


def _optional(hint: Any) -> bool:
    return hint is Any or type(None) in typing.get_args(hint)


def _free_form(hint: Any) -> bool:
    """A field whose value is an open mapping (``dict``/``Any``): keys below it are not checked."""
    return hint is Any or any(a is dict or typing.get_origin(a) is dict for a in (typing.get_args(hint) or (hint,)))


def field_hint(cls: type, name: str) -> Optional[tuple[Any, Optional[type]]]:
    """``(type hint, config section class or None)`` of field ``name`` of ``cls``, or None if there is no such field."""
    fields = _fields(cls)
    if name not in fields:
        return None
    return fields[name], config_class(fields[name])


def all_paths(root: type) -> tuple[str, ...]:
    """Every dotted key of the schema under ``root`` (config sections included)."""
    return _all_paths(root)


@functools.lru_cache(maxsize=None)
def _all_paths(root: type) -> tuple[str, ...]:
    """Every dotted key of the schema under ``root`` (config sections included)."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, hint in _fields(cls).items():
            out.append(prefix + name)
            sub = config_class(hint)
            if sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(root, "")
    return tuple(out)


def _unknown_key(root: type, cls: type, full: str, source: Optional[str]) -> ValueError:
    """The error for key ``full`` (whose last part is not a field of ``cls``), with suggestions."""
    parent, _, key = full.rpartition(".")
    names = list(_fields(cls))
    prefix = f"{parent}." if parent else ""
    nearest = [prefix + n for n in difflib.get_close_matches(key, names, n=3, cutoff=0.6)]
    # The same name at another place of the tree: a key put in the wrong section.
    nearest += [p for p in _all_paths(root) if p.rpartition(".")[2] == key and p not in nearest][:3]
    where = f" in {source}" if source else ""
    if nearest:
        return ValueError(f"unknown config key {full!r}{where}; nearest valid keys: {', '.join(map(repr, nearest))}")
    return ValueError(
        f"unknown config key {full!r}{where}; valid keys under {parent or 'the top level'!r}: {sorted(names)}"
    )


VERL_ONLY = object()
"""``check_key``'s answer for a verl key that has no field here but is accepted (inert)."""


def _verl_only_key(cls: type, full: str, key: str, value: Any = None) -> bool:
    """True when ``full`` (a key ``cls`` has no field for) is a verl key accepted without effect."""
    last = key.rpartition(".")[2]
    if last == "_target_" or verl.TRANSLATED.get(last) in _fields(cls):  # verl's global micro-batch sizes act
        return True
    base = verl.section_path(cls, full.rpartition(".")[0]) if "." in full else ""
    path = f"{base}.{full.rpartition('.')[2]}" if base else full
    return verl.verl_only_refusal(path, value) is None


def check_key(root: type, key: str, *, source: Optional[str] = None, value: Any = None) -> Any:
    """Check dotted ``key`` (to be set to ``value``) against the schema of ``root``; return the field's
    type hint (or ``Any`` for a key inside a free-form mapping, ``VERL_ONLY`` for an accepted verl-only key)."""
    cls, parts = root, key.split(".")
    for i, part in enumerate(parts):
        full = ".".join(parts[: i + 1])
        if part not in _fields(cls):
            last = i == len(parts) - 1
            if _verl_only_key(cls, key, key, value) if last else verl.verl_only_refusal(key, value) is None:
                return VERL_ONLY
            raise _unknown_key(root, cls, full, source)
        hint = _fields(cls)[part]
        if i == len(parts) - 1:
            return hint
        sub = config_class(hint)
        if sub is None:
            if _free_form(hint):
                return Any
            where = f" in {source}" if source else ""
            raise ValueError(f"config key {full!r} is a value, not a section; {key!r}{where} cannot be set")
        cls = sub
    return Any  # pragma: no cover - the loop always returns


def check_keys(
    root: type, data: Mapping, *, source: Optional[str] = None, _cls: type = None, _prefix: str = ""
) -> None:
    """Check every key of nested mapping ``data`` against the schema (types are left to ``build_config``)."""
    cls = _cls or root
    for key, value in data.items():
        full = f"{_prefix}{key}"
        if key not in _fields(cls):
            if key == "_target_":
                verl.check_target(cls, value, _prefix[:-1])
                continue
            if _verl_only_key(cls, full, full, value):
                continue
            raise _unknown_key(root, cls, full, source)
        sub = config_class(_fields(cls)[key])
        if sub is not None and isinstance(value, Mapping):
            check_keys(root, value, source=source, _cls=sub, _prefix=f"{full}.")


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    return getattr(hint, "__name__", str(hint))


def coerce(hint: Any, value: Any, name: str) -> Any:
    """``value`` checked against a leaf type ``hint`` (int -> float, list -> tuple where declared)."""
    if hint is Any:
        return value
    if typing.get_origin(hint) is Union:
        if value is None and type(None) in typing.get_args(hint):
            return None
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            try:
                return coerce(arg, value, name)
            except ValueError:
                continue
    else:
        origin = typing.get_origin(hint) or hint
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is str and isinstance(value, str):
            return value
        if origin in (list, tuple) and isinstance(value, (list, tuple)):
            return origin(value)
        if origin is dict and isinstance(value, Mapping):
            return dict(value)
        if origin not in (bool, int, float, str, list, tuple, dict):
            return value  # a type this checker does not know: the dataclass validates it
    raise ValueError(f"{name}={value!r} has the wrong type; expected {_type_name(hint)}")


def plain(data: Any) -> Any:
    """A ``DictConfig``/``ListConfig`` as resolved plain containers; anything else unchanged."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(data, (DictConfig, ListConfig)):
        return OmegaConf.to_container(data, resolve=True)
    return data


def build_config(cls: type, data: Any, *, path: str = "", root: Optional[type] = None) -> BaseConfig:
    """Build config dataclass ``cls`` from nested mapping ``data``.

    Unknown keys raise with the nearest valid keys; leaf values are type-checked; a
    ``ValueError`` from a section's own validation is prefixed with the section's dotted path.
    """
    root = root or cls
    data = plain(data)
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or cls.__name__} must be a mapping (a config section), got {data!r}")
    kwargs: dict[str, Any] = {}
    data, extras = verl.take_verl_extras(
        cls, set(_fields(cls)), data, path, unknown=lambda c, full: _unknown_key(root, c, full, None)
    )
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        hint = _fields(cls)[key]
        sub = config_class(hint)
        if sub is not None and not isinstance(value, sub):
            if value is None and _optional(hint):
                kwargs[key] = None
            else:
                kwargs[key] = build_config(sub, value, path=full, root=root)
        else:
            kwargs[key] = coerce(hint, value, full)
    try:
        built = cls(**kwargs)
    except ValueError as err:
        raise ValueError(_qualify(str(err), path, cls)) from None
    verl.warn_verl_extras(cls, extras, path)  # accepted for verl, no effect: warned, not kept
    return built


def _qualify(message: str, path: str, cls: type) -> str:
    """A section's own error message with the section's full dotted path in front of the field."""
    if not path or message.startswith(path):
        return message
    last = path.rpartition(".")[2]
    if message.startswith(f"{last}."):  # "actor.loss_agg_mode=..." -> "actor_rollout_ref.actor.loss_agg_mode=..."
        return f"{path}.{message[len(last) + 1 :]}"
    if any(message.startswith(f"{name}=") for name in _fields(cls)):
        return f"{path}.{message}"
    return f"{path}: {message}"


# ----------------------------------------------------------------------------- derived keys
_MISSING = object()


def _get(data: Mapping, key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _default(root: type, key: str) -> Any:
    """The default of dotted ``key`` in ``root``'s schema, as plain data."""
    first, _, rest = key.partition(".")
    f = {f.name: f for f in dataclasses.fields(root)}[first]
    node = f.default_factory() if f.default is dataclasses.MISSING else f.default
    for part in rest.split(".") if rest else ():
        node = getattr(node, part)
    return node.to_dict() if isinstance(node, BaseConfig) else copy.deepcopy(node)


def fill_derived(data: Any, root: type, derived_keys) -> dict:
    """A copy of ``data`` with each missing ``DERIVED_KEYS`` target set from its source (the
    source's value in ``data``, else its default) -- verl's ``${oc.select:...}`` defaults."""
    out = copy.deepcopy(plain(data))
    if not isinstance(out, Mapping):
        raise ValueError(f"a run configuration must be a mapping, got {out!r}")
    verl.normalize(out)  # verl's deprecated global micro-batch sizes, null per-GPU sizes
    for target, source in derived_keys:
        if _get(out, target) is not _MISSING:
            continue
        value = _get(out, source)
        value = _default(root, source) if value is _MISSING else copy.deepcopy(value)
        *parents, last = target.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break  # e.g. a section set to null: build_config reports it
        else:
            node[last] = value
    return out
