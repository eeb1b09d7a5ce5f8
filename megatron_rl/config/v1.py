"""``trainer.v1.*``: verl 0.9.1's V1 trainer modes (synchronous, one-step off-policy, fully async).

    trainer.v1
      trainer_mode             sync | colocate_async | separate_async
      colocate_async           num_warmup_batches (batches generated ahead of the trainer)
      separate_async           num_warmup_batches, parameter_sync_step (mini-batches per weight push)
      sampler                  max_off_policy_threshold, max_off_policy_strategy (drop | wait)
      partial_rollout          a weight push pauses in-flight generations; they continue with the new weights

``sync`` is today's loop. ``colocate_async`` keeps the rollout on the trainer's resources and
generates ``num_warmup_batches`` batches ahead (1 = one-step off-policy: step k trains on rollouts
of the weights after step k-2, step 1 is synchronous). ``separate_async`` gives the rollout its own
resources (``actor_rollout_ref.rollout.nnodes`` x ``n_gpus_per_node``; on CPU that many CPUs for the
rollout's process) and streams finished groups into a bounded replay buffer
(``megatron_rl.trainer.replay_buffer``); it forces bypass mode (the rollout's log-probs are the old
ones), as verl's V1 ``trainer_separate_async`` does.

Staleness here counts policy versions behind the trainer (0 = on-policy); verl's replay buffer
counts the versions a trajectory *spans* (1 = on-policy). ``max_off_policy_threshold=0`` is
therefore allowed here and means strictly on-policy; None disables the bound.

``partial_rollout`` (async modes only, verl's ``async_training.partial_rollout``): a weight push
pauses the rollout's in-flight generations between two vLLM engine steps (the engine is driven step
by step; ``megatron_rl.rollout.partial``), loads the new weights and continues them: each unfinished
sample is re-submitted as prompt + its tokens so far (token ids), so its KV cache is recomputed with
the new weights and the tokens after the push -- and their rollout log-probs -- come from them.
Every token carries the version that produced it (``rollout_policy_versions`` [b, R]); a sample's
``rollout_policy_version`` (what the staleness bound uses) is its oldest token's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Optional

from megatron_rl.config.base_config import BaseConfig, check_choice, check_range

__all__ = [
    "V1Config",
    "ColocateAsyncConfig",
    "SeparateAsyncConfig",
    "SamplerConfig",
    "TRAINER_MODES",
    "OFF_POLICY_STRATEGIES",
    "check_async_run",
]

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
OFF_POLICY_STRATEGIES = ("drop", "wait")


@dataclasses.dataclass
class ColocateAsyncConfig(BaseConfig):
    """``trainer.v1.colocate_async``: the rollout shares the trainer's resources."""

    num_warmup_batches: int = 1
    """Batches generated ahead of the trainer (1 = one-step off-policy; 0 = synchronous)."""

    def __post_init__(self) -> None:
        check_range("trainer.v1.colocate_async.num_warmup_batches", self.num_warmup_batches, low=0)


@dataclasses.dataclass
class SeparateAsyncConfig(BaseConfig):
    """``trainer.v1.separate_async``: the rollout on its own resources, a bounded replay buffer."""

    num_warmup_batches: int = 1
    """Batches the rollouter may run ahead of the trainer (the replay buffer's bound, in batches)."""
    parameter_sync_step: int = 4
    """Mini-batches (optimizer steps) between weight pushes; verl requires
    ``data.train_batch_size == parameter_sync_step * actor.ppo_mini_batch_size`` (one push per step)."""

    def __post_init__(self) -> None:
        check_range("trainer.v1.separate_async.num_warmup_batches", self.num_warmup_batches, low=0)
        check_range("trainer.v1.separate_async.parameter_sync_step", self.parameter_sync_step, low=1)


@dataclasses.dataclass
class SamplerConfig(BaseConfig):
    """``trainer.v1.sampler``: what the trainer may take from the replay buffer."""

    max_off_policy_threshold: Optional[int] = 8
    """Most policy versions a sample may lag the trainer (0 = on-policy; None = unbounded)."""
    max_off_policy_strategy: str = "drop"
    """``drop``: evict older samples at dequeue (``training/off_policy/evicted_samples``) and refill;
    ``wait``: never evict -- the rollouter runs at most ``max_off_policy_threshold`` batches ahead."""

    def __post_init__(self) -> None:
        if self.max_off_policy_threshold is not None and self.max_off_policy_threshold < 0:
            raise ValueError(
                f"trainer.v1.sampler.max_off_policy_threshold={self.max_off_policy_threshold} must be "
                ">= 0 (policy versions a sample may lag the trainer; 0 = on-policy) or null (unbounded)"
            )
        check_choice("trainer.v1.sampler.max_off_policy_strategy", self.max_off_policy_strategy, OFF_POLICY_STRATEGIES)


@dataclasses.dataclass
class V1Config(BaseConfig):
    """``trainer.v1``: which trainer loop runs (see the module docstring)."""

    trainer_mode: str = "sync"
    """``sync`` | ``colocate_async`` | ``separate_async``."""
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)
    """One-step (or k-step) off-policy on shared resources."""
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)
    """Fully async on separate resources."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Staleness bound at dequeue."""
    partial_rollout: bool = False
    """A weight push pauses in-flight generations between engine steps and they continue with the new
    weights (KV recomputed from prompt + tokens so far; tokens after the push tagged with the new
    version). Needs an async ``trainer_mode`` and the in-process vLLM engine (see the module docstring)."""

    def __post_init__(self) -> None:
        for name, cls in (
            ("colocate_async", ColocateAsyncConfig),
            ("separate_async", SeparateAsyncConfig),
            ("sampler", SamplerConfig),
        ):
            if isinstance(getattr(self, name), Mapping):
                setattr(self, name, cls.from_dict(getattr(self, name), path=name))
        check_choice("trainer.v1.trainer_mode", self.trainer_mode, TRAINER_MODES)
        if self.partial_rollout and self.trainer_mode == "sync":
            raise ValueError(
                "trainer.v1.partial_rollout=True is not supported: the rollout engine pauses "
                "generations only for weight pushes that arrive while it generates, and "
                "trainer.v1.trainer_mode='sync' never pushes then; use trainer_mode='colocate_async' "
                "or 'separate_async', or set trainer.v1.partial_rollout=false"
            )

    @property
    def is_async(self) -> bool:
        """True for ``colocate_async`` and ``separate_async``."""
        return self.trainer_mode != "sync"

    def lookahead(self) -> int:
        """Batches the rollouter may run ahead of the trainer in this mode (0 for ``sync``)."""
        if self.trainer_mode == "sync":
            return 0
        section = self.colocate_async if self.trainer_mode == "colocate_async" else self.separate_async
        return int(section.num_warmup_batches)


def check_async_run(config: Any) -> None:
    """Cross-section checks of ``trainer.v1`` against the run (``RunConfig``): placement per
    mode, verl's batch rule of ``separate_async``, rollout log-probs, warm-up batches within the run.
    ``ValueError`` naming keys and values; called when the run config is built (before any worker)."""
    v1, rollout, trainer = config.trainer.v1, config.actor_rollout_ref.rollout, config.trainer
    for key in ("nnodes", "n_gpus_per_node"):
        check_range(f"actor_rollout_ref.rollout.{key}", getattr(rollout, key), low=0)
    separate = rollout.nnodes > 0
    if separate and rollout.n_gpus_per_node < 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.nnodes={rollout.nnodes} places the rollout on its own resources "
            f"and needs actor_rollout_ref.rollout.n_gpus_per_node >= 1, got {rollout.n_gpus_per_node}"
        )
    if separate and trainer.device == "cpu" and rollout.nnodes != 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.nnodes={rollout.nnodes}: on CPU the separate rollout is one "
            "process on this machine (nnodes=1, n_gpus_per_node = its CPUs)"
        )
    mode = v1.trainer_mode
    if mode == "separate_async" and not separate:
        raise ValueError(
            "trainer.v1.trainer_mode='separate_async' needs the rollout on its own resources: set "
            "actor_rollout_ref.rollout.nnodes >= 1 and n_gpus_per_node >= 1 (got nnodes="
            f"{rollout.nnodes}); for a colocated rollout use trainer_mode='colocate_async'"
        )
    if mode == "colocate_async" and separate:
        raise ValueError(
            f"trainer.v1.trainer_mode='colocate_async' shares the trainer's resources, but "
            f"actor_rollout_ref.rollout.nnodes={rollout.nnodes} separates the rollout; set nnodes=0 "
            "or use trainer_mode='separate_async'"
        )
    if mode == "sync" and separate:
        raise ValueError(
            f"actor_rollout_ref.rollout.nnodes={rollout.nnodes} (a separate rollout) idles one side "
            "of the machine in trainer.v1.trainer_mode='sync'; use separate_async, or nnodes=0"
        )
    if mode == "sync":
        return
    if v1.partial_rollout and not rollout.in_process_engine:
        raise ValueError(
            "trainer.v1.partial_rollout=True needs actor_rollout_ref.rollout.in_process_engine=True: "
            "the pause between engine steps drives the in-process vLLM engine (got "
            "in_process_engine=False, an engine core in its own process, which cannot be paused here)"
        )
    if trainer.device == "cuda" and rollout.free_cache_engine:
        raise ValueError(
            f"trainer.v1.trainer_mode={mode!r} generates while the actor trains, so the engine must "
            "stay awake: set actor_rollout_ref.rollout.free_cache_engine=false"
        )
    if config.actor_rollout_ref.rollout.multi_turn.enable:
        raise ValueError(
            f"trainer.v1.trainer_mode={mode!r} with actor_rollout_ref.rollout.multi_turn.enable=True "
            "is not supported (agent sessions run synchronously)"
        )
    # DAPO dynamic sampling (algorithm.filter_groups) works here: the rollouter filters each finished
    # group before the replay buffer and the trainer waits for enough kept ones
    gen, train_prompts = config.data.gen_batch_size, config.data.train_batch_size
    if gen is not None and train_prompts % gen:
        raise ValueError(
            f"data.gen_batch_size={gen} must divide data.train_batch_size={train_prompts} in "
            f"trainer.v1.trainer_mode={mode!r} (the rollouter submits whole prompt batches)"
        )
    if mode == "separate_async" and config.reward.reward_model.enable:
        raise ValueError(
            "trainer.v1.trainer_mode='separate_async' with reward.reward_model.enable=True is not "
            "supported: the rollouter scores on its own thread while the trainer's groups run"
        )
    if mode == "separate_async":
        mini, train = config.actor_rollout_ref.actor.ppo_mini_batch_size, config.data.train_batch_size
        step = v1.separate_async.parameter_sync_step
        if train != step * mini:
            raise ValueError(
                f"trainer.v1.separate_async.parameter_sync_step={step}: verl's separate_async pushes "
                f"weights every parameter_sync_step mini-batches, once per step, so data.train_batch_size"
                f"={train} must equal parameter_sync_step * actor_rollout_ref.actor.ppo_mini_batch_size "
                f"= {step}*{mini} = {step * mini}"
            )
        if not rollout.calculate_log_probs:
            raise ValueError(
                "trainer.v1.trainer_mode='separate_async' forces bypass mode (the rollout's log-probs "
                "are the old ones): set actor_rollout_ref.rollout.calculate_log_probs=True"
            )
    ahead, total = v1.lookahead(), trainer.total_training_steps
    section = "colocate_async" if mode == "colocate_async" else "separate_async"
    if total is not None and ahead >= total:
        raise ValueError(
            f"trainer.v1.{section}.num_warmup_batches={ahead} is not smaller than "
            f"trainer.total_training_steps={total}: the batches generated ahead would never be trained on"
        )
