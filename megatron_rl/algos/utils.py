"""Masked statistics and input checks shared by every algorithm function.

Semantics follow verl's ``verl.utils.torch_functional`` so results match bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megatron_rl.utils.config_access import cfg_get

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
    "check_same_shape",
    "check_finite",
    "cfg_get",
    "group_ids",
    "expand_as_nested",
    "NestedShapeError",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; NaN/inf outside the mask do not leak in."""
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(dim=axis) if axis is not None else (valid * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean over masked elements; an empty mask gives 0, never NaN."""
    total = masked_sum(values, mask, axis)
    count = mask.sum(dim=axis) if axis is not None else mask.sum()
    return total / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked elements (Bessel-corrected by default)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element; at least two are needed")
        if count == 1:
            raise ValueError("masked_var: the mask selects one element; the unbiased variance needs two")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean / unit variance over the mask (keep the mean if ``shift_mean=False``)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of ``softmax(logits)`` over the last dim: ``logsumexp - sum(p * logits)``."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming every tensor and its shape unless all non-None shapes agree."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        desc = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {desc}")


def check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming the sample (row) indices holding NaN/inf values inside ``mask``."""
    bad = ~torch.isfinite(tensor)
    if mask is not None:
        bad = bad & mask.bool()
    if bad.any():
        rows = bad.reshape(bad.shape[0], -1).any(dim=-1).nonzero().flatten().tolist() if bad.dim() else [0]
        shown = rows[:20]
        more = f" (and {len(rows) - len(shown)} more)" if len(rows) > len(shown) else ""
        raise ValueError(f"{name} has non-finite values in samples {shown}{more}")


def group_ids(index: Any, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map group labels (``uid`` strings, ints, numpy array or tensor) to dense ids 0..G-1.

    Returns ``(ids: [bs] int64, num_groups)``. For labels given as a list or numpy array, ids
    follow first appearance order; for a tensor, sorted label order (``torch.unique``).

    Labels are compared as Python objects (hash and ``==``, like a dict). A 1-D numpy array is
    first split into runs of equal consecutive labels (one vectorised ``!=``): verl lays a
    group's samples out next to each other (``repeat(interleave=True)``), so only one label
    per run goes through the dict, which makes 65,536 uid strings ~7x cheaper to factorise.
    A label that recurs in a later run still maps to its first id.
    """
    if isinstance(index, torch.Tensor):
        uniq, inverse = torch.unique(index, return_inverse=True)
        return inverse.to(device=device, dtype=torch.long), int(uniq.numel())
    mapping: dict[Any, int] = {}
    if isinstance(index, np.ndarray) and index.ndim == 1 and index.size > 1:
        starts = _run_starts(index)
        if starts is not None:
            run_labels = index[starts].tolist()
            run_ids = np.fromiter(
                (mapping.setdefault(label, len(mapping)) for label in run_labels), dtype=np.int64, count=len(run_labels)
            )
            ids = np.repeat(run_ids, np.diff(starts, append=index.size))  # [bs]
            return torch.from_numpy(ids).to(device=device), len(mapping)
    labels = index.tolist() if hasattr(index, "tolist") else list(index)
    ids = np.fromiter((mapping.setdefault(label, len(mapping)) for label in labels), dtype=np.int64, count=len(labels))
    return torch.from_numpy(ids).to(device=device), len(mapping)


def _run_starts(index: np.ndarray) -> np.ndarray | None:
    """Positions where a new run of equal consecutive labels starts (always 0), or None when the
    labels do not compare element-wise to booleans (then the dict path decides)."""
    try:
        changed = index[1:] != index[:-1]  # [bs - 1]
    except (TypeError, ValueError):
        return None
    if not isinstance(changed, np.ndarray) or changed.dtype != np.bool_ or changed.shape != (index.size - 1,):
        return None
    return np.concatenate(([0], np.flatnonzero(changed) + 1))


class NestedShapeError(ValueError, AssertionError):
    """``expand_as_nested`` got tensors of the wrong kind or shape: a ValueError, and an AssertionError
    as verl's ``assert``s raised (its tests expect that type)."""


def expand_as_nested(tensor: torch.Tensor, nested_tensor: torch.Tensor) -> torch.Tensor:
    """One value per row ``tensor [b]`` repeated over each row of the jagged ``nested_tensor [b, j]``:
    a nested tensor with ``nested_tensor``'s offsets (verl's ``expand_as_nested``, e.g. a per-sample
    temperature over packed tokens)."""
    if not getattr(nested_tensor, "is_nested", False):
        raise NestedShapeError("expand_as_nested: nested_tensor must be a nested (jagged) tensor")
    if tensor.dim() != 1:
        raise NestedShapeError(f"expand_as_nested: tensor must be 1-D [batch], got shape {tuple(tensor.shape)}")
    if tensor.shape[0] != nested_tensor.size(0):
        raise NestedShapeError(
            f"expand_as_nested: the batch sizes differ: tensor has {tensor.shape[0]} rows, "
            f"nested_tensor {nested_tensor.size(0)}"
        )
    if nested_tensor.dim() != 2:
        raise NestedShapeError(
            f"expand_as_nested: nested_tensor must be [batch, jagged], got {nested_tensor.dim()} dims"
        )
    offsets = nested_tensor.offsets()
    values = torch.repeat_interleave(tensor, offsets.diff(), dim=0)
    return torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)
