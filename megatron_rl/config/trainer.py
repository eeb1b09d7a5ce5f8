"""``trainer``: run length, logging, checkpoints, the cluster, the loop's mode (``trainer.v1``) and the user's
callbacks (verl's keys and defaults)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import field
from typing import Optional

from megatron_rl.config.base_config import BaseConfig, check_choice, check_range
from megatron_rl.config.v1 import V1Config

__all__ = ["TrainerConfig", "LOGGERS"]

LOGGERS = ("console", "tensorboard", "wandb")


def _check_freq(field_name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{field_name}={value!r} is not allowed; use a positive int, or -1/0 to disable")


@dataclasses.dataclass
class TrainerConfig(BaseConfig):
    """``trainer.*``: run length, logging, checkpoints and the cluster (verl's keys and defaults)."""

    total_epochs: int = 30
    """Passes over the training prompts."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps; None = ``total_epochs`` worth."""
    project_name: str = "verl_examples"
    """Project name for loggers and the checkpoint directory."""
    experiment_name: str = "gsm8k"
    """Run name for loggers and the checkpoint directory."""
    logger: list = field(default_factory=lambda: ["console"])
    """Metric sinks among ``console``, ``tensorboard``, ``wandb`` (metrics.jsonl is always written)."""
    log_val_generations: int = 0
    """Validation samples printed/logged per validation."""
    rollout_data_dir: Optional[str] = None
    """Dump every step's generations as jsonl here; None = off."""
    validation_data_dir: Optional[str] = None
    """Dump validation generations as jsonl here; None = off."""
    nnodes: int = 1
    """Nodes in the cluster."""
    n_gpus_per_node: int = 8
    """Devices per node (worker processes per node on CPU)."""
    device: str = "cuda"
    """``cuda`` or ``cpu``."""
    save_freq: int = -1
    """Checkpoint every N steps (and at the end); -1/0 = only the final model."""
    test_freq: int = -1
    """Validate every N steps; -1/0 = never during training."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Validate and exit."""
    critic_warmup: int = 0
    """Steps that update only the critic before the actor starts training."""
    sft_warmup_steps: int = 0
    """Supervised steps on the built-in task's (prompt, answer) pairs before RL (needs ``data.task``);
    RL starts from the warmed model, as from an SFT checkpoint. 0 = off."""
    sft_warmup_lr: float = 3e-3
    """Peak learning rate of the supervised warm-up (AdamW, cosine decay)."""
    balance_batch: bool = True
    """Reorder each step's samples so every data-parallel rank of the actor gets a near-equal token
    count (Karmarkar-Karp over verl's attention workload); logs verl's ``global_seqlen/*`` metrics."""
    resume_mode: str = "auto"
    """``auto`` (latest checkpoint in ``default_local_dir`` if any), ``disable``, or ``resume_path``."""
    resume_from_path: Optional[str] = None
    """Checkpoint to resume from with ``resume_mode=resume_path``."""
    default_local_dir: Optional[str] = None
    """Checkpoint directory; None = ``checkpoints/{project_name}/{experiment_name}``."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N actor checkpoints; None = all."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N critic checkpoints; None = all."""
    max_consecutive_skipped_steps: int = 3
    """A step whose rewards fail (the reward function raised or returned a non-finite value) is
    reported and skipped; this many skipped in a row stop the run with the error."""
    phase_timeout_s: Optional[float] = None
    """Hang watchdog: a step phase (generation, a role's forward or update, weight sync, a checkpoint
    save, validation) running longer than this many seconds dumps the Python stacks of the driver and
    every worker to ``<default_local_dir>/stacks/`` and stops the run (exit 1), naming the phase and the
    last good checkpoint. None = off."""
    save_on_preemption: bool = False
    """On SIGTERM (SLURM's preemption and time limit): finish the current step, save a checkpoint, then
    stop (exit 143). False: abandon the step at once (the last saved checkpoint stays the latest). A
    second signal stops at once either way."""
    resume_fallback: bool = True
    """``resume_mode=auto`` with a damaged latest checkpoint (its manifest's sizes or checksums do not
    match): resume from the newest complete one and say which file is bad; False: refuse (exit 2)."""
    v1: V1Config = field(default_factory=V1Config)
    """verl's V1 trainer modes: ``sync`` (default), ``colocate_async`` (one-step off-policy),
    ``separate_async`` (fully async, bounded staleness): ``megatron_rl.config.v1``."""
    callbacks: list = field(default_factory=list)
    """Your own callbacks, as dotted paths ``package.module.Class`` of ``TrainerCallback`` subclasses
    (``megatron_rl.trainer.callbacks``): constructed with no arguments in the driver, called in this order at
    ``on_fit_start``, ``on_validation_end``, ``on_checkpoint``, ``on_step_end``, ``on_fit_end``. One that
    cannot be imported stops the run before any worker starts."""

    def __post_init__(self) -> None:
        if isinstance(self.v1, Mapping):
            self.v1 = V1Config.from_dict(self.v1, path="v1")
        if isinstance(self.logger, str):
            self.logger = [self.logger]
        if isinstance(self.callbacks, str):
            self.callbacks = [self.callbacks]
        for i, path in enumerate(self.callbacks):
            if (
                not isinstance(path, str)
                or "." not in path.strip(".")
                or any(not part.isidentifier() for part in path.split("."))
            ):
                raise ValueError(f"trainer.callbacks[{i}]={path!r}: expected a dotted path 'package.module.Class'")
        for name in self.logger:
            check_choice("trainer.logger entry", name, LOGGERS)
        check_choice("trainer.device", self.device, ("cpu", "cuda"))
        check_choice("trainer.resume_mode", self.resume_mode, ("auto", "disable", "resume_path"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode='resume_path' needs trainer.resume_from_path")
        for name in ("total_epochs", "nnodes", "n_gpus_per_node"):
            check_range(f"trainer.{name}", getattr(self, name), low=1)
        for name in ("total_training_steps", "max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
            if getattr(self, name) is not None:
                check_range(f"trainer.{name}", getattr(self, name), low=1)
        for name in ("critic_warmup", "log_val_generations", "sft_warmup_steps", "max_consecutive_skipped_steps"):
            check_range(f"trainer.{name}", getattr(self, name), low=0)
        _check_freq("trainer.save_freq", self.save_freq)
        _check_freq("trainer.test_freq", self.test_freq)
        if self.phase_timeout_s is not None:
            check_range("trainer.phase_timeout_s", self.phase_timeout_s, low=0, low_inclusive=False)
        if self.default_local_dir is None:
            self.default_local_dir = f"checkpoints/{self.project_name}/{self.experiment_name}"

    @property
    def world_size(self) -> int:
        """Devices (or CPU worker processes) in the cluster: ``nnodes * n_gpus_per_node``."""
        return self.nnodes * self.n_gpus_per_node
