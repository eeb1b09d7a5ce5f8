"""verl's config surface over the typed tree, the edge where verl's keys are translated: verl's
converter, verl's class names, and the key table.

``omega_conf_to_dataclass`` is verl's converter (``verl.utils.omega_conf_to_dataclass``): a
section's ``_target_`` picks our class (``McoreActorConfig`` -> ``ActorConfig``, ...). verl's class
names are importable from here as constructors taking verl's keyword arguments
(``McoreActorConfig(strategy="megatron", ppo_micro_batch_size=2, use_torch_compile=False)`` is an
``ActorConfig``): verl's global micro-batch size is the per-GPU one of a single rank, verl-only
fields of ``INERT_KEYS`` warn when away from verl's default and are dropped, other unknown
keywords are a ``TypeError`` with the nearest field. Our own classes take their own fields only.
``key_table`` / ``format_key_table`` sort a composed config's leaves into acted on / accepted with
no effect (warned when away from verl's default) / refused (with the nearest valid key), for the
``megatron-rl train --config`` and ``python -m megatron_rl.main_ppo`` entry points. The rules of
which verl key is which live in ``megatron_rl.config.verl_keys`` and ``compat.INERT_KEYS``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Optional

from megatron_rl.config import run_config  # noqa: F401  (imports every section class)
from megatron_rl.config.base_config import BaseConfig
from megatron_rl.config.compat import inert_reason
from megatron_rl.config.schema import all_paths, build_config, field_hint
from megatron_rl.config.verl_keys import (
    TRANSLATED,
    VERL_CONFIG_DIR,
    VERL_TARGETS,
    differs_from_verl,
    is_verl_key,
    leaves_of,
    not_built_refusal,
    take_verl_extras,
    translate_kwargs,
    warn_verl_extras,
)

__all__ = [
    "VERL_CONFIG_DIR",
    "omega_conf_to_dataclass",
    "verl_section",
    "verl_class",
    "KeyTable",
    "key_table",
    "format_key_table",
]


# ----------------------------------------------------------------------------- verl's converter
def _target_classes() -> dict[str, type]:
    ours: dict[str, type] = {}
    stack = [BaseConfig]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        ours.setdefault(cls.__name__, cls)
    out: dict[str, type] = {}
    # The first class listed wins: a McoreActorConfig is an ActorConfig, not a RefConfig.
    for name, verl_names in VERL_TARGETS.items():
        for verl_name in verl_names:
            if name in ours:
                out.setdefault(verl_name, ours[name])
    return out


def omega_conf_to_dataclass(config: Any, dataclass_type: Optional[type] = None) -> Any:
    """verl's ``omega_conf_to_dataclass``: a ``DictConfig`` / dict as the config dataclass
    ``dataclass_type``, or, without one, as the class its ``_target_`` names (verl's class names map to
    ours, e.g. ``verl.trainer.config.AlgoConfig`` -> ``AlgoConfig``, ``McoreActorConfig`` ->
    ``ActorConfig``). An empty config gives ``dataclass_type()``; a non-mapping is returned as is."""
    from omegaconf import DictConfig, OmegaConf

    if not config:
        return dataclass_type() if dataclass_type is not None else dataclass_type
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, Mapping):
        return config
    if dataclass_type is None:
        target = config.get("_target_")
        if target is None:
            raise ValueError(
                "omega_conf_to_dataclass: without dataclass_type the config must name its class in "
                f"_target_; got keys {sorted(config)}"
            )
        name = str(target).rpartition(".")[2]
        classes = _target_classes()
        if name not in classes:
            raise ValueError(f"_target_={target!r} names no config class here; known: {sorted(classes)}")
        dataclass_type = classes[name]
    if not dataclasses.is_dataclass(dataclass_type):
        raise ValueError(f"{dataclass_type} must be a dataclass")
    return verl_section(dataclass_type, config)


def verl_section(cls: type, data: Any) -> Any:
    """Section ``cls`` from verl's mapping (a ``DictConfig``, dict or an instance already): verl's keys
    translated as a run's are (``schema.build_config``), the global micro-batch size of one rank."""
    from omegaconf import DictConfig, OmegaConf

    if data is None or isinstance(data, cls):
        return cls() if data is None else data
    if isinstance(data, DictConfig):
        data = OmegaConf.to_container(data, resolve=True)
    return build_config(cls, translate_kwargs(cls, dict(data)))


def _unexpected_keyword(cls: type, key: str) -> TypeError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key.rpartition(".")[2], names, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return TypeError(f"{cls.__name__}() got an unexpected keyword argument {key.rpartition('.')[2]!r}{hint}")


def verl_class(name: str):
    """The constructor of verl's config class ``name`` (``"McoreActorConfig"``): ours, taking verl's
    keyword arguments."""
    classes = _target_classes()
    if name not in classes:
        raise AttributeError(f"no verl config class {name!r} here; known: {sorted(classes)}")
    cls = classes[name]

    def build(*args: Any, **kwargs: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = translate_kwargs(cls, dict(kwargs))
        own, extras = take_verl_extras(cls, names, kwargs, unknown=_unexpected_keyword)
        obj = cls(*args, **own)
        warn_verl_extras(cls, extras)
        return obj

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"verl's ``{name}``: a ``{cls.__module__}.{cls.__name__}`` from verl's keyword arguments."
    return build


def __getattr__(name: str) -> Any:
    """verl's config class names (``from megatron_rl.config.verl import McoreActorConfig``)."""
    if name[:1].isupper() and name.endswith("Config"):
        return verl_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- the key table
@dataclasses.dataclass
class KeyTable:
    """A config's leaves by kind: acted on, accepted with no effect (and which of those warn), refused."""

    acted: list[str] = dataclasses.field(default_factory=list)
    inert: list[str] = dataclasses.field(default_factory=list)
    warned: list[str] = dataclasses.field(default_factory=list)
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """``(key, nearest valid keys)``."""
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    """Why a refused verl key is refused where it is one of verl's (``compat.NOT_BUILT``)."""


def key_table(data: Mapping[str, Any], root: type) -> KeyTable:
    """Classify every leaf of the composed config ``data`` against the schema of ``root``."""
    table = KeyTable()
    known = all_paths(root)

    def walk(node: Mapping, prefix: str, cls: Optional[type]) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if key == "_target_":
                continue
            hint = field_hint(cls, key) if cls is not None else None
            if hint is not None:
                sub = hint[1]
                if sub is not None and isinstance(value, Mapping) and value:
                    walk(value, f"{path}.", sub)
                    continue
                reason = inert_reason(path)
                (table.inert if reason else table.acted).append(path)
                continue
            if key in TRANSLATED and cls is not None and TRANSLATED[key] in {f.name for f in dataclasses.fields(cls)}:
                table.acted.append(path)
                continue
            for leaf, leaf_value in leaves_of(value, path):
                reason = not_built_refusal(leaf, leaf_value)
                if reason is not None:
                    table.refused.append((leaf, ""))
                    table.reasons[leaf] = reason
                elif inert_reason(leaf) is not None and is_verl_key(leaf):
                    table.inert.append(leaf)
                    if differs_from_verl(leaf, leaf_value):
                        table.warned.append(leaf)
                else:
                    table.refused.append((leaf, _nearest(leaf, known)))

    walk(data, "", root)
    return table


def _nearest(path: str, known: tuple[str, ...]) -> str:
    leaf = path.rpartition(".")[2]
    parent = path.rpartition(".")[0]
    same_parent = [p for p in known if p.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(path, same_parent or known, n=1, cutoff=0.6)
    if not close:
        close = [p for p in known if p.rpartition(".")[2] == leaf][:1]
    if not close:
        close = difflib.get_close_matches(path, known, n=1, cutoff=0.5)
    return close[0] if close else ""


def format_key_table(table: KeyTable, source: str = "config") -> str:
    """The short table the entry points print: counts, the warned keys, the refused keys with the nearest valid key."""
    lines = [
        f"verl keys of {source}:",
        f"  acted on                  {len(table.acted):4d}",
        f"  accepted, no effect here  {len(table.inert):4d}  ({len(table.warned)} set away from verl's default, warned)",
        f"  refused                   {len(table.refused):4d}",
    ]
    lines += [f"    warned: {key}" for key in table.warned[:20]]
    if len(table.warned) > 20:
        lines.append(f"    ... and {len(table.warned) - 20} more warned keys")
    for key, nearest in table.refused:
        if key in table.reasons:
            why = f"  ({table.reasons[key]})"
        elif nearest:
            why = f"  (nearest valid key: {nearest})"
        else:
            why = ""
        lines.append(f"    refused: {key}{why}")
    return "\n".join(lines)
