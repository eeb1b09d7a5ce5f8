"""Host-memory offload of an engine's state: parameters, DDP gradient buffers, optimizer state.

What moves is what verl's ``offload_megatron_model_to_cpu`` / ``offload_megatron_optimizer`` move:

* ``params``: every parameter of the model chunks (with Megatron DDP under the distributed
  optimizer, the contiguous ``param_data`` buffers the parameters are views of) and the chunks'
  registered buffers (RoPE frequencies ...);
* ``grads``: DDP's ``grad_data`` buffers (every ``param.main_grad`` is a view of one) and any
  ``.grad`` left on a parameter or a master parameter. As in verl, their values are not kept (every
  training step zeroes them before its first backward): they are released and come back zeroed;
* ``optimizer``: the torch optimizer's state (Adam's ``exp_avg`` / ``exp_avg_sq``, ``step``) and the
  fp32 master copies of 16-bit parameters (``fp32_from_float16_groups`` /
  ``shard_fp32_from_float16_groups``: the parameters the inner optimizer steps).

The unit that moves is a tensor *storage*: views share one, so each storage is copied once into
an ``OffloadStore`` (on CUDA into one page-locked host arena per category: an exact-size host
tensor registered once with ``cudaHostRegister``, as torch's checkpoint stager pins its buffers --
``pin_memory=True`` would take every copy from torch's caching host allocator, which rounds each
block up to a power of two and keeps freed blocks: up to twice the host memory) and its device
allocation is released with
``storage.resize_(0)``; every tensor that views it (a parameter inside a DDP buffer, a ``main_grad``,
an optimizer's reference to a parameter) stays the same Python object and sees the data again
after ``onload`` resizes the storage and copies the bytes back. The code is the same on CPU, where
the compute device and the host are one memory: the module tensors are left empty there too, and
``resident_bytes`` counts what the engine still holds (~0 after a full offload).

A storage is claimed by the first category that reaches it, in the order params -> grads ->
optimizer, so a master parameter that is a view of a model parameter (fp32 training) moves with the
parameters, never twice.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

__all__ = ["CATEGORIES", "KEPT", "OffloadStore", "state_storages", "resident_bytes"]

CATEGORIES = ("params", "grads", "optimizer")
"""What an engine can offload, in claiming order (``megatron.param_offload`` / ``grad_offload`` /
``optimizer_offload``)."""
KEPT = ("params", "optimizer")
"""Categories whose bytes are copied to the host; gradients are released and come back zeroed."""


def _chunks(model: list[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    yield from model


def _ddp_buffers(chunk: torch.nn.Module) -> list:
    """Megatron DDP's param/grad buffers of a chunk (lists on the DDP wrapper; a bare module's
    ``buffers`` is ``nn.Module.buffers``, a method)."""
    out = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, (list, tuple)):
            out.extend(value)
    return out


def _inner_optimizers(optimizer: Any) -> list:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _tensors(model: list[torch.nn.Module], optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """Every tensor of the engine's state, by category (views included; storages deduplicated later)."""
    out: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES}
    for chunk in _chunks(model):
        for buf in _ddp_buffers(chunk):
            if getattr(buf, "param_data", None) is not None:
                out["params"].append(buf.param_data)
            if getattr(buf, "grad_data", None) is not None:
                out["grads"].append(buf.grad_data)
        for param in chunk.parameters():
            out["params"].append(param.data)
            for attr in ("main_grad", "grad"):
                grad = getattr(param, attr, None)
                if torch.is_tensor(grad):
                    out["grads"].append(grad)
        # module.buffers() (not DDP's ``buffers`` list): RoPE inv_freq and friends
        out["params"].extend(b for b in torch.nn.Module.buffers(chunk) if torch.is_tensor(b))
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                out["optimizer"].append(param.data)  # fp32 masters (or the model params: then claimed above)
                if torch.is_tensor(param.grad):
                    out["grads"].append(param.grad)
        for state in inner.state.values():
            out["optimizer"].extend(v for v in state.values() if torch.is_tensor(v))
    return out


def state_storages(model: list[torch.nn.Module], optimizer: Any) -> dict[str, list[torch.UntypedStorage]]:
    """The distinct storages behind the engine's state, by category (first category claims)."""
    seen: set[int] = set()
    out: dict[str, list[torch.UntypedStorage]] = {c: [] for c in CATEGORIES}
    for category, tensors in _tensors(model, optimizer).items():
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage._cdata  # the StorageImpl's address: one per storage, shared by its views
            if key in seen:
                continue
            seen.add(key)
            out[category].append(storage)
    return out


def resident_bytes(
    model: list[torch.nn.Module], optimizer: Any, device: Optional[torch.device] = None
) -> dict[str, int]:
    """Bytes of storage the engine's state holds, by category (on ``device`` only, when given)."""
    out = {}
    for category, storages in state_storages(model, optimizer).items():
        out[category] = sum(
            s.nbytes() for s in storages if device is None or s.device.type == torch.device(device).type
        )
    return out


class OffloadStore:
    """Host copies of the storages an engine offloaded, and the way back.

    ``offload(model, optimizer, categories)`` copies every storage of those categories that is not
    already offloaded into host memory (pinned when CUDA is present; gradients are not copied) and
    releases it (``resize_(0)``); ``onload(categories)`` re-allocates each one on its device and
    copies the bytes back (gradients: zeros). Both return the device bytes released / restored.
    """

    def __init__(self) -> None:
        # category -> [(device storage, its bytes, host copy or None for gradients)]
        self._held: dict[str, list[tuple[torch.UntypedStorage, int, Optional[torch.Tensor]]]] = {
            c: [] for c in CATEGORIES
        }
        self._pinned: dict[str, torch.Tensor] = {}  # category -> its registered host arena (CUDA only)

    def __del__(self) -> None:
        # A registered arena must be unregistered before its memory goes back to the allocator (a later
        # registration overlapping the stale one would fail).
        for arena in getattr(self, "_pinned", {}).values():
            try:
                _unpin(arena)
            except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
                pass

    def offloaded(self, category: str) -> bool:
        """True while ``category`` is held here (its device storages are empty)."""
        return bool(self._held[category])

    def held_bytes(self) -> dict[str, int]:
        """Host bytes held per category (gradients are released, not copied: 0)."""
        return {c: sum(h.numel() for _, _, h in held if h is not None) for c, held in self._held.items()}

    def offload(self, model: list[torch.nn.Module], optimizer: Any, categories: Iterable[str]) -> int:
        """Move ``categories`` of the engine's state to host memory; the bytes moved."""
        categories = _check(categories)
        storages = state_storages(model, optimizer)
        fixed = [
            (c, s.nbytes())
            for c in categories
            if not self._held[c]
            for s in storages[c]
            if s.nbytes() and not s.resizable()
        ]
        if fixed:  # refuse before anything moved (a storage that cannot be released would stay taken)
            raise RuntimeError(
                f"cannot offload {fixed[0][0]}: {len(fixed)} storage(s) of it ({fixed[0][1]} bytes first) are not "
                "resizable: a numpy / Ray object-store buffer (torch.from_numpy, ray.get of a tensor) now backs them; "
                "whatever replaced the engine's own storage must copy into it instead"
            )
        pin = torch.cuda.is_available()
        moved = 0
        for category in categories:
            if self._held[category]:
                continue  # already offloaded: its storages are empty
            live = [(storage, storage.nbytes()) for storage in storages[category] if storage.nbytes()]
            hosts: list[Optional[torch.Tensor]] = [None] * len(live)
            if category in KEPT and live:
                hosts = self._host_views(category, [n for _, n in live], pin)
                for (storage, _), host in zip(live, hosts):
                    host.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), non_blocking=pin)
            for (storage, n), host in zip(live, hosts):
                self._held[category].append((storage, n, host))
                moved += n
        if pin:
            torch.cuda.synchronize()  # the copies must land before the device memory is reused
        for category in categories:
            for storage, _n, _host in self._held[category]:
                storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        return moved

    def onload(self, categories: Iterable[str]) -> int:
        """Bring ``categories`` back to their devices; the bytes moved."""
        moved = 0
        pin = torch.cuda.is_available()
        for category in _check(categories):
            for storage, n, host in self._held[category]:
                storage.resize_(n)
                if host is None:  # a gradient buffer: back zeroed
                    torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
                else:
                    torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host, non_blocking=pin)
                moved += n
        if pin:
            torch.cuda.synchronize()  # the copies have landed: the host arenas may go
        for category in _check(categories):
            arena = self._pinned.pop(category, None)
            if arena is not None:
                _unpin(arena)
            self._held[category] = []
        return moved

    def _host_views(self, category: str, sizes: list[int], pin: bool) -> list[torch.Tensor]:
        """One host arena for ``sizes`` bytes (each slot 64-byte aligned), page-locked when ``pin``;
        a ``uint8`` view of it per size."""
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        arena = torch.empty(total, dtype=torch.uint8, device="cpu")
        if pin:
            error = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), total, 1))  # 1: portable
            if error:
                raise RuntimeError(f"offload: cudaHostRegister of {total} host bytes failed with cudaError {error}")
            self._pinned[category] = arena
        return [arena[o : o + n] for o, n in zip(offsets, sizes)]


_ALIGN = 64
"""Bytes each storage's slot in a host arena is aligned to."""


def _unpin(host: torch.Tensor) -> None:
    """Undo ``OffloadStore._host_views``' registration (before the arena's memory is freed)."""
    error = int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))
    if error:
        raise RuntimeError(f"offload: cudaHostUnregister failed with cudaError {error}")


def _check(categories: Iterable[str]) -> list[str]:
    categories = list(categories)
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"offload categories {unknown} are not allowed; choose from {list(CATEGORIES)}")
    return categories
