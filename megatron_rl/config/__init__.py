"""Typed dataclass configs with verl's key names; YAML recipes and overrides fill them."""

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
]
