"""``trainer.balance_batch``: give every data-parallel rank a near-equal share of the step's tokens.

Worker groups hand DP rank ``d`` the ``d``-th contiguous slice of the batch
(``megatron_rl.workers.dispatch``). RL batches are long-tailed, so a plain split leaves the rank
holding the long responses to set the pace while the others wait. ``balance_batch`` (verl's
``RayPPOTrainer._balance_batch``) partitions the samples into ``dp`` equal-sized groups of
near-equal attention workload (Karmarkar-Karp, ``megatron_rl.engine.batching``), orders each group
short-long-short (the lightest samples at both ends, where pipeline warm-up and cool-down expose
them) and reorders the batch so slice ``d`` is group ``d``. It returns verl's ``global_seqlen/*``
metrics: the token sums per rank before (``min``, ``max``, ``minmax_diff``) and after
(``balanced_min``, ``balanced_max``) balancing, and their ``mean``.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.engine.batching import attention_workload, balanced_partitions

__all__ = ["balance_batch", "seqlen_balance_metrics"]


def seqlen_balance_metrics(
    seqlens: list[int], partitions: list[list[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """verl's ``log_seqlen_unbalance``: token sums of the contiguous DP slices vs. of ``partitions``."""
    k = len(partitions)
    size = len(seqlens) // k
    before = [sum(seqlens[i * size : (i + 1) * size]) for i in range(k)]
    after = [sum(seqlens[i] for i in part) for part in partitions]
    return {
        f"{prefix}/min": float(min(before)),
        f"{prefix}/max": float(max(before)),
        f"{prefix}/minmax_diff": float(max(before) - min(before)),
        f"{prefix}/balanced_min": float(min(after)),
        f"{prefix}/balanced_max": float(max(after)),
        f"{prefix}/mean": float(sum(before)) / k,
    }


def balance_batch(batch: Any, dp_size: int, *, prefix: str = "global_seqlen") -> dict[str, float]:
    """Reorder ``batch`` (a ``megatron_rl.data.batch.Batch``) in place so each of ``dp_size`` contiguous
    slices holds a near-equal token count; return the ``global_seqlen/*`` metrics."""
    n = len(batch)
    if n % dp_size:
        raise ValueError(
            f"trainer.balance_batch: a batch of {n} samples cannot be split evenly over the "
            f"data-parallel size {dp_size}"
        )
    seqlens = [int(x) for x in batch["attention_mask"].sum(-1).tolist()]
    workloads = attention_workload(seqlens)
    partitions = balanced_partitions(workloads, dp_size, equal_size=True)
    metrics = seqlen_balance_metrics(seqlens, partitions, prefix)
    order = []
    for part in partitions:
        part = sorted(part, key=lambda i: (workloads[i], i))
        order.extend(part[::2] + part[1::2][::-1])
    batch.reorder(order)
    return metrics
