"""Typed dataclass configs with verl's key names; YAML recipes and overrides fill them.

The bottom layer of ``megatron_rl``: it imports only ``parallel.config``. Every section is a
``BaseConfig`` dataclass (attribute access; also reads like a ``DictConfig``) that validates its
own fields; ``TrainerRunConfig`` is the whole run, ``load_config`` builds one from a recipe and
``key=value`` overrides. What depends on the registries (algorithm names, which roles run) is
checked one layer up, by ``megatron_rl.algos.needs.resolve_run``.
"""

from megatron_rl.config.algorithm import (
    ActorConfig,
    AlgoConfig,
    CriticConfig,
    FilterGroupsConfig,
    KLControlConfig,
    OptimConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from megatron_rl.config.base_config import BaseConfig
from megatron_rl.config.distillation import DistillationLossConfig
from megatron_rl.config.loader import DEFAULT_RECIPE, compose, dump_config, find_recipe, list_recipes, load_config
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.rollout import RolloutConfig, SamplingConfig, WeightSyncConfig
from megatron_rl.config.sections import (
    ActorRolloutRefConfig,
    ActorRunConfig,
    CriticRunConfig,
    DataConfig,
    DistillationConfig,
    MegatronConfig,
    ModelSourceConfig,
    OverlongBufferConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    TeacherModelConfig,
    TrainerConfig,
)
from megatron_rl.config.trainer import TrainerRunConfig
from megatron_rl.config.verl import omega_conf_to_dataclass

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "ActorRunConfig",
    "AlgoConfig",
    "BaseConfig",
    "CriticConfig",
    "CriticRunConfig",
    "DEFAULT_RECIPE",
    "DataConfig",
    "DistillationConfig",
    "DistillationLossConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "MegatronConfig",
    "ModelConfig",
    "ModelSourceConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SamplingConfig",
    "TeacherModelConfig",
    "TrainerConfig",
    "TrainerRunConfig",
    "WeightSyncConfig",
    "compose",
    "dump_config",
    "find_recipe",
    "list_recipes",
    "load_config",
    "omega_conf_to_dataclass",
]
