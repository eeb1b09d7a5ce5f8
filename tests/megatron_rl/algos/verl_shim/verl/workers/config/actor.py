"""``verl.workers.config.actor`` -> ``megatron_rl.config.ActorConfig``.

verl's tests build ``ActorConfig(strategy="fsdp", ...)`` only to hand its loss fields (``clip_ratio``
...) to the loss functions. The project's ActorConfig takes only ``strategy="megatron"`` (the one backend
built), so this shim checks the name against verl's and builds the project's config from the other
fields: the algorithm layer never reads ``strategy``.
"""

from megatron_rl.config import ActorConfig as _ActorConfig

VERL_STRATEGIES = ("fsdp", "fsdp2", "megatron")


def ActorConfig(strategy: str = "megatron", **fields):  # noqa: N802  (verl's class name)
    """The project's ``ActorConfig`` of ``fields`` for any of verl's ``strategy`` names."""
    if strategy not in VERL_STRATEGIES:
        raise ValueError(f"actor.strategy={strategy!r} is not allowed; choose one of {list(VERL_STRATEGIES)}")
    return _ActorConfig(**fields)
