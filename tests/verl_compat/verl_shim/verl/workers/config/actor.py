"""``verl.workers.config.actor`` -> ``megatron_rl.config`` (``ActorConfig``, ``PolicyLossConfig``).

verl's tests build ``ActorConfig(strategy="fsdp", ...)`` only to hand its loss fields (``clip_ratio``,
``policy_loss.dro_beta`` ...) to the loss functions. The project's ``ActorConfig`` accepts only
``strategy="megatron"`` (the one training backend built), so this adapter checks the name against
verl's strategies and builds the project's config from the other fields through verl's constructor
(``megatron_rl.config.verl``: verl's ``ppo_micro_batch_size`` and verl-only fields); the algorithm
layer never reads ``strategy``.
"""

from megatron_rl.config import PolicyLossConfig  # noqa: F401
from megatron_rl.config.verl import verl_class

_ActorConfig = verl_class("ActorConfig")

VERL_STRATEGIES = ("fsdp", "fsdp2", "megatron")


def ActorConfig(strategy: str = "megatron", **fields):  # noqa: N802  (verl's class name)
    """The project's ``ActorConfig`` of ``fields`` for any of verl's ``strategy`` names."""
    if strategy not in VERL_STRATEGIES:
        raise ValueError(f"actor.strategy={strategy!r} is not allowed; choose one of {list(VERL_STRATEGIES)}")
    return _ActorConfig(**fields)
