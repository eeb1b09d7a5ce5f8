"""Typed dataclass configs with verl's key names; YAML recipes and overrides fill them.

The run-level names (``TrainerRunConfig``, ``load_config`` and the section configs) are loaded
on first access: they import the algorithm registries, which themselves import
``megatron_rl.config.base``, so an eager import here would be circular.
"""

import importlib

from megatron_rl.config.algorithm import (
    ActorConfig,
    AlgoConfig,
    CriticConfig,
    OptimConfig,
    FilterGroupsConfig,
    KLControlConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from megatron_rl.config.base import BaseConfig

_LAZY = {
    "TrainerRunConfig": "megatron_rl.config.trainer",
    "VALUE_ESTIMATORS": "megatron_rl.config.trainer",
    "load_config": "megatron_rl.config.loader",
    "compose": "megatron_rl.config.loader",
    "list_recipes": "megatron_rl.config.loader",
    "find_recipe": "megatron_rl.config.loader",
    "dump_config": "megatron_rl.config.loader",
    "DEFAULT_RECIPE": "megatron_rl.config.loader",
    "MegatronConfig": "megatron_rl.config.sections",
    "ModelSourceConfig": "megatron_rl.config.sections",
    "DataConfig": "megatron_rl.config.sections",
    "ActorRunConfig": "megatron_rl.config.sections",
    "RefConfig": "megatron_rl.config.sections",
    "ActorRolloutRefConfig": "megatron_rl.config.sections",
    "CriticRunConfig": "megatron_rl.config.sections",
    "RewardConfig": "megatron_rl.config.sections",
    "RewardModelConfig": "megatron_rl.config.sections",
    "OverlongBufferConfig": "megatron_rl.config.sections",
    "TrainerConfig": "megatron_rl.config.sections",
    "TeacherModelConfig": "megatron_rl.config.sections",
    "DistillationConfig": "megatron_rl.config.sections",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ActorConfig",
    "AlgoConfig",
    "CriticConfig",
    "OptimConfig",
    "BaseConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
    *_LAZY,
]
