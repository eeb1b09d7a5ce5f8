"""Roles over the Megatron engine: actor, reference, critic, reward model, distillation teacher.

INTERIM (re-layering in progress): every role is still the all-in-one ``MegatronEngine``; the
role modules (heads + loss closures over typed loss inputs) replace it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from megatron_rl.engine.engine import MegatronEngine

__all__ = ["role_class", "build_role"]

_ENGINE_ROLES = {"actor": "actor", "ref": "actor", "teacher": "actor", "critic": "critic", "reward": "reward"}


class _EngineRole:
    """The engine exposed under a role's interface (``.engine`` + the role methods)."""

    def __init__(self, engine: MegatronEngine):
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def role_class(name: str) -> type:
    """The class whose methods (with their declared batch fields) a role's ranks run."""
    if name not in _ENGINE_ROLES:
        raise ValueError(f"role={name!r}; allowed: {sorted(_ENGINE_ROLES)}")
    return MegatronEngine


def build_role(name: str, model_cfg: Any, mesh: Any, config: Any, *,
               transformer_overrides: Optional[Mapping[str, Any]] = None) -> _EngineRole:
    """The role object of one rank: its engine (built on ``mesh``) and its methods."""
    if name == "reward":  # RewardModelConfig: the engine reads the forward micro-batch from a CriticConfig
        from megatron_rl.config import CriticConfig

        config = CriticConfig(ppo_micro_batch_size_per_gpu=config.micro_batch_size_per_gpu)
    engine = MegatronEngine(model_cfg, mesh.config, role=_ENGINE_ROLES[name], config=config,
                            trainable=name in ("actor", "critic"), transformer_overrides=transformer_overrides)
    return _EngineRole(engine)
