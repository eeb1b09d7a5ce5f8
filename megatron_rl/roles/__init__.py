"""Roles over the Megatron engine: actor, reference, critic, reward model, distillation teacher.

A role is a small class that owns a ``MegatronEngine`` (``.engine``) and builds its heads and loss
closures from typed loss inputs: ``Actor`` (``actor`` trainable; ``ref`` and ``teacher`` the same
class over a frozen engine), ``Critic`` (``critic``) and ``RewardModel`` (``reward``). Their
methods declare the batch fields they read (``megatron_rl.data.batch.batch_fields``); worker
groups look the class up with ``role_class`` and every rank builds its role with ``build_role``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from megatron_rl.engine import MegatronEngine
from megatron_rl.roles.actor import Actor
from megatron_rl.roles.critic_role import Critic
from megatron_rl.roles.reward_model import RewardModel
from megatron_rl.roles.common import check_config

__all__ = ["ROLE_CLASSES", "TRAINABLE_ROLES", "role_class", "build_role", "Actor", "Critic", "RewardModel"]

ROLE_CLASSES: dict[str, type] = {
    "actor": Actor,
    "ref": Actor,
    "teacher": Actor,
    "critic": Critic,
    "reward": RewardModel,
}
"""Role name -> class. The class's ``head`` is its engine's head."""

TRAINABLE_ROLES = ("actor", "critic")
"""Roles whose engine has an optimizer; the others are frozen."""


def role_class(name: str) -> type:
    """The class whose methods (with their declared batch fields) a role's ranks run."""
    if name not in ROLE_CLASSES:
        raise ValueError(f"role={name!r}; allowed: {sorted(ROLE_CLASSES)}")
    return ROLE_CLASSES[name]


def build_role(
    name: str,
    model_cfg: Any,
    mesh: Any,
    config: Any,
    *,
    transformer_overrides: Optional[Mapping[str, Any]] = None,
    sequence_parallel: bool = False,
    remove_padding: bool = True,
    distributed_optimizer: bool = False,
    routing_replay: bool = False,
    lora: Optional[Any] = None,
) -> Any:
    """This rank's role object: its engine, built on ``mesh``, and the role's methods.

    ``config`` is the role's typed config: ``ActorConfig`` for ``actor`` / ``ref`` / ``teacher``,
    ``CriticConfig`` for ``critic``, ``RewardModelConfig`` for ``reward``. A trainable role's
    engine gets ``config.optim``. ``remove_padding`` (``megatron.use_remove_padding``) packs every
    micro-batch into one THD sequence; ``distributed_optimizer`` (``megatron.use_distributed_optimizer``)
    shards a trainable role's optimizer state over DP; ``routing_replay`` (``megatron.router_replay.mode``
    not ``disabled``) builds the MoE routers with Megatron's router replay. ``lora`` (a ``LoRAConfig``,
    the actor only) puts LoRA adapters on a frozen base: only they train, and ``Actor.compute_ref_log_prob``
    is the base model's (the reference policy).
    """
    cls = role_class(name)
    check_config(name, config, cls.config_type)  # before the (collective, slow) engine build
    trainable = name in TRAINABLE_ROLES
    engine = MegatronEngine(
        model_cfg,
        mesh,
        head=cls.head,
        trainable=trainable,
        optim=config.optim if trainable else None,
        transformer_overrides=transformer_overrides,
        sequence_parallel=sequence_parallel,
        remove_padding=remove_padding,
        distributed_optimizer=distributed_optimizer and trainable,
        routing_replay=routing_replay,
        name=name,
        lora=lora,
    )
    return cls(engine, config)
