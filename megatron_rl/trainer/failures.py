"""The guard that turns a dead Ray worker into a clear stop that names the last good checkpoint."""

from __future__ import annotations

import contextlib
from pathlib import Path

from megatron_rl.trainer.step_checkpoints import last_good_checkpoint
from parallel.checkpoint import DiskFullError, fmt_bytes, free_bytes, is_disk_full

__all__ = ["worker_failure"]


@contextlib.contextmanager
def worker_failure(step: int, log_dir: Path):
    """A Ray worker that dies (or raises) mid-step stops the run with its error, naming the step
    and the last good checkpoint (left intact: checkpoints are only written between steps). A
    worker that ran out of disk space is reported as a full disk (``DiskFullError``)."""
    import ray

    try:
        yield
    except ray.exceptions.RayError as err:
        last = last_good_checkpoint(log_dir)
        if is_disk_full(err):
            raise DiskFullError(
                f"step {step}: a worker ran out of disk space (disk full; {fmt_bytes(free_bytes(log_dir))} "
                f"free under {log_dir}), the run stops; {last}. Worker error: {type(err).__name__}: "
                f"{err}",
                path=log_dir,
                free=free_bytes(log_dir),
            ) from err
        raise RuntimeError(
            f"step {step}: a worker failed, the run stops; {last}. Worker error: {type(err).__name__}: {err}"
        ) from err
