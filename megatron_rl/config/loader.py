"""Recipes and overrides -> ``TrainerRunConfig``.

``load_config(recipe, overrides)`` reads a YAML recipe (a built-in one by name, e.g. ``"dapo"``
or ``"gpu/qwen3_30b_a3b_grpo"``, or a file path), follows its ``base:`` chain (a recipe extends
another: the base is merged first, the recipe on top; a ``base`` ending in ``.yaml`` is a path
relative to the including file, anything else a recipe name), applies Hydra-style ``key=value``
overrides, resolves OmegaConf interpolations (``${data.max_prompt_length}``, ``${oc.env:HOME}``)
and builds the typed tree. Every key -- in each YAML file, in each override, in a mapping given
to ``TrainerRunConfig.from_dict`` -- must exist in the schema; an unknown key is a
``ValueError`` naming it, where it came from and the nearest valid keys (difflib, plus the
same name at other places in the tree). Values are type-checked per field (ints become floats
where a float is expected; nothing else is converted).

Built-in recipes live in the repository's ``recipes/`` directory; an installed wheel carries
them as package data under ``megatron_rl/recipes`` (see setup.py).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from megatron_rl.config.base import BaseConfig
from megatron_rl.config.trainer import DERIVED_KEYS, TrainerRunConfig

__all__ = [
    "DEFAULT_RECIPE",
    "load_config",
    "compose",
    "list_recipes",
    "find_recipe",
    "recipe_dirs",
    "build_config",
    "fill_derived",
    "dump_config",
]

DEFAULT_RECIPE = "grpo"
"""The CPU toy run of ``megatron-rl train`` with no arguments."""
_SUFFIX = ".yaml"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../megatron_rl


# ----------------------------------------------------------------------------- recipe files
def recipe_dirs() -> list[Path]:
    """Directories holding built-in recipes: ``megatron_rl/recipes`` (installed wheel) and the
    source checkout's ``recipes/`` (next to setup.py)."""
    candidates = [_PACKAGE_DIR / "recipes"]
    if (_PACKAGE_DIR.parent / "setup.py").is_file():
        candidates.append(_PACKAGE_DIR.parent / "recipes")
    return [d for d in candidates if d.is_dir()]


def list_recipes() -> list[str]:
    """Names of the built-in recipes (``grpo``, ``gpu/qwen3_30b_a3b_grpo`` ...), sorted."""
    names = set()
    for root in recipe_dirs():
        names.update(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob(f"*{_SUFFIX}"))
    return sorted(names)


def find_recipe(recipe: Union[str, os.PathLike]) -> Path:
    """The file of ``recipe``: an existing path, or a built-in recipe name (``.yaml`` optional)."""
    path = Path(os.path.expanduser(str(recipe)))
    if path.is_file():
        return path
    name = str(recipe)[: -len(_SUFFIX)] if str(recipe).endswith(_SUFFIX) else str(recipe)
    for root in recipe_dirs():
        candidate = root / f"{name}{_SUFFIX}"
        if candidate.is_file():
            return candidate
    names = list_recipes()
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"unknown recipe {str(recipe)!r}: not a file and not a built-in recipe; "
                     f"built-in recipes: {names}{hint}")


# ----------------------------------------------------------------------------- schema
@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type hint of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _config_class(hint: Any) -> Optional[type]:
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


@functools.lru_cache(maxsize=None)
def _all_paths(root: type) -> tuple[str, ...]:
    """Every dotted key of the schema under ``root`` (config sections included)."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, hint in _fields(cls).items():
            out.append(prefix + name)
            sub = _config_class(hint)
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
    return ValueError(f"unknown config key {full!r}{where}; valid keys under {parent or 'the top level'!r}: "
                      f"{sorted(names)}")


def check_key(root: type, key: str, *, source: Optional[str] = None) -> Any:
    """Check dotted ``key`` against the schema of ``root``; return the field's type hint (or
    ``Any`` for a key inside a free-form mapping)."""
    cls, parts = root, key.split(".")
    for i, part in enumerate(parts):
        full = ".".join(parts[: i + 1])
        if part not in _fields(cls):
            raise _unknown_key(root, cls, full, source)
        hint = _fields(cls)[part]
        if i == len(parts) - 1:
            return hint
        sub = _config_class(hint)
        if sub is None:
            if _free_form(hint):
                return Any
            where = f" in {source}" if source else ""
            raise ValueError(f"config key {full!r} is a value, not a section; {key!r}{where} cannot be set")
        cls = sub
    return Any  # pragma: no cover - the loop always returns


def check_keys(root: type, data: Mapping, *, source: Optional[str] = None, _cls: type = None,
               _prefix: str = "") -> None:
    """Check every key of nested mapping ``data`` against the schema (types are left to ``build_config``)."""
    cls = _cls or root
    for key, value in data.items():
        full = f"{_prefix}{key}"
        if key not in _fields(cls):
            raise _unknown_key(root, cls, full, source)
        sub = _config_class(_fields(cls)[key])
        if sub is not None and isinstance(value, Mapping):
            check_keys(root, value, source=source, _cls=sub, _prefix=f"{full}.")


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    return getattr(hint, "__name__", str(hint))


def _coerce(hint: Any, value: Any, name: str) -> Any:
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
                return _coerce(arg, value, name)
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


def _plain(data: Any) -> Any:
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
    data = _plain(data)
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or cls.__name__} must be a mapping (a config section), got {data!r}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in _fields(cls):
            raise _unknown_key(root, cls, full, None)
        hint = _fields(cls)[key]
        sub = _config_class(hint)
        if sub is not None and not isinstance(value, sub):
            if value is None and _optional(hint):
                kwargs[key] = None
            else:
                kwargs[key] = build_config(sub, value, path=full, root=root)
        else:
            kwargs[key] = _coerce(hint, value, full)
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ValueError(_qualify(str(err), path, cls)) from None


def _qualify(message: str, path: str, cls: type) -> str:
    """A section's own error message with the section's full dotted path in front of the field."""
    if not path or message.startswith(path):
        return message
    last = path.rpartition(".")[2]
    if message.startswith(f"{last}."):  # "actor.loss_agg_mode=..." -> "actor_rollout_ref.actor.loss_agg_mode=..."
        return f"{path}.{message[len(last) + 1:]}"
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


def fill_derived(data: Any, root: type = TrainerRunConfig) -> dict:
    """A copy of ``data`` with each missing ``DERIVED_KEYS`` target set from its source (the
    source's value in ``data``, else its default) -- verl's ``${oc.select:...}`` defaults."""
    out = copy.deepcopy(_plain(data))
    if not isinstance(out, Mapping):
        raise ValueError(f"a run configuration must be a mapping, got {out!r}")
    for target, source in DERIVED_KEYS:
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


# ----------------------------------------------------------------------------- YAML + overrides
def _load_chain(path: Path, stack: tuple[Path, ...]):
    """The recipe at ``path`` merged on top of its ``base`` chain (a ``DictConfig``, unresolved)."""
    from omegaconf import DictConfig, OmegaConf

    path = path.resolve()
    if path in stack:
        raise ValueError(f"recipe inheritance cycle: {' -> '.join(str(p) for p in (*stack, path))}")
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig):
        raise ValueError(f"recipe {path} must be a YAML mapping, got {type(raw).__name__}")
    base = raw.pop("base", None)
    check_keys(TrainerRunConfig, OmegaConf.to_container(raw, resolve=False), source=str(path))
    if base is None:
        return raw
    bases = list(base) if not isinstance(base, str) else [base]
    parents = [_load_chain(_resolve_base(str(b), path), (*stack, path)) for b in bases]
    return OmegaConf.merge(*parents, raw)


def _resolve_base(base: str, including: Path) -> Path:
    if base.endswith(_SUFFIX):
        relative = including.parent / os.path.expanduser(base)
        if relative.is_file():
            return relative
    try:
        return find_recipe(base)
    except ValueError as err:
        raise ValueError(f"base {base!r} of recipe {including}: {err}") from None


def _parse_override(item: str) -> tuple[str, Any]:
    from omegaconf import OmegaConf

    if not isinstance(item, str) or "=" not in item:
        raise ValueError(f"override {item!r} must look like key=value (e.g. algorithm.adv_estimator=rloo)")
    key, value = item.split("=", 1)
    key = key.strip()
    if key.startswith("~"):
        raise ValueError(f"override {item!r}: deleting keys (~key) is not supported; set the key to null")
    key = key.lstrip("+")  # Hydra's "+key" / "++key": every settable key already exists here
    if not key:
        raise ValueError(f"override {item!r} has an empty key")
    # OmegaConf's YAML rules: 1e-5 is a float, null is None, [a,b] a list, {k: v} a mapping.
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={value}"]), resolve=False)["value"]
    return key, parsed


def compose(recipe: Union[str, os.PathLike, None] = None, overrides: Sequence[str] = ()) -> dict:
    """The merged, interpolation-resolved configuration of ``recipe`` + ``overrides`` as plain
    data (before derived keys are filled and types are built)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    cfg = _load_chain(find_recipe(DEFAULT_RECIPE if recipe is None else recipe), ())
    for item in overrides:
        key, value = _parse_override(item)
        source = f"override {item!r}"
        hint = check_key(TrainerRunConfig, key, source=source)
        sub = _config_class(hint)
        if sub is not None and isinstance(value, Mapping):
            check_keys(TrainerRunConfig, value, source=source, _cls=sub, _prefix=f"{key}.")
        elif sub is None and not (isinstance(value, str) and "${" in value):
            try:
                value = _coerce(hint, value, key)
            except ValueError as err:
                raise ValueError(f"{err} (in {source})") from None
        OmegaConf.update(cfg, key, value, merge=False)
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(f"cannot resolve the configuration: {err}") from None


def load_config(recipe: Union[str, os.PathLike, None] = None, overrides: Sequence[str] = ()) -> TrainerRunConfig:
    """The validated ``TrainerRunConfig`` of ``recipe`` (built-in name or YAML path; None = the
    CPU toy ``grpo``) with Hydra-style ``key=value`` ``overrides`` applied in order."""
    return TrainerRunConfig.from_dict(compose(recipe, overrides))


def dump_config(cfg: BaseConfig) -> str:
    """``cfg`` as YAML that ``load_config`` reads back to an equal config (for the run directory)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
