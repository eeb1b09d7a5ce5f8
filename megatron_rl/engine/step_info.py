"""What a loss closure tells the engine about one optimizer step, and how metrics become global.

``StepInfo`` is what the engine tells a loss closure: the global token / sequence counts of the
mini-batch (all-reduced over data parallelism, so losses normalised by them do not depend on the
micro-batch count or the DP size). ``LossMetrics`` is what the closure returns per micro-batch
beside its loss, in four kinds that reduce differently; ``reduce_metrics`` turns the last
pipeline stage's per-micro-batch metrics into the global values every DP rank agrees on.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["StepInfo", "LossMetrics", "reduce_metrics"]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """The optimizer step a micro-batch belongs to (the same for all its micro-batches).

    Megatron's DDP *averages* gradients over the DP ranks, so a rank's share of a loss normalised
    by the global counts is scaled by ``dp_size`` (``megatron_rl.algos.agg_loss`` does this when
    given ``global_batch_info()``); its ``LossMetrics.sums`` entry then averages to the global loss.
    """

    num_micro_batches: int
    """Micro-batches of this rank's mini-batch."""
    dp_size: int
    """Data-parallel ranks sharing the mini-batch."""
    batch_num_tokens: int
    """Response tokens (``response_mask`` ones) of the global mini-batch."""
    global_batch_size: int
    """Sequences with at least one response token in the global mini-batch."""

    def global_batch_info(self) -> dict[str, int]:
        """The counts as ``megatron_rl.algos.agg_loss`` keyword arguments."""
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.batch_num_tokens,
            "global_batch_size": self.global_batch_size,
        }


@dataclasses.dataclass
class LossMetrics:
    """One micro-batch's metrics, by how they combine into the step's global value."""

    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    """Already normalised by the global counts (losses): summed over micro-batches, averaged over DP."""
    weighted: dict[str, float] = dataclasses.field(default_factory=dict)
    """Token-weighted sums (a ratio times the micro-batch's tokens): summed over micro-batches and
    DP ranks, divided by the global token count."""
    minima: dict[str, float] = dataclasses.field(default_factory=dict)
    """Minimum over all micro-batches and DP ranks."""
    maxima: dict[str, float] = dataclasses.field(default_factory=dict)
    """Maximum over all micro-batches and DP ranks."""


def reduce_metrics(
    outputs: Sequence[LossMetrics], *, total_tokens: float, dp_group: Any, dp_size: int, device: torch.device
) -> dict[str, float]:
    """Global metrics from this rank's per-micro-batch ``outputs`` (collective over ``dp_group``).

    Call on the last pipeline stage only. A rank whose micro-batches had no response token may
    lack some keys; the ranks agree on the key set first, so every rank joins the same reductions.
    """
    sums: dict[str, float] = defaultdict(float)
    weighted: dict[str, float] = defaultdict(float)
    lows: dict[str, float] = defaultdict(lambda: math.inf)
    highs: dict[str, float] = defaultdict(lambda: -math.inf)
    for out in outputs:
        for k, v in out.sums.items():
            sums[k] += v
        for k, v in out.weighted.items():
            weighted[k] += v
        for k, v in out.minima.items():
            lows[k] = min(lows[k], v)
        for k, v in out.maxima.items():
            highs[k] = max(highs[k], v)
    if dp_size > 1:
        names = [None] * dp_size
        dist.all_gather_object(names, (sorted(sums), sorted(weighted), sorted(lows), sorted(highs)), group=dp_group)
        for table, i in ((sums, 0), (weighted, 1), (lows, 2), (highs, 3)):
            for k in {k for n in names for k in n[i]}:
                table[k] += 0.0  # materialises the default (0, +inf or -inf)
    keys = sorted(sums) + sorted(weighted)
    vec = torch.tensor(
        [sums[k] / dp_size for k in sorted(sums)] + [weighted[k] for k in sorted(weighted)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(vec, group=dp_group)
    n_sums = len(sums)
    result = {k: float(vec[i]) if i < n_sums else float(vec[i]) / max(total_tokens, 1.0) for i, k in enumerate(keys)}
    for table, op in ((lows, dist.ReduceOp.MIN), (highs, dist.ReduceOp.MAX)):
        if table:
            ext = torch.tensor([table[k] for k in sorted(table)], dtype=torch.float64, device=device)
            dist.all_reduce(ext, op=op, group=dp_group)
            result.update({k: float(v) for k, v in zip(sorted(table), ext.tolist())})
    return result
