"""Buckets of HF-named tensors: regrouping a stream under a byte bound, and one flat layout per bucket.

A *bucket* is a list of ``(hf_name, tensor)`` pairs that travels as one unit. The bridge's
export already yields bucket-sized runs; ``bucket_named_tensors`` re-bounds any stream (pairs
or buckets) for the transport, lazily. ``bucket_meta`` / ``unpack_bucket`` describe a bucket
as one flat ``uint8`` buffer (each tensor 64-byte aligned) -- the layout the broadcast
transport receives into.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch

from parallel.bridge.hf_files import ST_DTYPES

__all__ = [
    "NamedTensors",
    "Bucket",
    "ST_CODES",
    "ST_TORCH",
    "check_pair",
    "check_dtype",
    "nbytes",
    "bucket_named_tensors",
    "bucket_meta",
    "unpack_bucket",
    "raw_bytes",
    "host_bytes",
]

NamedTensors = Sequence[tuple[str, torch.Tensor]]
Bucket = list[tuple[str, torch.Tensor]]
ALIGN = 64  # byte alignment of each tensor inside a flat bucket buffer (typed views need it)
ST_CODES = dict(ST_DTYPES)  # torch dtype -> safetensors dtype code, the names on every wire here
ST_TORCH = {code: dtype for dtype, code in ST_CODES.items()}


def check_pair(item: Any, index: int) -> tuple[str, torch.Tensor]:
    """``item`` if it is a ``(hf_name: str, tensor)`` pair, else ``TypeError`` naming its position."""
    ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
    if not ok:
        raise TypeError(
            f"weights item {index} must be a (hf_name: str, tensor: torch.Tensor) pair, got {type(item).__name__}"
        )
    return item


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    """``ValueError`` unless the tensor's dtype has a safetensors code."""
    if tensor.dtype not in ST_CODES:
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; supported: {sorted(map(str, ST_CODES))}")


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements."""
    return tensor.numel() * tensor.element_size()


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's data as a flat ``uint8`` view (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``raw_bytes`` in host memory: a GPU (any non-CPU) tensor is copied to the host once, a CPU
    tensor is not copied. The transports that write files, blobs or gloo messages read host memory
    (``Tensor.numpy()`` of a CUDA export tensor is a TypeError)."""
    raw = raw_bytes(tensor)
    return raw if raw.device.type == "cpu" else raw.cpu()


def bucket_named_tensors(weights: Iterable[Any], bucket_bytes: int) -> Iterator[Bucket]:
    """Regroup a stream of HF-named tensors into buckets of at most ``bucket_bytes`` bytes.

    ``weights`` is either a flat iterable of ``(hf_name, tensor)`` pairs or an iterable of
    buckets (lists of pairs, e.g. the bridge's ``HFExporter.iter_buckets``); both are streamed,
    never materialised. An input bucket that fits the bound passes through as it is (never
    merged with its neighbours, so the source may build the next bucket only once this one is
    dropped); a larger one is split. A single tensor larger than ``bucket_bytes`` travels alone.
    No reference to a bucket is kept once it has been yielded.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    bucket: Bucket = []
    size = 0
    index = 0
    weights = iter(weights)
    while True:
        item = next(weights, None)
        if item is None:
            break
        if isinstance(item, list) and item and isinstance(item[0], str):  # ["name", tensor]: not a bucket
            check_pair(item, index)
        if isinstance(item, list):  # a bucket: flush the pairs before it, then pass it on or split it
            pairs = [check_pair(p, index + i) for i, p in enumerate(item)]
            index += len(pairs)
            del item
            if bucket:
                yield bucket
                bucket, size = [], 0
            if sum(nbytes(t) for _, t in pairs) <= bucket_bytes:
                if pairs:
                    yield pairs
                del pairs
                continue
            for pair in pairs:
                n = nbytes(pair[1])
                if bucket and size + n > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append(pair)
                size += n
            del pairs, pair
            if bucket:
                yield bucket
                bucket, size = [], 0
            continue
        name, tensor = check_pair(item, index)
        index += 1
        del item
        n = nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        del tensor
        size += n
    if bucket:
        yield bucket


def bucket_meta(bucket: NamedTensors) -> dict[str, Any]:
    """Layout of ``bucket`` in one flat receive buffer: names, dtypes, shapes, byte offsets (JSON)."""
    entries, offset = [], 0
    for index, (name, tensor) in enumerate(bucket):
        check_pair((name, tensor), index)
        check_dtype(name, tensor)
        n = nbytes(tensor)
        entries.append(
            {"name": name, "dtype": ST_CODES[tensor.dtype], "shape": list(tensor.shape), "offset": offset, "nbytes": n}
        )
        offset += -(-n // ALIGN) * ALIGN
    return {"tensors": entries, "total_bytes": offset}


def unpack_bucket(flat: torch.Tensor, meta: dict[str, Any]) -> Bucket:
    """Views into ``flat`` (``uint8``, laid out by ``bucket_meta``) for each tensor of ``meta`` (no copy)."""
    out = []
    for entry in meta["tensors"]:
        raw = flat[entry["offset"] : entry["offset"] + entry["nbytes"]]
        out.append((entry["name"], raw.view(ST_TORCH[entry["dtype"]]).view(entry["shape"])))
    return out
