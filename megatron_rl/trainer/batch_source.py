"""Where a training step's batch comes from: the one loop of ``RayPPOTrainer.fit`` asks a batch source.

``RayPPOTrainer.fit`` runs every ``trainer.v1.trainer_mode`` through the same step: take the step's
batch from the source, train on it (``RayPPOTrainer.train_step``), tell the source the step trained,
then the shared tail (``RayPPOTrainer.end_step``: step metrics, validation, checkpoint, callbacks).
The source is what differs:

* ``SyncBatches`` (``sync``): the step generates and scores its own batch (``RolloutPhase.run``);
  ``None`` when the reward failed (the step is skipped).
* ``megatron_rl.trainer.async_loop.AsyncBatches`` (``colocate_async`` / ``separate_async``): the
  batch is taken from a replay buffer a rollouter fills ahead of the trainer.

A source is a context manager (``__enter__`` starts what generates ahead, ``__exit__`` stops it) with
``next_batch(step, metrics, timing)``, ``trained(step)`` (after the step's update and weight push),
``end_metrics(metrics, wall_start)`` (the step's source metrics once it is done), ``state()`` (what
a checkpoint taken now adds to the trainer state) and ``last_error`` (why the last step was skipped).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from megatron_rl.data.batch import Batch

__all__ = ["BatchSource", "SyncBatches"]


class BatchSource(Protocol):
    """What ``RayPPOTrainer.fit`` needs of a step's batch source (see the module docstring)."""

    last_error: str

    def __enter__(self) -> "BatchSource": ...

    def __exit__(self, *exc: Any) -> None: ...

    def next_batch(self, step: int, metrics: dict, timing: dict) -> Optional[Batch]: ...

    def trained(self, step: int) -> None: ...

    def end_metrics(self, metrics: dict, wall_start: float) -> None: ...

    def state(self) -> dict[str, Any]: ...


class SyncBatches:
    """The synchronous source: each step generates and scores its own batch with the current weights."""

    def __init__(self, phase: Any):
        self.phase = phase  # the run's RolloutPhase

    def __enter__(self) -> "SyncBatches":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @property
    def last_error(self) -> str:
        return self.phase.last_error

    def next_batch(self, step: int, metrics: dict, timing: dict) -> Optional[Batch]:
        return self.phase.run(step, metrics, timing)  # None: the rewards failed, the step is skipped

    def trained(self, step: int) -> None:
        return None

    def end_metrics(self, metrics: dict, wall_start: float) -> None:
        return None

    def state(self) -> dict[str, Any]:
        return {}
