"""FP8 block-quantised HF checkpoints (DeepSeek-V3's published format), read as full precision.

DeepSeek-V3 / R1 (and GLM-4.5-FP8) ship their linear weights as ``float8_e4m3fn`` with one
float32 ``<name>_scale_inv`` per ``weight_block_size`` block (128 x 128) and
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``
in config.json. The dequantised weight is ``weight.float() * scale_inv`` broadcast over each
block (blocks at the right/bottom edge may be partial). ``FP8DequantReader`` wraps an
``HFCheckpointReader`` so the loader sees plain tensors: the ``*_scale_inv`` tensors disappear from
``keys()``, and a sliced ``read`` dequantises only the rows/columns asked for. Every FP8 weight's
scale is checked (present, float, the right block-grid shape) when the reader opens, before
anything is loaded. ``quantize_fp8_blocks`` is the inverse used by an FP8 export.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["FP8DequantReader", "fp8_block_size", "dequantize_fp8_blocks", "quantize_fp8_blocks",
           "open_dequantizing", "SCALE_SUFFIX", "FP8_MAX"]

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(hf_config: Any) -> Optional[tuple[int, int]]:
    """``weight_block_size`` of an FP8 block-quantised config (dict or transformers config), else None.

    ValueError for a ``quantization_config`` this reader cannot dequantise (named, with what is allowed).
    """
    qc = hf_config.get("quantization_config") if isinstance(hf_config, dict) else \
        getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"HF config quantization_config.quant_method={method!r} is not supported; allowed: 'fp8' "
                         "(DeepSeek-V3's block-quantised format) or no quantization_config")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"HF config quantization_config.fmt={qc['fmt']!r} is not supported; allowed: 'e4m3'")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"HF config quantization_config.weight_block_size={block!r} is not supported; allowed: "
                         "two positive ints (DeepSeek-V3: [128, 128])")
    return int(block[0]), int(block[1])


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *,
                          row0: int = 0, col0: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight`` (FP8, possibly a slice starting at row ``row0`` / column ``col0`` of the full
    tensor) times the float32 ``scale_inv`` of its blocks, in ``dtype``."""
    rows = (torch.arange(weight.shape[0]) + row0) // block[0]
    cols = (torch.arange(weight.shape[1]) + col0) // block[1]
    scale = scale_inv.float()[rows][:, cols]
    return (weight.float() * scale).to(dtype)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 scale_inv)``: each block scaled so its largest |value| is 448
    (DeepSeek's quantiser); an all-zero block gets scale 1."""
    w = weight.float()
    gr, gc = _grid(tuple(w.shape), block)
    padded = torch.zeros(gr * block[0], gc * block[1])
    padded[: w.shape[0], : w.shape[1]] = w
    amax = padded.reshape(gr, block[0], gc, block[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class FP8DequantReader:
    """An ``HFCheckpointReader`` over an FP8 block-quantised checkpoint that yields dequantised tensors.

    ``keys()`` hides the ``*_scale_inv`` tensors; ``read`` / ``shape`` / ``nbytes`` of an FP8
    weight give its dequantised float32 slice, its shape, and its bytes on disk (weight + scale).
    Opening raises ValueError naming every FP8 weight whose scale is missing or mis-shaped and
    every scale without its weight.
    """

    def __init__(self, reader, block: tuple[int, int], dtype: torch.dtype = torch.float32):
        self._reader, self.block, self.out_dtype = reader, block, dtype
        names = set(reader.keys())
        fp8 = {n for n in names if reader.dtype(n) in _FP8}
        errors = []
        for n in sorted(fp8):
            scale = n + SCALE_SUFFIX
            shape = tuple(reader.shape(n))
            if len(shape) != 2:
                errors.append(f"{n!r} is FP8 with shape {list(shape)}; block quantisation needs a 2-D weight")
            elif scale not in names:
                errors.append(f"{n!r} is FP8 but {scale!r} is missing")
            elif tuple(reader.shape(scale)) != _grid(shape, block):
                errors.append(f"{scale!r} has shape {list(reader.shape(scale))}; {n!r} {list(shape)} in "
                              f"{list(block)} blocks needs {list(_grid(shape, block))}")
            elif reader.dtype(scale) not in (torch.float32, torch.bfloat16, torch.float16):
                errors.append(f"{scale!r} has dtype {reader.dtype(scale)}; a float scale is needed")
        orphans = sorted(n for n in names if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in fp8)
        errors.extend(f"{n!r} has no FP8 weight {n[: -len(SCALE_SUFFIX)]!r}" for n in orphans)
        if errors:
            raise ValueError(f"{reader.path}: FP8 block-quantised checkpoint (weight_block_size={list(block)}) is "
                             f"inconsistent: " + "; ".join(errors[:10])
                             + (f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""))
        self._fp8 = fp8
        self.path = reader.path

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "FP8DequantReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def keys(self) -> list[str]:
        """Tensor names without the scales."""
        return [n for n in self._reader.keys() if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self._fp8)]

    def __contains__(self, name: str) -> bool:
        return name in self._reader and name in set(self.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(name)

    def nbytes(self, name: str) -> int:
        extra = self._reader.nbytes(name + SCALE_SUFFIX) if name in self._fp8 else 0
        return self._reader.nbytes(name) + extra

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``read`` returns: the dequantisation dtype for an FP8 weight, else the file's."""
        return self.out_dtype if name in self._fp8 else self._reader.dtype(name)

    def is_fp8(self, name: str) -> bool:
        """Whether ``name`` is stored block-quantised."""
        return name in self._fp8

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None, *,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tensor ``name`` (dequantised if FP8), or only indices [start, stop) along ``dim``; into
        ``out`` when given (``HFCheckpointReader.read``'s contract, with ``dtype(name)``)."""
        if name not in self._fp8:
            return self._reader.read(name, dim, start, stop, out=out)
        raw = self._reader.read(name, dim, start, stop)
        scale = self._reader.read(name + SCALE_SUFFIX)
        value = dequantize_fp8_blocks(raw, scale, self.block, row0=start if dim == 0 else 0,
                                      col0=start if dim == 1 else 0, dtype=self.out_dtype)
        if out is None:
            return value
        if list(out.shape) != list(value.shape) or out.dtype != value.dtype:
            raise ValueError(f"reading {name!r} {list(value.shape)} {value.dtype} into a {list(out.shape)} {out.dtype} tensor")
        return out.copy_(value)


def open_dequantizing(reader, hf_dir: str | os.PathLike):
    """``reader`` itself, or an ``FP8DequantReader`` over it when ``hf_dir``'s config.json declares
    FP8 block quantisation (ValueError, reader closed, for an inconsistent one)."""
    config = Path(hf_dir) / "config.json"
    if not config.is_file():
        return reader
    try:
        block = fp8_block_size(json.loads(config.read_text()))
        return reader if block is None else FP8DequantReader(reader, block)
    except ValueError:
        reader.close()
        raise
