"""Data-parallel dispatch: the step's batch goes to the ranks by reference, once per step.

A worker method declares the fields it reads (``megatron_rl.data.batch.batch_fields``). To
call it on a group of ``dp`` data-parallel replicas, each declared field of the driver's batch
is split into ``dp`` contiguous shards and each shard is put into Ray's object store -- once:
``ShardCache`` remembers the references per (field, dp) for as long as the field holds the same
tensor, so the actor's log-prob pass, the reference pass, the critic and both updates of a step
share the same objects, and a later call ships only the fields that are new (``old_log_probs``,
``advantages`` ...). Every TP/PP/CP rank of replica ``d`` receives the references of shard ``d``
and fetches them itself. Results are collected from one rank per replica (``tp_rank == 0``,
``cp_rank == 0``, the last pipeline stage), concatenated in DP order -- the global batch order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["ShardCache", "split_for_dp", "resolve_shard"]


def split_for_dp(batch: Mapping[str, torch.Tensor], dp: int) -> list[dict[str, torch.Tensor]]:
    """``dp`` contiguous equal shards of a tensor batch (dim 0); ValueError if it does not divide."""
    sizes = {k: int(v.shape[0]) for k, v in batch.items()}
    if not sizes:
        raise ValueError("batch has no tensor fields to dispatch")
    n = next(iter(sizes.values()))
    if any(s != n for s in sizes.values()):
        raise ValueError(f"batch fields disagree on the batch size: {sizes}")
    if n % dp:
        raise ValueError(f"batch of {n} samples is not divisible by the data-parallel size {dp}")
    return [{k: v.chunk(dp)[d].contiguous() for k, v in batch.items()} for d in range(dp)]


class ShardCache:
    """Object-store references of each field's DP shards, put once per (field, dp) and tensor.

    One cache is shared by all worker groups of a trainer. An entry is reused while the batch
    field is the very same tensor object; a field that is set anew (the next step's batch, a
    recomputed value) is put again, and the old references are dropped.
    """

    def __init__(self):
        self._entries: dict[tuple[str, int], tuple[torch.Tensor, list[Any]]] = {}
        self.num_puts = 0

    def refs(self, batch: Any, keys: Sequence[str], dp: int) -> list[dict[str, Any]]:
        """Per DP replica ``d``: ``{field: ObjectRef of shard d}`` for each of ``keys`` in ``batch``."""
        import ray

        present = [k for k in keys if k in batch and torch.is_tensor(batch[k])]
        fresh = [k for k in present if self._entries.get((k, dp), (None,))[0] is not batch[k]]
        if fresh:
            shards = split_for_dp({k: batch[k] for k in present}, dp)  # checks sizes of all shipped fields
            for key in fresh:
                self._entries[(key, dp)] = (batch[key], [ray.put(shards[d][key]) for d in range(dp)])
                self.num_puts += dp
        return [{k: self._entries[(k, dp)][1][d] for k in present} for d in range(dp)]

    def clear(self) -> None:
        """Drop every reference (the objects are freed once no task holds them)."""
        self._entries.clear()


def resolve_shard(shard: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """On a rank: fetch the shard's object references (tensors passed inline stay as they are)."""
    import ray

    refs = {k: v for k, v in shard.items() if isinstance(v, ray.ObjectRef)}
    fetched = dict(zip(refs, ray.get(list(refs.values())))) if refs else {}
    return {k: fetched.get(k, v) for k, v in shard.items()}
