"""Recipes and overrides -> ``RunConfig``.

``load_config(recipe, overrides)`` reads a YAML recipe (a built-in one by name, e.g. ``"dapo"``
or ``"gpu/qwen3_30b_a3b_grpo"``, or a file path), follows its ``base:`` chain (a recipe extends
another: the base is merged first, the recipe on top; a ``base`` ending in ``.yaml`` is a path
relative to the including file, anything else a recipe name), applies Hydra-style ``key=value``
overrides, resolves OmegaConf interpolations (``${data.max_prompt_length}``, ``${oc.env:HOME}``)
and builds the typed tree; keys and types are checked by ``megatron_rl.config.schema``.

A verl config file loads the same way: Hydra's ``defaults:`` list works like ``base:`` (an entry
names a YAML file beside the including one, or ``ppo_megatron_trainer`` / ``ppo_trainer``, verl's
own config, kept in ``megatron_rl/config/verl``; ``_self_`` and ``model_engine: megatron`` are
accepted), a top-level ``hydra:`` section (Hydra's own settings) is dropped, and overrides take
Hydra's syntax: ``key=value``, ``+key=value`` (add a key the file does not have or holds as null, as
Hydra 1.3 does; an error if it holds a value), ``++key=value`` (add or override), ``~key`` / ``~key=value`` (delete; an error if the key
is missing) and ``key=null``. Keys of older verl versions (``reward_model.reward_kwargs.*``, ``actor.router_replay.*``
...) are read as their successors (``megatron_rl.config.verl_keys.LEGACY_KEYS``, each with a note).

Built-in recipes live in the repository's ``recipes/`` directory; an installed wheel carries
them as package data under ``megatron_rl/recipes`` (see setup.py).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence, Union

from megatron_rl.config.base_config import BaseConfig
from megatron_rl.config.schema import VERL_ONLY, check_key, check_keys, coerce, config_class
from megatron_rl.config.run_config import RunConfig
from megatron_rl.config.verl_keys import ONE_AS_LIST, migrate_legacy

__all__ = [
    "DEFAULT_RECIPE",
    "load_config",
    "compose",
    "list_recipes",
    "find_recipe",
    "recipe_dirs",
    "dump_config",
    "find_verl_config",
    "drop_engine_choice",
    "key_report",
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
    raise ValueError(
        f"unknown recipe {str(recipe)!r}: not a file and not a built-in recipe; built-in recipes: {names}{hint}"
    )


# ----------------------------------------------------------------------------- YAML + overrides
def _load_chain(path: Path, stack: tuple[Path, ...], check: bool = True):
    """The recipe at ``path`` merged on top of its ``base`` chain (a ``DictConfig``, unresolved)."""
    from omegaconf import DictConfig, OmegaConf

    path = path.resolve()
    if path in stack:
        raise ValueError(f"recipe inheritance cycle: {' -> '.join(str(p) for p in (*stack, path))}")
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig):
        raise ValueError(f"recipe {path} must be a YAML mapping, got {type(raw).__name__}")
    base = raw.pop("base", None)
    defaults = raw.pop("defaults", None)
    raw.pop("hydra", None)  # Hydra's own settings (run dirs, search paths), not the job's config
    if check:
        check_keys(RunConfig, OmegaConf.to_container(raw, resolve=False), source=str(path))
    if base is None:
        bases = []
    elif isinstance(base, str):
        bases = [base]
    else:
        bases = list(base)
    resolved = [_resolve_base(str(b), path) for b in bases] + _hydra_defaults(defaults, path)
    if not resolved:
        return raw
    parents = [_load_chain(p, (*stack, path), check) for p in resolved]
    return OmegaConf.merge(*parents, raw)


def _hydra_defaults(defaults: Any, including: Path) -> list[Path]:
    """The files of a Hydra ``defaults:`` list: ``name`` is ``name.yaml`` beside ``including`` or one of
    verl's own configs (``ppo_megatron_trainer``, ``ppo_trainer``); ``_self_`` (merge order: this file
    last) and a ``model_engine: megatron`` choice are accepted, other config-group choices are refused."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if defaults is None:
        return []
    entries = OmegaConf.to_container(defaults) if isinstance(defaults, (DictConfig, ListConfig)) else defaults
    if not isinstance(entries, list):
        raise ValueError(f"defaults of {including} must be a list, got {entries!r}")
    files = []
    for entry in entries:
        if entry == "_self_":
            continue
        if isinstance(entry, str):
            files.append(find_verl_config(entry, including.parent))
            continue
        if isinstance(entry, dict) and len(entry) == 1:
            group, choice = next(iter(entry.items()))
            if str(group).replace("override ", "").strip() == "model_engine" and choice == "megatron":
                continue
        raise ValueError(
            f"defaults entry {entry!r} of {including}: only config names, _self_ and "
            "'model_engine: megatron' are supported"
        )
    return files


def find_verl_config(name: str, config_dir: Union[str, os.PathLike, None] = None) -> Path:
    """The YAML file of config ``name`` (``.yaml`` optional): in ``config_dir`` if it is there, else verl's
    own ``ppo_megatron_trainer`` (``ppo_trainer`` too: verl's default config name; only the Megatron
    engine is built here), else a recipe or path (``find_recipe``)."""
    from megatron_rl.config.verl_keys import VERL_CONFIG_DIR

    stem = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name
    if config_dir is not None:
        candidate = Path(os.path.expanduser(str(config_dir))) / f"{stem}{_SUFFIX}"
        if candidate.is_file():
            return candidate
    if stem in ("ppo_megatron_trainer", "ppo_trainer"):
        return VERL_CONFIG_DIR / "ppo_megatron_trainer.yaml"
    return find_recipe(name)


def drop_engine_choice(overrides: Sequence[str]) -> list[str]:
    """``overrides`` without verl's ``model_engine=megatron`` (Hydra's config-group choice of the training
    engine, which ``main_ppo`` and ``plan`` take from a verl command line); any other engine is refused."""
    kept = []
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        if key == "model_engine":
            if value != "megatron":
                raise ValueError(f"model_engine={value!r}: only 'megatron' is built here")
            continue
        kept.append(item)
    return kept


def _resolve_base(base: str, including: Path) -> Path:
    if base.endswith(_SUFFIX):
        relative = including.parent / os.path.expanduser(base)
        if relative.is_file():
            return relative
    try:
        return find_recipe(base)
    except ValueError as err:
        raise ValueError(f"base {base!r} of recipe {including}: {err}") from None


def _parse_override(item: str) -> tuple[str, str, Any]:
    """``(op, key, value)`` of one Hydra override; ``op`` is ``set``, ``add`` (``+``), ``force`` (``++``)
    or ``delete`` (``~``)."""
    from omegaconf import OmegaConf

    if not isinstance(item, str):
        raise ValueError(f"override {item!r} must be a string like key=value")
    if item.startswith("~"):
        key = item[1:].split("=", 1)[0].strip()
        if not key:
            raise ValueError(f"override {item!r} has an empty key")
        return "delete", key, None
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key=value (e.g. algorithm.adv_estimator=rloo)")
    key, value = item.split("=", 1)
    key = key.strip()
    if key.startswith("++"):
        op = "force"
    elif key.startswith("+"):
        op = "add"
    else:
        op = "set"
    key = key.lstrip("+")
    if not key:
        raise ValueError(f"override {item!r} has an empty key")
    # OmegaConf's YAML rules: 1e-5 is a float, null is None, [a,b] a list, {k: v} a mapping.
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={value}"]), resolve=False)["value"]
    return op, key, parsed


def _has_key(cfg: Any, key: str) -> bool:
    from omegaconf import OmegaConf

    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    return node is not None and hasattr(node, "keys") and last in node


def compose(recipe: Union[str, os.PathLike, None] = None, overrides: Sequence[str] = (), *, check: bool = True) -> dict:
    """The merged, interpolation-resolved configuration of ``recipe`` + ``overrides`` as plain
    data (before derived keys are filled and types are built). ``check=False`` leaves unknown keys
    and override types to the caller (``key_report`` lists every refused key at once)."""
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    cfg = _load_chain(find_recipe(DEFAULT_RECIPE if recipe is None else recipe), (), check)
    for item in overrides:
        op, key, value = _parse_override(item)
        source = f"override {item!r}"
        if op == "delete":
            if not _has_key(cfg, key):
                raise ValueError(f"cannot delete {key!r} (in {source}): the configuration has no such key")
            parent, _, last = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            with open_dict(node):
                del node[last]
            continue
        if op == "add" and _has_key(cfg, key) and OmegaConf.select(cfg, key) is not None:  # Hydra 1.3: null adds
            raise ValueError(
                f"cannot add {key!r} (in {source}): the configuration already has it; use "
                f"{key}=... to change it, or ++{key}=... to add or change it"
            )
        if key in ONE_AS_LIST and isinstance(value, str):
            value = [value]
        hint = check_key(RunConfig, key, source=source, value=value) if check else VERL_ONLY
        sub = config_class(hint) if hint is not VERL_ONLY else None
        if sub is not None and isinstance(value, Mapping):
            check_keys(RunConfig, value, source=source, _cls=sub, _prefix=f"{key}.")
        elif sub is None and hint is not VERL_ONLY and not (isinstance(value, str) and "${" in value):
            try:
                value = coerce(hint, value, key)
            except ValueError as err:
                raise ValueError(f"{err} (in {source})") from None
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    try:
        out = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(f"cannot resolve the configuration: {err}") from None
    migrate_legacy(out)  # older verl keys -> their successors, so the key table and the build agree
    return out


def load_config(recipe: Union[str, os.PathLike, None] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The validated ``RunConfig`` of ``recipe`` (built-in name or YAML path; None = the
    CPU toy ``grpo``) with Hydra-style ``key=value`` ``overrides`` applied in order."""
    return RunConfig.from_dict(compose(recipe, overrides))


def key_report(recipe: Union[str, os.PathLike, None], overrides: Sequence[str] = ()) -> tuple[str, bool]:
    """The key table of ``recipe`` + ``overrides`` (``megatron_rl.config.verl.format_key_table``) and
    whether it refuses a key; a config that cannot even be composed raises ``ValueError``."""
    from megatron_rl.config.verl import format_key_table, key_table

    table = key_table(compose(recipe, overrides, check=False), RunConfig)
    return format_key_table(table, source=str(recipe)), bool(table.refused)


def dump_config(cfg: BaseConfig) -> str:
    """``cfg`` as YAML that ``load_config`` reads back to an equal config (for the run directory)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
