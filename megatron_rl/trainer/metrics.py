"""Side concerns of the training loop: phase timing, batch metrics (verl's names) and loggers.

* ``timer(name, timing)``: adds the wall time of a ``with`` block to ``timing[name]``.
* ``compute_data_metrics`` / ``compute_timing_metrics`` / ``compute_throughput_metrics``:
  verl's ``critic/score/*``, ``critic/rewards/*``, ``critic/advantages/*``,
  ``critic/returns/*``, ``critic/values/*``, ``response_length/*``, ``prompt_length/*``,
  ``timing_s/*``, ``timing_per_token_ms/*`` and ``perf/*`` from a rollout batch.
* ``MetricsLogger``: one ``metrics.jsonl`` line per step, a one-line console summary, and
  TensorBoard scalars when ``"tensorboard"`` is among the loggers.
* ``metrics_row`` / ``restore_row`` / ``drop_rows_after``: a step's row as written, and the resume's
  edits of ``metrics.jsonl`` (a checkpoint carries its step's row, so a run killed between the
  checkpoint and the row's write gets the row back when it resumes).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

__all__ = [
    "timer",
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughput_metrics",
    "step_metrics",
    "MetricsLogger",
    "drop_rows_after",
    "metrics_row",
    "restore_row",
    "METRICS_ROW",
    "CONSOLE_KEYS",
]

METRICS_ROW = "metrics_row"  # the trainer_state.json key of the checkpointed step's metrics row

CONSOLE_KEYS = (
    "critic/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "timing_s/step",
)
"""Keys the console line shows (when present)."""


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to ``timing[name]`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}/mean": math.nan, f"{prefix}/max": math.nan, f"{prefix}/min": math.nan}
    values = values.float()
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def _lengths(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_length [b], response_length [b])`` in tokens."""
    width = batch["responses"].shape[-1]
    prompt_length = batch["attention_mask"][:, :-width].sum(-1).float()
    response_length = batch["response_mask"].sum(-1).float()
    return prompt_length, response_length


def compute_data_metrics(batch: Mapping[str, Any], use_critic: bool) -> dict[str, float]:
    """verl's ``compute_data_metrics``: scores and rewards per sequence (non-empty responses),
    advantages / returns / values over response tokens, length statistics and clip ratios."""
    mask = batch["response_mask"].bool()
    prompt_length, response_length = _lengths(batch)
    non_empty = response_length > 0
    metrics = {
        **_stats("critic/score", batch["token_level_scores"].sum(-1)[non_empty]),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(-1)[non_empty]),
        **_stats("critic/advantages", torch.masked_select(batch["advantages"], mask)),
        **_stats("critic/returns", torch.masked_select(batch["returns"], mask)),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": float((response_length == batch["responses"].shape[-1]).float().mean()),
        **_stats("response_length_non_aborted", response_length[non_empty]),
        "response/aborted_ratio": float((~non_empty).float().mean()),
        **_stats("prompt_length", prompt_length),
        "prompt_length/clip_ratio": float((prompt_length == batch["prompts"].shape[-1]).float().mean()),
    }
    if use_critic:
        values = torch.masked_select(batch["values"], mask)
        returns = torch.masked_select(batch["returns"], mask)
        metrics.update(_stats("critic/values", values))
        metrics["critic/vf_explained_var"] = (
            float(1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)) if values.numel() > 1 else math.nan
        )
    return metrics


def compute_timing_metrics(batch: Mapping[str, Any], timing: Mapping[str, float]) -> dict[str, float]:
    """``timing_s/<phase>`` and ``timing_per_token_ms/<phase>`` (gen per response token, the
    model phases per prompt + response token), as verl."""
    prompt_length, response_length = _lengths(batch)
    response_tokens = float(response_length.sum())
    all_tokens = float(prompt_length.sum()) + response_tokens
    per_phase = {
        "gen": response_tokens,
        **{k: all_tokens for k in ("ref", "values", "adv", "update_critic", "update_actor")},
    }
    out = {f"timing_s/{k}": float(v) for k, v in timing.items()}
    for k, tokens in per_phase.items():
        if k in timing:
            out[f"timing_per_token_ms/{k}"] = timing[k] * 1000 / tokens if tokens > 0 else 0.0
    return out


def compute_throughput_metrics(
    batch: Mapping[str, Any], timing: Mapping[str, float], n_devices: int
) -> dict[str, float]:
    """``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (tokens/s/device)."""
    total = int(batch["attention_mask"].sum())
    step = float(timing["step"])
    return {
        "perf/total_num_tokens": total,
        "perf/time_per_step": step,
        "perf/throughput": total / (step * max(n_devices, 1)) if step > 0 else math.nan,
    }


def step_metrics(
    batch: Optional[Mapping[str, Any]],
    timing: Mapping[str, float],
    *,
    step: int,
    epoch: int,
    use_critic: bool,
    n_devices: int,
) -> dict[str, float]:
    """The step's ``training/*``, data, timing and throughput metrics (only timing for a skipped
    step, whose ``batch`` is None)."""
    out = {"training/global_step": step, "training/epoch": epoch}
    if batch is None:
        return {**out, **{f"timing_s/{k}": v for k, v in timing.items()}}
    return {
        **out,
        **compute_data_metrics(batch, use_critic),
        **compute_timing_metrics(batch, timing),
        **compute_throughput_metrics(batch, timing, n_devices),
    }


def drop_rows_after(path: Path, step: int) -> None:
    """Remove the lines of ``metrics.jsonl`` at ``path`` logged for steps after ``step`` (a resumed
    run logs them again). The file is replaced atomically: a kill mid-edit loses no row."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    _replace_text(path, "".join(row + "\n" for row in rows))


def metrics_row(metrics: Mapping[str, Any], step: int) -> dict[str, Any]:
    """Step ``step``'s ``metrics.jsonl`` row: ``{"step": step, **metrics}``, keys sorted, JSON values."""
    return {"step": int(step), **{k: _jsonable(v) for k, v in sorted(metrics.items())}}


def restore_row(path: Path, row: Optional[Mapping[str, Any]]) -> bool:
    """Append ``row`` (a step's row saved in its checkpoint) to ``metrics.jsonl`` at ``path`` unless that
    step already has one; True when it was appended. The checkpoint is committed before the row is
    written, so a run killed in between has the step's weights but not its row: its resume puts it back."""
    if not row:
        return False
    lines = path.read_text().splitlines() if path.is_file() else []
    if any(json.loads(line).get("step") == row["step"] for line in lines if line.strip()):
        return False
    _replace_text(path, "".join(line + "\n" for line in lines if line.strip()) + json.dumps(dict(row)) + "\n")
    return True


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; "nan"/"inf" round-trip through float()
    return value


class MetricsLogger:
    """Per-step metrics to ``<log_dir>/metrics.jsonl``, the console and optionally TensorBoard.

    Args:
        log_dir: directory of ``metrics.jsonl`` (and ``tensorboard/``); created.
        loggers: verl's ``trainer.logger`` list; ``"console"`` prints one line per step,
            ``"tensorboard"`` writes scalars (needs the ``tensorboard`` package). Other names
            raise ValueError; ``"wandb"`` logs to W&B (``project`` / ``experiment`` name the run).
        total_steps: shown as ``step k/N`` on the console.
    """

    KNOWN = ("console", "tensorboard", "wandb")

    def __init__(
        self,
        log_dir: str | Path,
        loggers: Sequence[str] = ("console",),
        *,
        total_steps: Optional[int] = None,
        console_keys: Sequence[str] = CONSOLE_KEYS,
        project: str = "megatron_rl",
        experiment: Optional[str] = None,
        config: Any = None,
    ):
        unknown = [name for name in loggers if name not in self.KNOWN]
        if unknown:
            raise ValueError(f"trainer.logger has unsupported logger(s) {unknown}; allowed: {list(self.KNOWN)}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / "metrics.jsonl"
        self.console = "console" in loggers
        self.total_steps = total_steps
        self.console_keys = tuple(console_keys)
        self._tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))
        self._wandb = None
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                raise ValueError("trainer.logger includes 'wandb' but the wandb package is not installed") from None
            self._wandb = wandb.init(project=project, name=experiment, config=config)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl (flushed), print, add scalars."""
        row = metrics_row(metrics, step)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.console:
            total = f"/{self.total_steps}" if self.total_steps else ""
            shown = " ".join(f"{k}={float(metrics[k]):.4g}" for k in self.console_keys if k in metrics)
            print(f"step {step}{total} | {shown}", flush=True)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
