"""HF safetensors -> a sharded Megatron model: every rank reads only the slices it owns."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.bridge.collective import all_gather_object, raise_together
from parallel.bridge.fp8 import open_dequantizing
from parallel.bridge.hf_files import HFCheckpointReader
from parallel.bridge.mtp import num_mtp_layers
from parallel.bridge.rules import ParamShard, WeightMap, full_hf_shapes, qkv_runs, resolve_params


@dataclasses.dataclass
class LoadReport:
    """What ``load_hf_checkpoint`` did on this rank (``deferred``: the reads it left to the caller)."""

    num_params: int
    bytes_read: int
    checkpoint_bytes: int
    deferred: Optional["DeferredReads"] = None


class DeferredReads:
    """The reads of a checked ``load_hf_checkpoint(..., deferred=True)``, one per parameter storage,
    done when the caller asks: ``read(storage_ptr)`` fills the parameters whose storage starts at
    that address (once), ``close()`` closes the files. So a caller that writes the parameters out one
    at a time (the converter's streamed save) holds one of them at a time, never the whole shard."""

    def __init__(self, reader, weight_map: WeightMap):
        self._reader, self._wm = reader, weight_map
        self._pending: dict[int, list[ParamShard]] = {}

    def add(self, p: ParamShard) -> None:
        """Defer ``p``'s read into its parameter's storage."""
        self._pending.setdefault(p.tensor.untyped_storage().data_ptr(), []).append(p)

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._pending

    def read(self, ptr: int) -> bool:
        """Read the parameters deferred at storage address ``ptr``; False when none is (left)."""
        params = self._pending.pop(ptr, None)
        if params is None:
            return False
        with torch.no_grad():
            for p in params:
                _fill(self._reader, p, self._wm)
        return True

    def read_all(self) -> None:
        """Every read still pending (what an eager load would have done)."""
        for ptr in list(self._pending):
            self.read(ptr)

    @property
    def bytes_read(self) -> int:
        """Bytes read from the safetensors so far."""
        return self._reader.bytes_read

    def close(self) -> None:
        """Close the checkpoint's files (reads still pending are dropped)."""
        self._pending.clear()
        self._reader.close()


def _fill(reader: HFCheckpointReader, p: ParamShard, wm: WeightMap) -> None:
    """Read ``p``'s shard into its parameter: in place when the dtypes agree, else through one copy."""
    target = p.tensor.data
    if (
        target.device.type == "cpu"
        and target.is_contiguous()
        and all(reader.dtype(n) == target.dtype for n in p.hf_names)
    ):
        _read_shard(reader, p, wm, out=target)  # straight into the parameter
    else:  # another dtype or device: one shard in flight, then copied
        target.copy_(_read_shard(reader, p, wm))


def _read_shard(
    reader: HFCheckpointReader, p: ParamShard, wm: WeightMap, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """This rank's shard of ``p`` assembled from slices of the HF tensors, read into ``out`` when
    given (contiguous, ``p``'s shape and the file's dtype: each slice lands in place, no copy)."""
    shape, k = tuple(p.tensor.shape), p.shard
    names, t = p.hf_names, p.rule.transform
    if t == "copy":
        if p.partition_dim is None:
            return reader.read(names[0], out=out)
        size = shape[p.partition_dim]
        return reader.read(names[0], p.partition_dim, k * size, (k + 1) * size, out=out)
    if t == "vocab":
        rows = shape[0]
        start, stop = k * rows, min((k + 1) * rows, wm.vocab_size)
        if out is None:
            out = torch.empty(shape, dtype=reader.dtype(names[0]))
        if stop > start:
            reader.read(names[0], 0, start, stop, out=out[: stop - start])
        out[max(stop - start, 0) :] = 0
        return out
    if out is None:
        out = torch.empty(shape, dtype=reader.dtype(names[0]))
    if t == "gate_up":
        half = shape[0] // 2
        for i in (0, 1):
            reader.read(names[i], 0, k * half, (k + 1) * half, out=out[i * half : (i + 1) * half])
        return out
    start = k * shape[0]  # qkv: runs of rows of q, k and v
    for which, hf_row, row, length in qkv_runs(start, start + shape[0], wm):
        reader.read(names[which], 0, hf_row, hf_row + length, out=out[row - start : row - start + length])
    return out


def _check_mtp(reader, weight_map: WeightMap, hf_dir, errors: list[str]) -> list[str]:
    """The checkpoint's multi-token-prediction tensors (checked into ``errors``), which the model
    does not build: rank 0 warns that they are not trained."""
    if weight_map.mtp is None:
        return []
    try:
        count = num_mtp_layers(hf_dir)
    except ValueError as exc:
        errors.append(str(exc))
        return []
    bad = weight_map.mtp.check(reader, count)
    errors.extend(f"{reader.path}: {e}" for e in bad)
    names = weight_map.mtp.names(reader, count)
    if names and not bad and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(
            f"{reader.path}: the checkpoint's {count} multi-token-prediction layer(s) "
            f"(num_nextn_predict_layers={count}, {len(names)} tensors under model.layers."
            f"{weight_map.mtp.num_layers}+) are not trained: the model has no MTP block (MTP training is "
            "not implemented); megatron-rl convert and the trainer's HF export carry them through unchanged",
            stacklevel=3,
        )
    return names


def load_hf_checkpoint(
    chunks: Iterable[torch.nn.Module],
    weight_map: WeightMap,
    hf_dir: str | os.PathLike,
    *,
    mesh=None,
    ignore: Sequence[str] = (),
    deferred: bool = False,
) -> LoadReport:
    """Load HF safetensors from ``hf_dir`` into this rank's model chunks; call on all ranks.

    Each rank reads only the rows/columns of its own shards. A contiguous CPU parameter of the file's
    dtype is read into in place (``pread``, no temporary); others get a temporary shard copied in. ``ignore`` holds regexes of global
    Megatron names to leave untouched (a critic's value head: ``("output_layer\\.",)``).
    Raises on every rank alike: ``FileNotFoundError`` for a missing directory or shard files,
    ``ValueError`` for a corrupt file, an HF tensor whose shape disagrees with the model (both
    shapes named), HF tensors the model needs but the checkpoint lacks, and HF tensors no rule
    accounts for (a checkpoint of another family); tensors the weight map lists as unsupported
    (``WeightMap.unsupported_hf``) are refused with its reason. A family's multi-token-prediction
    layers (``WeightMap.mtp``, ``num_nextn_predict_layers`` in config.json) are checked (complete,
    shaped like the last decoder layer) and left out of the model, with a warning.
    ``deferred``: check everything as above but read nothing; the report's ``deferred``
    (``DeferredReads``, files left open) does the reads when asked, and must be closed.
    """
    chunks = list(chunks)
    errors: list[str] = []
    reader, opened = None, []
    try:
        # FP8 block-quantised checkpoints (DeepSeek-V3's format) are dequantised as they are read.
        reader = open_dequantizing(HFCheckpointReader(hf_dir), hf_dir)
    except (FileNotFoundError, ValueError) as exc:
        opened.append((type(exc), str(exc)))
    raise_together(opened)  # first collective: every rank learns whether all could open it
    later = DeferredReads(reader, weight_map) if deferred else None
    try:
        try:
            params, known = resolve_params(chunks, weight_map, mesh, ignore)
        except ValueError as exc:
            params, known = [], []
            errors.append(str(exc))
        missing: list[str] = []
        with torch.no_grad():
            for p in params:
                known.extend(p.hf_names)
                absent = [n for n in p.hf_names if n not in reader]
                if absent:
                    missing.extend(absent)
                    continue
                try:
                    expected = full_hf_shapes(p.rule, p.num_shards, p.partition_dim, p.tensor.shape, weight_map)
                except ValueError as exc:  # a weight map built for another model
                    errors.append(str(exc))
                    continue
                bad = [(n, reader.shape(n), e) for n, e in zip(p.hf_names, expected) if reader.shape(n) != e]
                if bad:
                    errors.extend(
                        f"HF tensor {n!r} has shape {list(got)} but the model config expects {list(e)} "
                        f"(Megatron parameter {p.global_name!r})"
                        for n, got, e in bad
                    )
                    continue
                if later is not None and p.tensor.numel():
                    later.add(p)
                else:
                    _fill(reader, p, weight_map)
        if missing:
            errors.append(
                f"{reader.path}: the model needs HF tensors the checkpoint lacks: {sorted(set(missing))[:10]}"
                + (f" (and {len(set(missing)) - 10} more)" if len(set(missing)) > 10 else "")
            )
        all_known = set().union(*all_gather_object(sorted(set(known))))
        all_known.update(_check_mtp(reader, weight_map, hf_dir, errors))
        unexpected = sorted(n for n in reader.keys() if n not in all_known and not weight_map.is_optional(n))
        refused: dict[str, list[str]] = {}
        for n in unexpected:
            why = weight_map.unsupported_reason(n)
            if why is not None:
                refused.setdefault(why, []).append(n)
        for why, names in refused.items():
            errors.append(
                f"{reader.path}: {len(names)} HF tensors cannot be loaded into this model ({why}): "
                f"{names[:10]}" + (f" (and {len(names) - 10} more)" if len(names) > 10 else "")
            )
        unexpected = [n for n in unexpected if weight_map.unsupported_reason(n) is None]
        if unexpected:
            errors.append(
                f"{reader.path}: HF tensors that no weight rule of this model accounts for "
                f"(wrong family or config?): {unexpected[:10]}"
                + (f" (and {len(unexpected) - 10} more)" if len(unexpected) > 10 else "")
            )
        raise_together([(ValueError, e) for e in errors])
        total = sum(reader.nbytes(n) for n in reader.keys())
        report = LoadReport(
            num_params=len(params), bytes_read=reader.bytes_read, checkpoint_bytes=total, deferred=later
        )
    except BaseException:
        reader.close()
        raise
    if later is None:
        reader.close()
    return report
