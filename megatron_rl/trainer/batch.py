"""Rollout batches on the driver: dicts of ``[b, ...]`` tensors and per-sample lists (verl's
field names), and the guard that turns a dead Ray worker into a clear stop."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

__all__ = ["PROMPT_LISTS", "repeat_interleave_lists", "select_batch", "concat_batches", "worker_failure"]

PROMPT_LISTS = ("data_source", "ground_truth", "extra_info", "index", "raw_prompt", "reward_model")
"""Per-prompt lists of the dataloader batch that follow their prompt's n samples."""


def repeat_interleave_lists(batch: dict[str, Any], n: int, keys=PROMPT_LISTS) -> dict[str, list]:
    """Each per-prompt list in ``batch`` repeated ``n`` times per entry (prompt-major, like vLLM's output)."""
    return {k: [x for x in batch[k] for _ in range(n)] for k in keys if k in batch}


@contextlib.contextmanager
def worker_failure(step: int, log_dir: Path):
    """A Ray worker that dies (or raises) mid-step stops the run with its error, naming the step
    and the last good checkpoint (left intact: checkpoints are only written between steps)."""
    import ray

    try:
        yield
    except ray.exceptions.RayError as err:
        from megatron_rl.trainer.checkpoint import LATEST_FILE

        latest = log_dir / LATEST_FILE
        last = (f"the last good checkpoint is {log_dir}/global_step_{latest.read_text().strip()}"
                if latest.is_file() else "no checkpoint was saved (trainer.save_freq)")
        raise RuntimeError(f"step {step}: a worker failed, the run stops; {last}. Worker error: "
                           f"{type(err).__name__}: {err}") from err


def select_batch(batch: dict[str, Any], index: list[int]) -> dict[str, Any]:
    """Rows ``index`` of every tensor (dim 0) and per-sample list of a rollout batch."""
    import torch

    idx = torch.as_tensor(index, dtype=torch.long)
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            out[key] = value.index_select(0, idx)
        elif isinstance(value, list):
            out[key] = [value[i] for i in index]
        elif isinstance(value, dict):  # per-sample lists by name (reward extra info)
            out[key] = {k: [v[i] for i in index] for k, v in value.items()}
        else:
            out[key] = value
    return out


def concat_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Rollout batches (same fields; fixed prompt/response widths) stacked along the samples."""
    import torch

    first = batches[0]
    out = {}
    for key, value in first.items():
        parts = [b[key] for b in batches]
        if torch.is_tensor(value):
            out[key] = torch.cat(parts)
        elif isinstance(value, list):
            out[key] = [x for part in parts for x in part]
        elif isinstance(value, dict):
            out[key] = {k: [x for part in parts for x in part.get(k, [None] * len(part[next(iter(part))]))]
                        for k in value}
        else:
            out[key] = value
    return out
