"""Which samples go into which micro-batch: fixed sizes, token budgets, balanced partitions.

A ``MicroBatchPlan`` is a list of index lists into a rank's batch; ``split`` cuts the batch into
its micro-batches and ``restore`` puts per-sample outputs back into the batch's order.

* ``fixed_micro_batches(n, size)``: consecutive runs of ``size`` samples (verl's
  ``*_micro_batch_size_per_gpu``).
* ``token_budget_micro_batches(lengths, max_token_len, ...)``: verl's dynamic batch size
  (``use_dynamic_bsz`` + ``*_max_token_len_per_gpu``, its ``rearrange_micro_batches``): as few
  micro-batches as keep every token sum within the budget, their attention workload balanced by
  Karmarkar-Karp; every data-parallel rank runs the same number of micro-batches (the pipeline
  schedule and DDP's gradient reduction need it: the ranks agree on the maximum), a multiple of
  the pipeline size under the interleaved schedule; the lightest micro-batches sit at both ends,
  where the pipeline's warm-up and cool-down expose them.
* ``balanced_partitions(values, k, equal_size=...)``: the Karmarkar-Karp largest differencing
  method (verl's ``get_seqlen_balanced_partitions``), also used by the trainer to give every DP
  rank a near-equal token count (``trainer.balance_batch``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "MicroBatchPlan",
    "fixed_micro_batches",
    "token_budget_micro_batches",
    "balanced_partitions",
    "karmarkar_karp",
    "attention_workload",
]


def attention_workload(lengths: Sequence[int]) -> list[int]:
    """Relative cost of a row of each length: ``24576 * s + s^2`` (verl's ``calculate_workload``:
    the linear layers of a 7B model plus causal attention)."""
    return [24576 * int(s) + int(s) * int(s) for s in lengths]


class _Set:
    """One group of a partial partition: its sum and ``(index, value)`` items in insertion order."""

    __slots__ = ("sum", "items")

    def __init__(self, items: list[tuple[int, int]]):
        self.items = items
        self.sum = sum(v for _, v in items)

    def key(self) -> tuple:
        return self.sum, len(self.items), self.items


class _State:
    """``k`` groups, largest first; the heap pops the state with the largest spread first."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[_Set]):
        self.sets = sorted(sets, key=_Set.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0].key() > other.sets[0].key()


def karmarkar_karp(values: Sequence[int], k: int, *, equal_size: bool) -> list[list[int]]:
    """Indices of ``values`` in ``k`` groups of near-equal sums (largest differencing method).

    Every state is ``k`` groups; the two states with the largest spread are merged, the largest
    group of one with the smallest of the other, until one state is left. ``equal_size``: each
    group holds ``len(values) / k`` items (states are seeded with ``k`` consecutive sorted values).
    The same tie-breaking as verl's ``karmarkar_karp``, so both give the same groups.
    """
    if equal_size and len(values) % k:
        raise ValueError(f"{len(values)} items cannot be split into {k} equal-sized groups")
    ordered = sorted((int(v), i) for i, v in enumerate(values))
    step = k if equal_size else 1
    heap: list[_State] = []
    for start in range(0, len(ordered), step):
        seeds = [_Set([(i, v)]) for v, i in ordered[start : start + step]]
        heapq.heappush(heap, _State(seeds + [_Set([]) for _ in range(k - len(seeds))]))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, _State([_Set(a.items + b.items) for a, b in zip(first.sets, reversed(second.sets))]))
    return [[i for i, _ in s.items] for s in heap[0].sets] if heap else [[] for _ in range(k)]


def balanced_partitions(values: Sequence[int], k: int, *, equal_size: bool) -> list[list[int]]:
    """``karmarkar_karp`` groups, each sorted, checked to cover every index once and be non-empty."""
    if len(values) < k:
        raise ValueError(f"cannot split {len(values)} items into {k} non-empty groups")
    groups = [sorted(g) for g in karmarkar_karp(values, k, equal_size=equal_size)]
    assert sorted(i for g in groups for i in g) == list(range(len(values))) and all(groups), groups
    return groups


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches of one rank's batch as index lists, in the order they run."""

    indices: tuple[tuple[int, ...], ...]
    """Per micro-batch, the sample indices it holds."""

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def order(self) -> torch.Tensor:
        """``[n]`` the sample index of each position of the micro-batches' concatenated outputs."""
        return torch.tensor([i for mb in self.indices for i in mb], dtype=torch.long)

    def split(self, batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The micro-batches (each field indexed along dim 0; contiguous runs are views)."""
        out = []
        for mb in self.indices:
            if list(mb) == list(range(mb[0], mb[0] + len(mb))):
                out.append({k: v[mb[0] : mb[0] + len(mb)] for k, v in batch.items()})
            else:
                index = torch.tensor(mb, dtype=torch.long)
                out.append({k: v[index.to(v.device)] for k, v in batch.items()})
        return out

    def restore(self, concatenated: torch.Tensor) -> torch.Tensor:
        """Per-sample outputs concatenated over the micro-batches -> the batch's own order."""
        order = self.order.to(concatenated.device)
        if torch.equal(order, torch.arange(len(order), device=order.device)):
            return concatenated
        out = torch.empty_like(concatenated)
        out[order] = concatenated
        return out


def fixed_micro_batches(n: int, size: int) -> MicroBatchPlan:
    """Consecutive micro-batches of ``size`` samples (the last may be smaller)."""
    if size < 1:
        raise ValueError(f"micro_batch_size={size} must be >= 1")
    return MicroBatchPlan(tuple(tuple(range(i, min(i + size, n))) for i in range(0, n, size)))


def _agree(values: list[int], op: Any, group: Any, device: torch.device) -> list[int]:
    if group is None or dist.get_world_size(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=op, group=group)
    return [int(x) for x in t.tolist()]


def token_budget_micro_batches(
    lengths: Sequence[int],
    max_token_len: int,
    *,
    dp_group: Any = None,
    multiple_of: int = 1,
    budget_key: str = "max_token_len",
    device: Optional[torch.device] = None,
) -> MicroBatchPlan:
    """Micro-batches whose token sums stay within ``max_token_len`` (collective over ``dp_group``).

    ``lengths`` are this rank's per-sample token counts (as the model sees them: alignment padding
    included). The ranks of ``dp_group`` agree on one micro-batch count (the maximum, rounded up to
    ``multiple_of``), raised until every rank's balanced partition fits. ValueError, on every rank
    at once, when a sample is longer than the budget (naming ``budget_key``, the budget and the
    length) or the ranks have too few samples for the count.
    """
    device = device or torch.device("cpu")
    n = len(lengths)
    longest, fewest = _agree([max(lengths, default=0), -n], dist.ReduceOp.MAX, dp_group, device)
    fewest = -fewest
    if longest > max_token_len:
        raise ValueError(
            f"a sample of {longest} tokens is longer than the token budget {budget_key}="
            f"{max_token_len}; raise {budget_key} to at least {longest}"
        )
    step = max(1, multiple_of)
    (count,) = _agree([max(1, min(n, math.ceil(sum(lengths) / max_token_len)))], dist.ReduceOp.MAX, dp_group, device)
    count = -(-count // step) * step
    workloads = attention_workload(lengths)
    while True:
        if count > fewest:
            raise ValueError(
                f"{budget_key}={max_token_len} needs {count} micro-batches on every data-parallel rank "
                f"(a multiple of {step}), but a rank holds only {fewest} samples; raise {budget_key} "
                "or give every rank more samples"
            )
        groups = balanced_partitions(workloads, count, equal_size=False)
        fits = int(all(sum(lengths[i] for i in g) <= max_token_len for g in groups))
        (fits,) = _agree([fits], dist.ReduceOp.MIN, dp_group, device)
        if fits:
            break
        count += step
    groups.sort(key=lambda g: (sum(workloads[i] for i in g), g[0]), reverse=True)
    groups = groups[::2][::-1] + groups[1::2]  # heaviest in the middle, lightest at both ends
    return MicroBatchPlan(tuple(tuple(g) for g in groups))
