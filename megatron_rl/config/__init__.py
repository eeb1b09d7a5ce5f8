"""Typed dataclass configs with verl's key names; YAML recipes and overrides fill them."""

from megatron_rl.config.algorithm import (
    ActorConfig,
    AlgoConfig,
    FilterGroupsConfig,
    KLControlConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from megatron_rl.config.base import BaseConfig

__all__ = [
    "ActorConfig",
    "AlgoConfig",
    "BaseConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
]
