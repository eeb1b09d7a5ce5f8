"""The batch between the stages of a step: one typed container with verl's field names.

``Batch`` holds a step's samples the way verl's ``DataProto`` does -- tensor fields
``[B, ...]`` in a ``TensorDict`` (``batch``), per-sample Python values as numpy object arrays
(``non_tensor_batch``: ``uid``, ``data_source``, ``ground_truth``, ...) and step-level values
(``meta_info``) -- and answers the same calls (``select``, ``select_idxs``, ``union``,
``chunk``, ``concat``, ``repeat``, ``pop``, ``len``). It also reads like a mapping from field
name to value (``batch["responses"]``, ``"values" in batch``), which is how the trainer uses it.

Tensor fields (verl's names)::

    prompts [B, P]  responses [B, R]  response_mask [B, R]  input_ids [B, P+R]
    attention_mask [B, P+R]  position_ids [B, P+R]  rollout_log_probs [B, R]
    old_log_probs [B, R]  ref_log_prob [B, R]  values [B, R]  token_level_scores [B, R]
    token_level_rewards [B, R]  advantages [B, R]  returns [B, R]  rollout_is_weights [B, R]
    reward_baselines [B]  teacher_log_probs [B, R]  teacher_topk_log_probs / teacher_topk_ids [B, R, k]

``BatchFields`` + ``batch_fields(...)``: a worker method declares, next to its definition, the
fields it reads (required and optional); the decorator checks them on every call and the worker
group ships exactly those fields to the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Optional

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["Batch", "DataProto", "BatchFields", "batch_fields", "fields_of", "check_fields"]


def _object_array(values: Any) -> np.ndarray:
    """Per-sample values as a 1-D numpy object array (strings, dicts, lists stay whole)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


class Batch:
    """Samples of a step: tensor fields (``batch``), per-sample values (``non_tensor_batch``), ``meta_info``.

    Args:
        batch: tensor fields, all with the same leading batch size.
        non_tensor_batch: per-sample values (lists / arrays of that length).
        meta_info: step-level values (not per sample).
    """

    def __init__(
        self,
        batch: Optional[Mapping[str, torch.Tensor] | TensorDict] = None,
        non_tensor_batch: Optional[Mapping[str, Sequence]] = None,
        meta_info: Optional[dict] = None,
    ):
        tensors = dict(batch.items()) if batch is not None else {}
        sizes = {k: int(v.shape[0]) for k, v in tensors.items()}
        non_tensors = {k: _object_array(v) for k, v in (non_tensor_batch or {}).items()}
        sizes.update({k: len(v) for k, v in non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields disagree on the batch size: {sizes}")
        size = next(iter(sizes.values()), 0)
        self.batch = TensorDict(tensors, batch_size=[size])
        self.non_tensor_batch: dict[str, np.ndarray] = non_tensors
        self.meta_info: dict[str, Any] = dict(meta_info or {})

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        tensors: Optional[Mapping[str, torch.Tensor]] = None,
        non_tensors: Optional[Mapping[str, Sequence]] = None,
        meta_info: Optional[dict] = None,
    ) -> "Batch":
        """verl's ``DataProto.from_dict``."""
        return cls(tensors, non_tensors, meta_info)

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: Optional[dict] = None) -> "Batch":
        """Tensors go to ``batch``, everything else (lists, arrays) to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if torch.is_tensor(v)}
        return cls(tensors, {k: v for k, v in data.items() if k not in tensors}, meta_info)

    # -- mapping surface ----------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.batch.batch_size[0]) if self.batch.batch_size else 0

    def __contains__(self, key: str) -> bool:
        return key in self.batch.keys() or key in self.non_tensor_batch

    def keys(self) -> list[str]:
        """Every field name: tensor fields first, then per-sample values."""
        return [*self.batch.keys(), *self.non_tensor_batch]

    def __getitem__(self, key: Any) -> Any:
        """A field by name (a tensor, or a numpy object array); rows for an int, slice, list or tensor."""
        if isinstance(key, str):
            if key in self.batch.keys():
                return self.batch[key]
            if key in self.non_tensor_batch:
                return self.non_tensor_batch[key]
            raise KeyError(f"batch has no field {key!r}; it has {sorted(self.keys())}")
        if isinstance(key, int):
            key = [key]
        if isinstance(key, slice):
            key = list(range(len(self)))[key]
        return self.select_idxs(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: str, value: Any) -> None:
        """Set a field: a tensor goes to ``batch``, per-sample values to ``non_tensor_batch``."""
        if torch.is_tensor(value):
            self.non_tensor_batch.pop(key, None)
            if len(self.batch.keys()) == 0 and not self.non_tensor_batch:
                self.batch = TensorDict({}, batch_size=[int(value.shape[0])])
            self.batch[key] = value
            return
        values = _object_array(value)
        if len(values) != len(self) and (len(self.batch.keys()) or self.non_tensor_batch):
            raise ValueError(f"field {key!r} has {len(values)} values for a batch of {len(self)}")
        if key in self.batch.keys():
            del self.batch[key]
        self.non_tensor_batch[key] = values
        if not len(self.batch.keys()) and self.batch.batch_size[0] != len(values):
            self.batch = TensorDict({}, batch_size=[len(values)])

    def tensors(self, keys: Optional[Sequence[str]] = None) -> dict[str, torch.Tensor]:
        """The tensor fields (only ``keys`` that exist, when given) as a plain dict."""
        names = list(self.batch.keys()) if keys is None else [k for k in keys if k in self.batch.keys()]
        return {k: self.batch[k] for k in names}

    # -- DataProto's surface ----------------------------------------------------------------
    def select(
        self,
        batch_keys: Optional[Sequence[str]] = None,
        non_tensor_batch_keys: Optional[Sequence[str]] = None,
        meta_info_keys: Optional[Sequence[str]] = None,
    ) -> "Batch":
        """A batch with only the named fields (None = all of that kind)."""
        tensors = self.tensors(batch_keys)
        names = self.non_tensor_batch if non_tensor_batch_keys is None else non_tensor_batch_keys
        non_tensors = {k: self.non_tensor_batch[k] for k in names if k in self.non_tensor_batch}
        meta = self.meta_info if meta_info_keys is None else {k: self.meta_info[k] for k in meta_info_keys}
        return Batch(tensors, non_tensors, meta)

    def select_idxs(self, idxs: Sequence[int] | torch.Tensor | np.ndarray) -> "Batch":
        """Rows ``idxs`` (ints, or a boolean mask) of every field."""
        idx = torch.as_tensor(np.asarray(idxs) if not torch.is_tensor(idxs) else idxs)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.long()
        rows = idx.tolist()
        tensors = {k: v.index_select(0, idx) for k, v in self.tensors().items()}
        return Batch(tensors, {k: v[rows] for k, v in self.non_tensor_batch.items()}, self.meta_info)

    def reorder(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Permute the rows in place (verl's ``reorder``)."""
        other = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = other.batch, other.non_tensor_batch

    def union(self, other: "Batch") -> "Batch":
        """Fields of both (same rows); a field in both must hold equal values."""
        if len(other) != len(self):
            raise ValueError(f"union of batches of {len(self)} and {len(other)} samples")
        for key in other.keys():
            if key in self and not _equal(self[key], other[key]):
                raise ValueError(f"union: field {key!r} differs between the two batches")
        return Batch(
            {**self.tensors(), **other.tensors()},
            {**self.non_tensor_batch, **other.non_tensor_batch},
            {**self.meta_info, **other.meta_info},
        )

    def pop(self, batch_keys: Sequence[str] = (), non_tensor_batch_keys: Sequence[str] = ()) -> "Batch":
        """Remove the named fields and return them as a batch."""
        out = self.select(list(batch_keys), list(non_tensor_batch_keys), [])
        for k in batch_keys:
            del self.batch[k]
        for k in non_tensor_batch_keys:
            self.non_tensor_batch.pop(k)
        return out

    def chunk(self, chunks: int) -> list["Batch"]:
        """``chunks`` contiguous equal parts (ValueError if the size does not divide)."""
        if len(self) % chunks:
            raise ValueError(f"batch of {len(self)} samples is not divisible into {chunks} chunks")
        size = len(self) // chunks
        return [self.select_idxs(range(i * size, (i + 1) * size)) for i in range(chunks)]

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Batches with the same fields (and tensor widths) stacked along the samples."""
        first = batches[0]
        for other in batches[1:]:
            if set(other.keys()) != set(first.keys()):
                raise ValueError(f"concat: fields differ: {sorted(first.keys())} vs {sorted(other.keys())}")
        tensors = {k: torch.cat([b.batch[k] for b in batches]) for k in first.batch.keys()}
        non_tensors = {k: np.concatenate([b.non_tensor_batch[k] for b in batches]) for k in first.non_tensor_batch}
        return Batch(tensors, non_tensors, first.meta_info)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "Batch":
        """Every sample ``repeat_times`` times: ``a a b b`` (interleave) or ``a b a b``."""
        n = len(self)
        idx = torch.arange(n).repeat_interleave(repeat_times) if interleave else torch.arange(n).repeat(repeat_times)
        return self.select_idxs(idx)

    def to(self, device: torch.device | str) -> "Batch":
        """Tensor fields moved to ``device``."""
        return Batch({k: v.to(device) for k, v in self.tensors().items()}, self.non_tensor_batch, self.meta_info)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors().items()}
        return f"Batch(size={len(self)}, tensors={shapes}, non_tensors={sorted(self.non_tensor_batch)})"


DataProto = Batch
"""verl's name for the container."""


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)))


# ----------------------------------------------------------------------------- field specs
@dataclasses.dataclass(frozen=True)
class BatchFields:
    """The batch fields a worker method reads: ``required`` ones must be present."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()

    @property
    def all(self) -> tuple[str, ...]:
        """Required then optional: what a dispatcher ships (the optional ones when present)."""
        return self.required + self.optional


def check_fields(batch: Any, fields: BatchFields) -> None:
    """ValueError naming the missing required fields and the ones the batch has."""
    missing = [k for k in fields.required if k not in batch]
    if missing:
        raise ValueError(f"batch is missing field(s) {missing}; it has {sorted(batch.keys())}")


def batch_fields(*required: str, optional: Sequence[str] = ()) -> Callable:
    """Declare the fields a method ``fn(self, batch, ...)`` reads; checked on every call.

    The declaration is ``fields_of(fn)``: worker groups ship exactly these fields of the step's
    batch to the ranks (the optional ones only when the batch has them).
    """
    spec = BatchFields(tuple(required), tuple(optional))

    def decorator(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(self, batch, *args, **kwargs):
            check_fields(batch, spec)
            return fn(self, batch, *args, **kwargs)

        wrapper.batch_fields = spec
        return wrapper

    return decorator


def fields_of(method: Callable) -> BatchFields:
    """The ``BatchFields`` a method declared with ``batch_fields`` (TypeError if it declared none)."""
    spec = getattr(method, "batch_fields", None)
    if spec is None:
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} declares no batch fields (use @batch_fields)")
    return spec
