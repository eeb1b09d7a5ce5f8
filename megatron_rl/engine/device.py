"""Where a role's tensors live: inputs move to the engine's device, outputs come back to host memory.

The driver holds every batch in host memory and ships it to the ranks by reference
(``megatron_rl.workers.dispatch``); a rank's model lives on its GPU. The move happens in one
place for every caller -- ``MegatronEngine._forward_step`` hands each micro-batch, its model
inputs, the packed-sequence metadata (``PackedSeqParams``' ``cu_seqlens``) and its layout to
``to_device`` right before the model sees them, and ``MegatronEngine.forward`` returns its
per-row results through ``to_host`` -- so no role, test or worker can forget it, and the driver
never receives a CUDA tensor (which would open a CUDA context on its own GPU, or fail to unpickle
on a head node without one). ``MegatronWorker.call`` applies ``to_host`` once more to whatever a
role method returns.

Inputs are prepared on the host (row lengths, packing indices: small integer work whose
``.item()`` / ``.tolist()`` reads would each be a device synchronisation) and moved once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["to_device", "to_host", "tensors_in"]


def _map(obj: Any, fn) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside dicts, lists, tuples and dataclass fields."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            moved = _map(value, fn)
            if moved is not value:
                changed[f.name] = moved
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor on ``device`` (tensors already there are returned as they are)."""
    device = torch.device(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device or (device.index is None and t.device.type == device.type):
            return t
        return t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())

    return _map(obj, move)


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor detached and in host memory (what a worker hands the driver)."""
    return _map(obj, lambda t: t.detach().cpu() if t.device.type != "cpu" else t.detach())


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (dicts, lists, tuples, dataclass fields), in order."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map(obj, keep)
    return found
