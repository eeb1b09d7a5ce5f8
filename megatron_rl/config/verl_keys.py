"""verl 0.9.1's keys: the catalogue, ``_target_``, verl-only fields, and verl's run-tree conventions.

A verl user's config carries keys of three kinds here:

- **acted on**: a field of the typed tree (``megatron_rl.config.schema``) that is not inert, or one
  of verl's deprecated global micro-batch sizes (``ppo_micro_batch_size``,
  ``log_prob_micro_batch_size``), which become ``*_per_gpu = value // data-parallel size`` as in
  verl's workers (``normalize``);
- **accepted with no effect**: a key matched by ``megatron_rl.config.compat.INERT_KEYS`` -- a field,
  or a key of verl's catalogue (``verl/ppo_megatron_trainer.yaml``, verl's own generated config)
  that the tree has no field for. The latter warn by name when they differ from verl's default and
  are dropped (they have no effect; ``megatron-rl train --config``'s key table lists them);
- **refused**: anything else -- a ``ValueError`` naming the key and the nearest valid keys.

``_target_`` (verl's Hydra class path in every section) is not a key: it is dropped after checking
that the class it names fits the section (``VERL_TARGETS``). This module sits under
``megatron_rl.config.base_config`` and ``schema`` (it imports only ``compat``); verl's converter
``omega_conf_to_dataclass`` and the key table are in ``megatron_rl.config.verl``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_rl.config.compat import inert_reason, not_built_reason, warn_once

__all__ = [
    "VERL_CONFIG_DIR",
    "VERL_TARGETS",
    "TRANSLATED",
    "NO_DEFAULT",
    "verl_catalogue",
    "verl_default",
    "differs_from_verl",
    "is_verl_key",
    "check_target",
    "take_verl_extras",
    "warn_verl_extras",
    "normalize",
    "translate_kwargs",
    "section_path",
    "verl_only_refusal",
    "same_value",
    "leaves_of",
    "LEGACY_KEYS",
    "RETIRED_KEYS",
    "ONE_AS_LIST",
    "LegacyKeyWarning",
    "legacy_successor",
    "migrate_legacy",
    "not_built_refusal",
    "check_built",
    "warn_inert_keys",
]

VERL_CONFIG_DIR = Path(__file__).resolve().parent / "verl"
"""Where verl 0.9.1's generated Megatron trainer config is kept (``ppo_megatron_trainer.yaml``)."""
_CATALOGUE_FILE = VERL_CONFIG_DIR / "ppo_megatron_trainer.yaml"

NO_DEFAULT = object()
"""``verl_default`` of a key verl has no default for (inside a free-form mapping): any value counts as set."""

VERL_TARGETS: dict[str, tuple[str, ...]] = {
    "AlgoConfig": ("AlgoConfig",),
    "KLControlConfig": ("KLControlConfig",),
    "FilterGroupsConfig": ("FilterGroupsConfig",),
    "RolloutCorrectionConfig": ("RolloutCorrectionConfig",),
    "PolicyLossConfig": ("PolicyLossConfig",),
    "OptimConfig": ("McoreOptimizerConfig", "OptimizerConfig"),
    "ActorConfig": ("McoreActorConfig", "ActorConfig"),
    "RefConfig": ("McoreActorConfig", "ActorConfig"),
    "CriticConfig": ("McoreCriticConfig", "CriticConfig"),
    "MegatronConfig": ("McoreEngineConfig",),
    "RouterReplayConfig": ("EngineRouterReplayConfig", "RouterReplayConfig"),
    "ModelSourceConfig": ("HFModelConfig",),
    "RolloutConfig": ("RolloutConfig",),
    "SamplingConfig": ("SamplingConfig",),
    "WeightSyncConfig": ("CheckpointEngineConfig",),
    "MultiTurnConfig": ("MultiTurnConfig",),
    "AgentLoopConfig": ("AgentLoopConfig",),
    "RewardConfig": ("RewardConfig",),
    "RewardModelConfig": ("RewardModelConfig",),
    "DistillationConfig": ("DistillationConfig",),
    "DistillationLossConfig": ("DistillationLossConfig",),
}
"""Our section class -> the verl classes a ``_target_`` in that section may name (by last component)."""

CANONICAL_PATHS: dict[str, str] = {
    "AlgoConfig": "algorithm",
    "KLControlConfig": "algorithm.kl_ctrl",
    "FilterGroupsConfig": "algorithm.filter_groups",
    "RolloutCorrectionConfig": "algorithm.rollout_correction",
    "PolicyLossConfig": "actor_rollout_ref.actor.policy_loss",
    "OptimConfig": "actor_rollout_ref.actor.optim",
    "ActorConfig": "actor_rollout_ref.actor",
    "RefConfig": "actor_rollout_ref.ref",
    "CriticConfig": "critic",
    "MegatronConfig": "actor_rollout_ref.actor.megatron",
    "ModelSourceConfig": "actor_rollout_ref.model",
    "RolloutConfig": "actor_rollout_ref.rollout",
    "SamplingConfig": "actor_rollout_ref.rollout.val_kwargs",
    "WeightSyncConfig": "actor_rollout_ref.rollout.checkpoint_engine",
    "MultiTurnConfig": "actor_rollout_ref.rollout.multi_turn",
    "AgentLoopConfig": "actor_rollout_ref.rollout.agent",
    "DataConfig": "data",
    "TrainerConfig": "trainer",
    "RewardConfig": "reward",
    "RewardModelConfig": "reward.reward_model",
    "DistillationConfig": "distillation",
    "DistillationLossConfig": "distillation.distillation_loss",
}
"""Where a section used on its own (``megatron_rl.config.verl``'s converter and class names) sits in verl's tree."""

TRANSLATED: dict[str, str] = {
    "ppo_micro_batch_size": "ppo_micro_batch_size_per_gpu",
    "log_prob_micro_batch_size": "log_prob_micro_batch_size_per_gpu",
}
"""verl's deprecated global micro-batch keys -> the per-GPU key they set (``value // dp``, verl's conversion)."""


# ----------------------------------------------------------------------------- the catalogue
@functools.lru_cache(maxsize=1)
def verl_catalogue() -> dict[str, Any]:
    """``dotted path -> verl's default`` of every leaf of verl 0.9.1's generated Megatron config
    (interpolations resolved; an empty mapping is a leaf: a free-form section)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(_CATALOGUE_FILE)
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    leaves: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
            return
        leaves[prefix[:-1]] = node

    walk(data, "")
    raw = OmegaConf.to_container(cfg, resolve=False)
    for path in list(leaves):
        node: Any = raw
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, str) and "${" in node:  # verl derives it from another key: any value is verl's
            leaves[path] = NO_DEFAULT
    for path, default in _DATACLASS_ONLY.items():
        leaves.setdefault(path, default)
    return leaves


_DATACLASS_ONLY = {
    "actor_rollout_ref.actor.ppo_infer_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.ppo_infer_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.use_rollout_log_probs": False,
    "actor_rollout_ref.actor.profile": {},
}
"""Fields of verl's ``McoreActorConfig`` that its generated YAML leaves out (keyword arguments of verl code)."""


@functools.lru_cache(maxsize=1)
def _sections() -> frozenset[str]:
    out = set()
    for path in verl_catalogue():
        parts = path.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(out)


def _free_form_prefix(path: str) -> Optional[str]:
    """The catalogue leaf above ``path`` whose default is a mapping (keys under it are free), or None."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if isinstance(verl_catalogue().get(prefix, None), Mapping):
            return prefix
    return None


def is_verl_key(path: str) -> bool:
    """True when ``path`` is a key (leaf or section) of verl's config, or lies in one of its free-form mappings."""
    return path in verl_catalogue() or path in _sections() or _free_form_prefix(path) is not None


def differs_from_verl(path: str, value: Any) -> bool:
    """True when ``value`` at leaf ``path`` is not verl's default (a key verl derives from another by
    interpolation never differs; a key verl has no default for always does)."""
    catalogue = verl_catalogue()
    if path in catalogue and catalogue[path] is NO_DEFAULT:
        return False
    default = verl_default(path)
    return default is NO_DEFAULT or not same_value(value, default)


def verl_default(path: str) -> Any:
    """verl's default of leaf ``path`` (``NO_DEFAULT`` inside a free-form mapping without that key)."""
    catalogue = verl_catalogue()
    if path in catalogue:
        return catalogue[path]
    prefix = _free_form_prefix(path)
    if prefix is None:
        return NO_DEFAULT
    node: Any = catalogue[prefix]
    for part in path[len(prefix) + 1 :].split("."):
        if not isinstance(node, Mapping) or part not in node:
            return NO_DEFAULT
        node = node[part]
    return node


def leaves_of(value: Any, path: str):
    if isinstance(value, Mapping) and value:
        for key, sub in value.items():
            if key != "_target_":
                yield from leaves_of(sub, f"{path}.{key}")
        return
    yield path, value


# ----------------------------------------------------------------------------- sections
def section_path(cls: type, path: str = "") -> str:
    """The verl path of section ``cls`` at ``path`` (the run's own path when it is one of verl's,
    else the section's usual place in verl's tree)."""
    if path and (path in _sections() or path in verl_catalogue()):
        return path
    return CANONICAL_PATHS.get(cls.__name__, path)


def check_target(cls: type, target: Any, path: str = "") -> None:
    """``ValueError`` unless ``_target_`` (verl's class path) names a class that fits section ``cls``."""
    where = f"{path}._target_" if path else "_target_"
    allowed = VERL_TARGETS.get(cls.__name__, ())
    name = str(target).rpartition(".")[2] if isinstance(target, str) else None
    if name is None or (name not in allowed and name != cls.__name__):
        expected = sorted({*(f"verl...{a}" for a in allowed), f"{cls.__module__}.{cls.__name__}"})
        raise ValueError(
            f"{where}={target!r} names a class that does not fit this section ({cls.__name__}); "
            f"expected one of {expected}"
        )


LEGACY_SECTIONS = ("reward_model", "custom_reward_function", "sandbox_fusion")
"""verl's legacy top-level reward sections (moved under ``reward`` in verl 0.9): its config carries them
all null, and that is accepted; a value set there is refused, pointing at the ``reward`` keys."""


def verl_only_refusal(path: str, value: Any) -> Optional[str]:
    """None when the verl-only key at ``path`` (with its whole subtree) is accepted, else the refused leaf
    (a key of an older verl with a successor in ``LEGACY_KEYS`` or listed in ``RETIRED_KEYS`` is accepted:
    ``migrate_legacy`` moves or drops it before the config is built)."""
    legacy = path.partition(".")[0] in LEGACY_SECTIONS
    for leaf, leaf_value in leaves_of(value, path):
        check_built(leaf, leaf_value)
        if legacy_successor(leaf) is not None or leaf in RETIRED_KEYS:
            continue
        if inert_reason(leaf) is None or not is_verl_key(leaf) or (legacy and leaf_value is not None):
            return leaf
    return None


def not_built_refusal(path: str, value: Any) -> Optional[str]:
    """The reason ``path=value`` is refused (a ``compat.NOT_BUILT`` key away from verl's default), or None."""
    reason = not_built_reason(path)
    return reason if reason is not None and differs_from_verl(path, value) else None


def check_built(path: str, value: Any) -> None:
    """``ValueError`` with the reason when ``path=value`` asks for a feature that is not built (``NOT_BUILT``)."""
    reason = not_built_refusal(path, value)
    if reason is not None:
        raise ValueError(f"{path}={value!r} is refused: {reason}")


# ----------------------------------------------------------------------------- older verl versions' keys
LEGACY_KEYS: tuple[tuple[str, str], ...] = (
    ("reward_model.num_workers", "reward.num_workers"),
    ("reward_model.reward_manager", "reward.reward_manager.name"),
    ("reward_model.reward_loop_source", "reward.reward_manager.source"),
    ("reward_model.reward_loop_module_path", "reward.reward_manager.module.path"),
    ("reward_model.reward_loop_class_name", "reward.reward_manager.module.name"),
    ("reward_model.enable", "reward.reward_model.enable"),
    ("reward_model.enable_resource_pool", "reward.reward_model.enable_resource_pool"),
    ("reward_model.n_gpus_per_node", "reward.reward_model.n_gpus_per_node"),
    ("reward_model.nnodes", "reward.reward_model.nnodes"),
    ("reward_model.model.path", "reward.reward_model.model_path"),
    ("reward_model.reward_kwargs", "reward.reward_kwargs"),
    ("reward_model.rollout", "reward.reward_model.rollout"),
    ("custom_reward_function", "reward.custom_reward_function"),
    ("sandbox_fusion", "reward.sandbox_fusion"),
    ("actor_rollout_ref.actor.router_replay", "actor_rollout_ref.actor.megatron.router_replay"),
)
"""``(older key or section, its successor)``: verl's own migration (``migrate_legacy_reward_impl`` of
verl 0.9.1's reward loop, which moves every non-null legacy reward leaf under ``reward``) and the
router-replay options that moved under ``actor.megatron``. A section maps every key below it."""

RETIRED_KEYS: dict[str, str] = {
    "trainer.use_legacy_worker_impl": "verl's switch between its old and new worker classes; one worker "
    "implementation is built here",
    "reward_model.use_reward_loop": "verl's switch to its reward loop; rewards are always scored in the rollout phase",
}
"""Keys an older verl accepted that name no setting here: dropped with a note giving the reason."""

ONE_AS_LIST = ("trainer.logger",)
"""List keys verl also takes as one string (``trainer.logger=console``)."""


class LegacyKeyWarning(UserWarning):
    """A key of an older verl version was read as its successor (or dropped, with the reason)."""


def legacy_successor(path: str) -> Optional[str]:
    """The current key of the older verl key ``path``, or None when it has none."""
    for old, new in LEGACY_KEYS:
        if path == old or path.startswith(old + "."):
            return new + path[len(old) :]
    return None


def _pop_path(data: dict, path: str) -> Any:
    parent = _get(data, path.rpartition(".")[0]) if "." in path else data
    return parent.pop(path.rpartition(".")[2]) if isinstance(parent, dict) else None


def _set_path(data: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _prune(data: dict, path: str) -> None:
    """Remove the mapping at ``path`` and each parent that a move left empty (verl's null legacy leaves stay)."""
    while path:
        node = _get(data, path)
        if not (isinstance(node, dict) and not node):
            return
        _pop_path(data, path)
        path = path.rpartition(".")[0]


def migrate_legacy(data: dict) -> list[str]:
    """Older verl keys on plain data, in place: each non-null leaf of ``LEGACY_KEYS`` moves to its successor
    (over the successor's value, as verl's migration does; mappings it leaves empty are removed) and
    ``RETIRED_KEYS`` are dropped; verl's null legacy leaves stay (accepted as before); returns one note per key (also warned, ``LegacyKeyWarning``)."""
    notes = []
    for path, reason in RETIRED_KEYS.items():
        if _get(data, path) is not None:
            notes.append(f"{path}={_pop_path(data, path)!r} (an older verl's key) has no effect here: {reason}")
    for old, new in LEGACY_KEYS:
        section = _get(data, old)
        if section is None:
            continue
        for leaf, value in list(leaves_of(section, old)):
            if value is None or (isinstance(value, Mapping) and not value):
                continue
            _pop_path(data, leaf)
            _prune(data, leaf.rpartition(".")[0])
            _set_path(data, legacy_successor(leaf), value)
            notes.append(f"{leaf} is an older verl's key: read as {legacy_successor(leaf)}")
    for note in notes:
        warnings.warn(note, LegacyKeyWarning, stacklevel=1)
    return notes


# ----------------------------------------------------------------------------- inert keys of a built config
def _leaves(config: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(path, value, default)`` of every leaf under the built config section ``config``."""
    for f in dataclasses.fields(config):
        if f.metadata.get("internal"):
            continue
        value = getattr(config, f.name)
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _leaves(value, f"{path}.")
            continue
        default = (
            f.default_factory()
            if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING
            else f.default
        )
        yield path, value, default


def warn_inert_keys(config: Any) -> list[str]:
    """Warn (``InertKeyWarning``) for every inert key of ``config`` set to a value that is neither the
    field's default nor verl's (``algorithm.pf_ppo`` holds verl's options by default); return the texts."""

    def verl_default(path: str, value: Any) -> bool:
        return is_verl_key(path) and not any(differs_from_verl(leaf, v) for leaf, v in leaves_of(value, path))

    messages = []
    for path, value, default in _leaves(config):
        reason = inert_reason(path)
        if reason is None or value == default or verl_default(path, value):
            continue
        messages.append(f"{path}={value!r} is accepted for verl compatibility but has no effect here: {reason}")
    for message in messages:
        warn_once(message)
    return messages


def take_verl_extras(
    cls: type, fields: set[str], data: Mapping[str, Any], path: str = "", *, unknown: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split section ``data`` into ``(own keys, verl-only extras)``.

    ``_target_`` is checked and dropped; a key that is not one of ``fields`` is an extra when it
    is a verl key matched by ``INERT_KEYS`` (with every leaf under it), else ``unknown(cls, full_path)``
    is raised (the caller's nearest-key error).
    """
    own, extras = {}, {}
    base = section_path(cls, path)
    for key, value in data.items():
        if key in fields:
            own[key] = value
            continue
        if key == "_target_":
            check_target(cls, value, path)
            continue
        refused = verl_only_refusal(f"{base}.{key}" if base else str(key), value)
        if refused is not None:
            raise unknown(cls, f"{path}.{key}" if path else str(key))
        extras[key] = value
    return own, extras


def warn_verl_extras(cls: type, extras: Mapping[str, Any], path: str = "") -> list[str]:
    """Warn (``InertKeyWarning``) for every extra leaf set to a value other than verl's default."""
    base, messages = section_path(cls, path), []
    shown = path or base
    for key, value in extras.items():
        for leaf, leaf_value in leaves_of(value, f"{base}.{key}" if base else key):
            if differs_from_verl(leaf, leaf_value):
                name = shown + leaf[len(base) :] if base else leaf
                messages.append(
                    f"{name}={leaf_value!r} is accepted for verl compatibility but has no effect "
                    f"here: {inert_reason(leaf)}"
                )
    for message in messages:
        warn_once(message)
    return messages


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


# ----------------------------------------------------------------------------- run-tree normalisation
_MICRO_BATCH_KEYS = (
    ("actor_rollout_ref.actor", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu"),
    ("critic", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.ref", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu"),
)


def _get(data: Mapping, path: str, default: Any = None) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return default
        node = node[part]
    return node


def _dp_size(data: Mapping, section: str) -> int:
    """The data-parallel size of ``section``'s Megatron layout (the actor's where it leaves a size out)."""
    world = int(_get(data, "trainer.nnodes", 1)) * int(_get(data, "trainer.n_gpus_per_node", 8))
    size = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        size *= int(_get(data, f"{section}.megatron.{key}", _get(data, f"actor_rollout_ref.actor.megatron.{key}", 1)))
    return max(1, world // size)


VALUE_ALIASES: dict[str, dict[Any, Any]] = {
    "actor_rollout_ref.rollout.checkpoint_engine.backend": {"naive": "colocated"},
}
"""verl values that name one of ours differently: verl's ``naive`` weight update of the colocated
(hybrid-engine) rollout is the ``colocated`` transport here."""


def normalize(data: dict) -> dict:
    """verl's run-tree conventions on plain data, in place: a deprecated global micro-batch size
    becomes the per-GPU one (``value // dp``, as verl's workers convert it; both set is verl's
    error), an older verl's key is read as its successor (``migrate_legacy``), a string given for a
    ``ONE_AS_LIST`` key is a one-entry list, a null ``ppo_micro_batch_size_per_gpu`` means "not set" (the field's default), the empty
    ``rollout.engine_kwargs`` sections of other engines are dropped and ``VALUE_ALIASES`` are renamed."""
    migrate_legacy(data)
    for path in ONE_AS_LIST:
        parent, _, key = path.rpartition(".")
        node = _get(data, parent)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = [node[key]]
    engine_kwargs = _get(data, "actor_rollout_ref.rollout.engine_kwargs")
    if isinstance(engine_kwargs, dict):  # verl lists an empty section per engine; only vLLM's can act here
        for engine in [k for k, v in engine_kwargs.items() if k != "vllm" and not v]:
            del engine_kwargs[engine]
    for path, aliases in VALUE_ALIASES.items():
        parent, _, key = path.rpartition(".")
        node = _get(data, parent)
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key] in aliases:
            node[key] = aliases[node[key]]
    for section, global_key, per_gpu_key in _MICRO_BATCH_KEYS:
        node = _get(data, section)
        if not isinstance(node, dict) or (global_key not in node and per_gpu_key not in node):
            continue
        total, per_gpu = node.pop(global_key, None), node.get(per_gpu_key)
        if total is not None and per_gpu is not None:
            raise ValueError(
                f"{section}: both {section}.{global_key}={total} and {section}.{per_gpu_key}={per_gpu} "
                f"are set; remove {global_key} (verl deprecated it for {per_gpu_key})"
            )
        if total is not None:
            node[per_gpu_key] = max(1, int(total) // _dp_size(data, section))
        elif per_gpu_key in node and per_gpu is None and global_key == "ppo_micro_batch_size":
            del node[per_gpu_key]  # verl's null: not set, the field's default applies
    return data


def translate_kwargs(cls: type, kwargs: dict) -> dict:
    """A section built on its own (``ActorConfig(ppo_micro_batch_size=2, ...)``): verl's global
    micro-batch size is the per-GPU one of a single rank (verl divides by the data-parallel size)."""
    names = {f.name for f in dataclasses.fields(cls)}
    for global_key, per_gpu_key in TRANSLATED.items():
        if global_key in kwargs and global_key not in names and per_gpu_key in names:
            total = kwargs.pop(global_key)
            if total is None:
                continue
            if kwargs.get(per_gpu_key) is not None:
                raise ValueError(
                    f"both {global_key}={total} and {per_gpu_key}={kwargs[per_gpu_key]} are set; remove "
                    f"{global_key} (verl deprecated it for {per_gpu_key})"
                )
            kwargs[per_gpu_key] = int(total)
    return kwargs
