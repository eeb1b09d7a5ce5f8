"""Typed dataclass configs with verl's key names; YAML recipes and overrides fill them.

The bottom layer of ``megatron_rl``: it imports only ``parallel.config``. Every section is a
``BaseConfig`` dataclass (attribute access; also reads like a ``DictConfig``) that validates its
own fields, one module per top-level section (``data``, ``actor_rollout_ref`` with ``rollout``,
``critic``, ``reward``, ``algorithm``, ``trainer`` with ``v1``, ``distillation``) and one per shared
piece (``layout``: ``*.megatron``; ``model``: ``*.model``; ``optim``; ``lora_config``); ``RunConfig``
(``run_config``) is the whole run, ``load_config`` builds one from a recipe and ``key=value`` overrides.
What depends on the registries (algorithm names, which roles run) is checked one layer up, by
``megatron_rl.algos.needs.resolve_run``.
"""

from megatron_rl.config.actor_rollout_ref import ActorConfig, ActorRolloutRefConfig, PolicyLossConfig, RefConfig
from megatron_rl.config.algorithm import AlgoConfig, FilterGroupsConfig, KLControlConfig, RolloutCorrectionConfig
from megatron_rl.config.base_config import BaseConfig
from megatron_rl.config.critic import CriticConfig
from megatron_rl.config.data import DataConfig
from megatron_rl.config.distillation import DistillationConfig, DistillationLossConfig, TeacherModelConfig
from megatron_rl.config.layout import MegatronConfig, RouterReplayConfig
from megatron_rl.config.loader import DEFAULT_RECIPE, compose, dump_config, find_recipe, list_recipes, load_config
from megatron_rl.config.model import ModelConfig, ModelSourceConfig
from megatron_rl.config.optim import OptimConfig
from megatron_rl.config.reward import OverlongBufferConfig, RewardConfig, RewardModelConfig
from megatron_rl.config.rollout import RolloutConfig, SamplingConfig, WeightSyncConfig
from megatron_rl.config.run_config import RunConfig
from megatron_rl.config.trainer import TrainerConfig
from megatron_rl.config.verl import omega_conf_to_dataclass

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgoConfig",
    "BaseConfig",
    "CriticConfig",
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
    "RouterReplayConfig",
    "RunConfig",
    "SamplingConfig",
    "TeacherModelConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "compose",
    "dump_config",
    "find_recipe",
    "list_recipes",
    "load_config",
    "omega_conf_to_dataclass",
]
