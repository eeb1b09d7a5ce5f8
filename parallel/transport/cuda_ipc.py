"""CUDA IPC transport: each bucket packed into one GPU buffer, shared by handle with engines on that GPU.

For colocated engines in other processes on the sender's GPU (vLLM's workers beside an actor
rank; verl's and NeMo-RL's colocated refit). Per bucket the sender copies every tensor once
into a flat ``uint8`` CUDA buffer (``bucket_meta`` layout, 64-byte aligned), synchronises, and
sends ``{"handle", "layout"}``: ``handle`` is the buffer's
``torch.multiprocessing.reductions.reduce_tensor`` arguments packed as JSON (``pack_handle``:
bytes as base64, dtypes and classes by name, the GPU by UUID), so the message can also travel
as a stream header. The receiver checks the whole message, maps the sender's GPU to its own
device index by UUID, rebuilds the buffer (``rebuild_cuda_tensor``) and returns typed views of
it; a malformed or foreign message raises before any tensor of the bucket is returned.
A handle goes to one receiving process only (``Transport.max_receivers``; a stream with more is
refused when it is built): torch counts a CUDA IPC handle's consumers per handle, so a buffer opened
by two processes is freed under one of them. ``release`` drops the oldest buffer (CUDA's IPC reference counting keeps the memory until the
receivers dropped their views as well); ``abort`` drops all of them.
"""

from __future__ import annotations

import base64
import collections
from typing import Any, Optional

import torch

from parallel.transport.transport_base import Receiver, Sender
from parallel.transport.buckets import ALIGN, Bucket, bucket_meta, nbytes, raw_bytes, unpack_bucket
from parallel.transport.cuda import device_uuid, local_index, require_cuda, visible_uuids

__all__ = ["CudaIpcSender", "CudaIpcReceiver", "pack_handle", "unpack_handle", "HANDLE_FIELDS"]

# The arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor, in order, and how each is packed.
HANDLE_FIELDS = (
    ("tensor_cls", "class"),
    ("tensor_size", "ints"),
    ("tensor_stride", "ints"),
    ("tensor_offset", "int"),
    ("storage_cls", "class"),
    ("dtype", "dtype"),
    ("storage_device", "int"),
    ("storage_handle", "bytes"),
    ("storage_size_bytes", "int"),
    ("storage_offset_bytes", "int"),
    ("requires_grad", "bool"),
    ("ref_counter_handle", "bytes"),
    ("ref_counter_offset", "int"),
    ("event_handle", "bytes"),
    ("event_sync_required", "bool"),
)
_CLASSES = {
    "Tensor": torch.Tensor,
    "Parameter": torch.nn.Parameter,
    "TypedStorage": torch.storage.TypedStorage,
    "UntypedStorage": torch.UntypedStorage,
}


def _pack(kind: str, value: Any) -> Any:
    if kind == "class":
        name = next((n for n, c in _CLASSES.items() if c is value), None)
        if name is None:
            raise ValueError(f"cuda_ipc: cannot pack class {value!r}; allowed: {sorted(_CLASSES)}")
        return name
    if kind == "dtype":
        return str(value).removeprefix("torch.")
    if kind == "bytes":
        return None if value is None else base64.b64encode(bytes(value)).decode("ascii")
    if kind == "ints":
        return [int(v) for v in value]
    return bool(value) if kind == "bool" else int(value)


def _unpack(field: str, kind: str, value: Any) -> Any:
    def bad(allowed: str):
        return ValueError(f"cuda_ipc handle field {field!r}={value!r} is not {allowed}")

    if kind == "class":
        if value not in _CLASSES:
            raise bad(f"one of {sorted(_CLASSES)}")
        return _CLASSES[value]
    if kind == "dtype":
        dtype = getattr(torch, value, None) if isinstance(value, str) else None
        if not isinstance(dtype, torch.dtype):
            raise bad("a torch dtype name")
        return dtype
    if kind == "bytes":
        if value is None:
            return None
        try:
            return base64.b64decode(value, validate=True)
        except (TypeError, ValueError):
            raise bad("base64 bytes") from None
    if kind == "ints":
        if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
            raise bad("a list of non-negative ints")
        return torch.Size(value) if field == "tensor_size" else tuple(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("a bool")
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad("a non-negative int")
    return value


def pack_handle(rebuild_args: tuple, uuid: str) -> dict[str, Any]:
    """``reduce_tensor(cuda_tensor)[1]`` (the rebuild arguments) as JSON, plus the GPU's UUID."""
    if len(rebuild_args) != len(HANDLE_FIELDS):
        raise ValueError(
            f"cuda_ipc: expected the {len(HANDLE_FIELDS)} arguments of rebuild_cuda_tensor, got {len(rebuild_args)}"
        )
    packed = {field: _pack(kind, value) for (field, kind), value in zip(HANDLE_FIELDS, rebuild_args)}
    packed["device_uuid"] = uuid
    return packed


def unpack_handle(packed: Any, visible: list[str]) -> tuple:
    """The rebuild arguments of a packed handle, with the device index this process gives the
    sender's GPU (``visible``: this process's device UUIDs); ``ValueError`` on anything malformed."""
    if not isinstance(packed, dict):
        raise ValueError(f"cuda_ipc handle must be a dict, got {type(packed).__name__}")
    expected = {f for f, _ in HANDLE_FIELDS} | {"device_uuid"}
    if set(packed) != expected:
        raise ValueError(f"cuda_ipc handle fields {sorted(packed)} differ from {sorted(expected)}")
    args = [_unpack(field, kind, packed[field]) for field, kind in HANDLE_FIELDS]
    args[6] = local_index(packed["device_uuid"], visible)  # storage_device, as this process numbers it
    return tuple(args)


def check_layout(layout: Any, buffer_bytes: int) -> None:
    """``ValueError`` unless ``layout`` (``bucket_meta``) describes slots inside a buffer of ``buffer_bytes``."""
    if not isinstance(layout, dict) or not isinstance(layout.get("tensors"), list):
        raise ValueError("cuda_ipc layout must be bucket_meta's dict with a 'tensors' list")
    total = layout.get("total_bytes")
    if not isinstance(total, int) or total > buffer_bytes:
        raise ValueError(f"cuda_ipc layout total_bytes={total!r} exceeds the shared buffer ({buffer_bytes} bytes)")
    for e in layout["tensors"]:
        if not (
            isinstance(e, dict)
            and isinstance(e.get("offset"), int)
            and isinstance(e.get("nbytes"), int)
            and e["offset"] >= 0
            and e["offset"] + e["nbytes"] <= total
        ):
            raise ValueError(f"cuda_ipc layout entry {e!r} does not lie inside total_bytes={total}")


class CudaIpcSender(Sender):
    """Packs each bucket into one CUDA buffer on the tensors' GPU; the message is ``{"handle", "layout"}``."""

    name = "cuda_ipc"

    def __init__(self, cuda_available: Optional[bool] = None):
        require_cuda(self.name, cuda_available)
        self._buffers: collections.deque[torch.Tensor] = collections.deque()

    @classmethod
    def create(cls, *, group=None, shm_dir: Optional[str] = None) -> "CudaIpcSender":
        return cls()

    def send_bucket(self, bucket: Bucket) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        layout = bucket_meta(bucket)  # validates names and dtypes first
        devices = {t.device for _, t in bucket}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(
                f"cuda_ipc sends CUDA tensors of one GPU per bucket; this bucket's are on {sorted(map(str, devices))}"
            )
        device = next(iter(devices))
        flat = torch.empty(max(ALIGN, layout["total_bytes"]), dtype=torch.uint8, device=device)
        for (_, tensor), entry in zip(bucket, layout["tensors"]):
            flat[entry["offset"] : entry["offset"] + entry["nbytes"]].copy_(raw_bytes(tensor))
        torch.cuda.current_stream(device).synchronize()  # the bytes are in place before anyone maps them
        _, args = reduce_tensor(flat)
        self._buffers.append(flat)
        return {"handle": pack_handle(args, device_uuid(device.index)), "layout": layout}

    def release(self) -> None:
        self._buffers.popleft()

    def abort(self) -> None:
        self._buffers.clear()
        torch.cuda.ipc_collect()


class CudaIpcReceiver(Receiver):
    """Rebuilds the shared buffer on this process's index of the sender's GPU; returns views of it."""

    name = "cuda_ipc"

    def __init__(self, cuda_available: Optional[bool] = None):
        require_cuda(self.name, cuda_available)
        self._visible: Optional[list[str]] = None

    @classmethod
    def create(cls, *, group=None) -> "CudaIpcReceiver":
        return cls()

    def receive_bucket(self, message: dict[str, Any]) -> Bucket:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if not isinstance(message, dict) or set(message) != {"handle", "layout"}:
            raise ValueError(f"cuda_ipc message must be {{'handle', 'layout'}}, got {message!r:.200}")
        if self._visible is None:
            self._visible = visible_uuids()
        args = unpack_handle(message["handle"], self._visible)
        check_layout(message["layout"], args[8])
        flat = rebuild_cuda_tensor(*args)
        bucket = unpack_bucket(flat, message["layout"])
        if sum(nbytes(t) for _, t in bucket) > nbytes(flat):
            raise ValueError("cuda_ipc layout describes more bytes than the shared buffer holds")
        return bucket
