"""Buckets as safetensors blobs and files, written from and read into tensor memory directly.

``safetensors.torch.save``/``save_file`` first copy every tensor into a Python ``bytes``
object, and ``load``/``load_file`` copy every tensor out again. The bytes and shm transports
move each bucket once per direction instead: ``write_safetensors`` / ``serialize_safetensors``
copy each tensor once into the file or blob, and ``safetensors_views`` returns views into the
received buffer (the receiver reads them once, into its model). The output is ordinary
safetensors: ``safetensors.torch.load`` / ``load_file`` read it.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import warnings
from typing import Any

import torch

from parallel.transport.buckets import ST_CODES, ST_TORCH, Bucket, NamedTensors, check_dtype, check_pair, host_bytes

__all__ = [
    "safetensors_layout",
    "write_safetensors",
    "serialize_safetensors",
    "safetensors_views",
    "file_bytes",
    "bytes_tensor",
]


def safetensors_layout(bucket: NamedTensors) -> tuple[bytes, list[torch.Tensor]]:
    """The safetensors header (with its 8-byte length prefix) and each tensor's raw bytes in host
    memory (a GPU tensor is copied to the host here, once; a CPU tensor is a view)."""
    header: dict[str, Any] = {}
    raws, offset = [], 0
    for index, (name, tensor) in enumerate(bucket):
        check_pair((name, tensor), index)
        if name in header:
            raise ValueError(f"tensor name {name!r} appears twice in one bucket")
        check_dtype(name, tensor)
        raw = host_bytes(tensor)
        header[name] = {
            "dtype": ST_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + raw.numel()],
        }
        raws.append(raw)
        offset += raw.numel()
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(blob).to_bytes(8, "little") + blob, raws


def write_safetensors(path: str, bucket: NamedTensors) -> int:
    """Write ``bucket`` as a safetensors file with one copy per tensor; returns the file size."""
    head, raws = safetensors_layout(bucket)
    with open(path, "wb") as f:
        f.write(head)
        for raw in raws:
            if raw.numel():
                f.write(_memory(raw))
    return len(head) + sum(r.numel() for r in raws)


def _memory(raw: torch.Tensor) -> memoryview:
    """The bytes of the contiguous host ``uint8`` tensor ``raw`` as a ctypes view of its memory (valid
    while ``raw`` lives). ``Tensor.numpy()`` would mark the storage non-resizable for good: a bucket
    that aliases a parameter (the colocated export) could then never be offloaded (``resize_(0)``)."""
    return memoryview((ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())).cast("B")


def serialize_safetensors(bucket: NamedTensors) -> bytearray:
    """``bucket`` as an in-memory safetensors blob (one copy per tensor)."""
    head, raws = safetensors_layout(bucket)
    blob = bytearray(len(head) + sum(r.numel() for r in raws))
    blob[: len(head)] = head
    out = torch.frombuffer(blob, dtype=torch.uint8)
    offset = len(head)
    for raw in raws:
        out[offset : offset + raw.numel()].copy_(raw)
        offset += raw.numel()
    return blob


def safetensors_views(buf: torch.Tensor) -> Bucket:
    """Tensors of a safetensors blob as views into ``buf`` (a ``uint8`` tensor), without copying."""
    header_len = int.from_bytes(bytes(buf[:8].tolist()), "little")
    header = json.loads(bytes(buf[8 : 8 + header_len].numpy()).decode("utf-8"))
    base = 8 + header_len
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in ST_TORCH:
            raise ValueError(f"tensor {name!r} has safetensors dtype {info['dtype']}; supported: {sorted(ST_TORCH)}")
        begin, end = info["data_offsets"]
        dtype = ST_TORCH[info["dtype"]]
        raw = buf[base + begin : base + end]
        if (base + begin) % dtype.itemsize:  # safetensors aligns its data, but do not rely on it
            raw = raw.clone()
        out.append((name, raw.view(dtype).view(info["shape"])))
    return out


def file_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a ``uint8`` tensor over a private memory map (no read copy on tmpfs).

    The map outlives the file: the writer may unlink it once every reader has mapped it.
    """
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: never written
    return torch.frombuffer(mapped, dtype=torch.uint8)


def bytes_tensor(payload: bytes | bytearray) -> torch.Tensor:
    """``payload`` as a ``uint8`` tensor without a copy (read-only use)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read it
        return torch.frombuffer(payload, dtype=torch.uint8)
