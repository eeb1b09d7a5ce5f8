"""The guard that turns a dead Ray worker into a clear stop that names the last good checkpoint."""

from __future__ import annotations

import contextlib
from pathlib import Path

from megatron_rl.trainer.checkpoint import LATEST_FILE

__all__ = ["worker_failure"]


@contextlib.contextmanager
def worker_failure(step: int, log_dir: Path):
    """A Ray worker that dies (or raises) mid-step stops the run with its error, naming the step
    and the last good checkpoint (left intact: checkpoints are only written between steps)."""
    import ray

    try:
        yield
    except ray.exceptions.RayError as err:
        latest = Path(log_dir) / LATEST_FILE
        last = (f"the last good checkpoint is {log_dir}/global_step_{latest.read_text().strip()}"
                if latest.is_file() else "no checkpoint was saved (trainer.save_freq)")
        raise RuntimeError(f"step {step}: a worker failed, the run stops; {last}. Worker error: "
                           f"{type(err).__name__}: {err}") from err
