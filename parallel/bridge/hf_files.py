"""HF checkpoint files: a validating, slicing safetensors reader and a streaming writer."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Optional

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ST_DTYPES = {  # torch dtype -> safetensors header name
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclasses.dataclass(frozen=True)
class HFTensorInfo:
    """Name, shape and dtype of one exported HF tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


_ST_ITEM_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
}  # every other safetensors dtype is one byte


class HFCheckpointReader:
    """Shape lookups and sliced reads from an HF safetensors checkpoint directory.

    Accepts a single ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
    Opening validates everything up front: missing shard files (all named), truncated or corrupt
    files, and index entries whose file lacks the tensor. Reads go through safetensors' memory
    map and copy only the requested rows/columns; ``bytes_read`` counts them.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {self.path} does not exist")
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                self._where: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object): {exc}") from None
        elif (self.path / SINGLE_FILE).is_file():
            self._where = None
        else:
            raise FileNotFoundError(f"{self.path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        files = sorted(set(self._where.values())) if self._where is not None else [SINGLE_FILE]
        missing = [f for f in files if not (self.path / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index}: {len(missing)} of {len(files)} shard files are missing from {self.path}: {missing}"
            )
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        self._fds: dict[str, int] = {}
        try:
            for f in files:
                try:
                    self._files[f] = self._stack.enter_context(safe_open(str(self.path / f), framework="pt"))
                except SafetensorError as exc:
                    raise ValueError(
                        f"{self.path / f}: truncated or corrupt safetensors file "
                        f"({os.path.getsize(self.path / f)} bytes): {exc}"
                    ) from None
            if self._where is None:
                self._where = {name: SINGLE_FILE for name in self._files[SINGLE_FILE].keys()}
            for f, handle in self._files.items():
                listed = {n for n, g in self._where.items() if g == f}
                absent = sorted(listed - set(handle.keys()))
                if absent:
                    raise ValueError(f"{index}: lists {absent[:5]} in {f}, which does not contain them")
            self._layout = {f: _data_layout(self.path / f) for f in files}
            for f in files:
                fd = os.open(self.path / f, os.O_RDONLY)
                self._stack.callback(os.close, fd)
                self._fds[f] = fd
        except BaseException:
            self._stack.close()
            raise
        self.bytes_read = 0

    def close(self) -> None:
        """Release the memory maps."""
        self._stack.close()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` (no data read)."""
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        """Size of tensor ``name`` in the file (no data read)."""
        dtype = self._files[self._where[name]].get_slice(name).get_dtype()
        return math.prod(self.shape(name)) * _ST_ITEM_BYTES.get(dtype, 1)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of tensor ``name`` in the file (no data read)."""
        return self._layout[self._where[name]][name][0]

    def read(
        self,
        name: str,
        dim: Optional[int] = None,
        start: int = 0,
        stop: Optional[int] = None,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Tensor ``name``, or only indices [start, stop) along ``dim``; into ``out`` when given (a
        contiguous CPU tensor of that shape and the file's dtype), else a new tensor.

        Read with ``pread`` into a tensor that owns its memory: no page of the file is mapped into
        this process (a memory-mapped read would keep every page it touched resident beside the
        copy), and a row range along the first non-trivial dimension is one read straight into
        the result. A slice along a later dimension reads blocks of whole rows (at most
        ``_BLOCK_BYTES`` at a time) and keeps the wanted columns."""
        f = self._where[name]
        dtype, shape, begin = self._layout[f][name]
        shape = list(shape)
        if dim is not None:
            stop = shape[dim] if stop is None else min(stop, shape[dim])
            start = min(max(start, 0), stop)
        want = shape if dim is None else shape[:dim] + [stop - start] + shape[dim + 1 :]
        if out is None:
            out = torch.empty(want, dtype=dtype)
        elif list(out.shape) != want or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(
                f"reading {name!r} {want} {dtype} into a {list(out.shape)} {out.dtype} "
                f"{'contiguous' if out.is_contiguous() else 'strided'} {out.device} tensor"
            )
        if dim is None:
            _pread_into(self._fds[f], out, begin)
        elif all(n == 1 for n in shape[:dim]):
            _pread_into(self._fds[f], out, begin + start * math.prod(shape[dim + 1 :]) * out.element_size())
        else:
            outer, size, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
            flat = out.view(outer, stop - start, inner)
            item = out.element_size()
            per = max(1, _BLOCK_BYTES // max(1, size * inner * item))
            block = torch.empty(min(per, outer), size, inner, dtype=dtype)
            for row in range(0, outer, per):
                n = min(per, outer - row)
                _pread_into(self._fds[f], block[:n], begin + row * size * inner * item)
                flat[row : row + n] = block[:n, start:stop]
            del block
        self.bytes_read += out.numel() * out.element_size()
        return out


_BLOCK_BYTES = 64 * 2**20
"""Largest temporary buffer of a column-sliced read."""
_ST_TORCH = {v: k for k, v in ST_DTYPES.items()}


def _data_layout(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """{tensor name: (dtype, shape, absolute byte offset of its data)} from a safetensors header."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _ST_TORCH:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which this reader does not read")
        out[name] = (_ST_TORCH[entry["dtype"]], tuple(entry["shape"]), 8 + length + int(entry["data_offsets"][0]))
    return out


def _memory(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, as a ctypes view of its own memory (valid while
    ``t`` is alive): Tensor.numpy() would mark its storage non-resizable for good, and the engine's
    offload or a streamed conversion (storage.resize_(0)) could then never release it."""
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill the contiguous tensor ``out`` with the bytes of ``fd`` at ``offset``."""
    if out.numel() == 0:
        return
    view = _memory(out)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"unexpected end of file reading {len(view)} bytes at offset {offset}")
        done += n


class SafetensorsStreamWriter:
    """Writes one safetensors file tensor by tensor: the header is known from the plan."""

    def __init__(self, path: Path, infos: list[HFTensorInfo]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for info in infos:
            if info.dtype not in ST_DTYPES:
                raise ValueError(f"{info.name}: dtype {info.dtype} cannot be stored in safetensors")
            header[info.name] = {
                "dtype": ST_DTYPES[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._pending = list(reversed(infos))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor (name, shape and dtype must match the plan)."""
        expected = self._pending.pop()
        if (name, tuple(tensor.shape), tensor.dtype) != (expected.name, expected.shape, expected.dtype):
            raise RuntimeError(
                f"export yielded {name} {list(tensor.shape)} {tensor.dtype}, planned "
                f"{expected.name} {list(expected.shape)} {expected.dtype}"
            )
        data = tensor.detach().contiguous().cpu()
        if data.numel():
            self._file.write(_memory(data))

    @property
    def done(self) -> bool:
        """Every planned tensor was written."""
        return not self._pending

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


def plan_shards(infos: list[HFTensorInfo], max_shard_bytes: int) -> list[list[HFTensorInfo]]:
    """Split tensors, in order, into files of at most ``max_shard_bytes`` (or one larger tensor)."""
    shards: list[list[HFTensorInfo]] = [[]]
    size = 0
    for info in infos:
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards
