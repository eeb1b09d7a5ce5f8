"""Recipes and overrides -> ``TrainerRunConfig``.

``load_config(recipe, overrides)`` reads a YAML recipe (a built-in one by name, e.g. ``"dapo"``
or ``"gpu/qwen3_30b_a3b_grpo"``, or a file path), follows its ``base:`` chain (a recipe extends
another: the base is merged first, the recipe on top; a ``base`` ending in ``.yaml`` is a path
relative to the including file, anything else a recipe name), applies Hydra-style ``key=value``
overrides, resolves OmegaConf interpolations (``${data.max_prompt_length}``, ``${oc.env:HOME}``)
and builds the typed tree; keys and types are checked by ``megatron_rl.config.schema``.

Built-in recipes live in the repository's ``recipes/`` directory; an installed wheel carries
them as package data under ``megatron_rl/recipes`` (see setup.py).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence, Union

from megatron_rl.config.base import BaseConfig
from megatron_rl.config.schema import check_key, check_keys, coerce, config_class
from megatron_rl.config.trainer import TrainerRunConfig

__all__ = [
    "DEFAULT_RECIPE",
    "load_config",
    "compose",
    "list_recipes",
    "find_recipe",
    "recipe_dirs",
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
        sub = config_class(hint)
        if sub is not None and isinstance(value, Mapping):
            check_keys(TrainerRunConfig, value, source=source, _cls=sub, _prefix=f"{key}.")
        elif sub is None and not (isinstance(value, str) and "${" in value):
            try:
                value = coerce(hint, value, key)
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
