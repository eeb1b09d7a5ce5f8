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

``megatron_rl.rollout.weight_stream.quantize_fp8_stream`` applies ``quantize_fp8_blocks`` to a
weight-sync stream, so an FP8 rollout engine receives what ``write_fp8_export`` writes.

``write_fp8_export`` turns a plain HF export back into that format (``megatron-rl convert
mcore-to-hf --export-fp8``): the tensors the source quantised (its ``*_scale_inv`` names; for a
source that was not FP8, DeepSeek-V3's set ``FP8_WEIGHTS``) become ``float8_e4m3fn`` + a float32
``weight_scale_inv`` per block, and config.json gets ``quantization_config``. A block whose weights
are exactly what the FP8 source dequantised to keeps the source's scale and FP8 bytes (so an
unchanged checkpoint comes back bit for bit); any other block is quantised afresh (amax / 448).
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = [
    "FP8DequantReader",
    "fp8_block_size",
    "dequantize_fp8_blocks",
    "quantize_fp8_blocks",
    "open_dequantizing",
    "SCALE_SUFFIX",
    "FP8_MAX",
    "FP8_WEIGHTS",
    "DEFAULT_BLOCK",
    "fp8_quantization_config",
    "requantize_fp8_blocks",
    "write_fp8_export",
]

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(hf_config: Any) -> Optional[tuple[int, int]]:
    """``weight_block_size`` of an FP8 block-quantised config (dict or transformers config), else None.

    ValueError for a ``quantization_config`` this reader cannot dequantise (named, with what is allowed).
    """
    qc = (
        hf_config.get("quantization_config")
        if isinstance(hf_config, dict)
        else getattr(hf_config, "quantization_config", None)
    )
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"HF config quantization_config.quant_method={method!r} is not supported; allowed: 'fp8' "
            "(DeepSeek-V3's block-quantised format) or no quantization_config"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"HF config quantization_config.fmt={qc['fmt']!r} is not supported; allowed: 'e4m3'")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"HF config quantization_config.weight_block_size={block!r} is not supported; allowed: "
            "two positive ints (DeepSeek-V3: [128, 128])"
        )
    return int(block[0]), int(block[1])


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    *,
    row0: int = 0,
    col0: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
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
                errors.append(
                    f"{scale!r} has shape {list(reader.shape(scale))}; {n!r} {list(shape)} in "
                    f"{list(block)} blocks needs {list(_grid(shape, block))}"
                )
            elif reader.dtype(scale) not in (torch.float32, torch.bfloat16, torch.float16):
                errors.append(f"{scale!r} has dtype {reader.dtype(scale)}; a float scale is needed")
        orphans = sorted(n for n in names if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in fp8)
        errors.extend(f"{n!r} has no FP8 weight {n[: -len(SCALE_SUFFIX)]!r}" for n in orphans)
        if errors:
            raise ValueError(
                f"{reader.path}: FP8 block-quantised checkpoint (weight_block_size={list(block)}) is "
                f"inconsistent: "
                + "; ".join(errors[:10])
                + (f" (and {len(errors) - 10} more)" if len(errors) > 10 else "")
            )
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
        return [
            n for n in self._reader.keys() if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self._fp8)
        ]

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

    def read(
        self,
        name: str,
        dim: Optional[int] = None,
        start: int = 0,
        stop: Optional[int] = None,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Tensor ``name`` (dequantised if FP8), or only indices [start, stop) along ``dim``; into
        ``out`` when given (``HFCheckpointReader.read``'s contract, with ``dtype(name)``)."""
        if name not in self._fp8:
            return self._reader.read(name, dim, start, stop, out=out)
        raw = self._reader.read(name, dim, start, stop)
        scale = self._reader.read(name + SCALE_SUFFIX)
        value = dequantize_fp8_blocks(
            raw, scale, self.block, row0=start if dim == 0 else 0, col0=start if dim == 1 else 0, dtype=self.out_dtype
        )
        if out is None:
            return value
        if list(out.shape) != list(value.shape) or out.dtype != value.dtype:
            raise ValueError(
                f"reading {name!r} {list(value.shape)} {value.dtype} into a {list(out.shape)} {out.dtype} tensor"
            )
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


DEFAULT_BLOCK = (128, 128)
"""DeepSeek-V3's ``weight_block_size``."""
FP8_WEIGHTS = re.compile(
    r"model\.layers\.\d+\.(?:self_attn\.(?:q_proj|k_proj|v_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(?:shared_experts\.|experts\.\d+\.)?(?:gate_proj|up_proj|down_proj))\.weight"
)
"""The weights DeepSeek-V3's published checkpoint stores as FP8: every attention and MLP projection of
the decoder (and MTP) layers; embeddings, heads, norms, routers, their bias and ``eh_proj`` stay plain."""


def fp8_quantization_config(block: tuple[int, int]) -> dict:
    """config.json's ``quantization_config`` of DeepSeek-V3's format with ``block``."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def _expand(grid: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    return grid.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def requantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int], source_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(float8_e4m3fn weight, float32 scale_inv, blocks kept)``: ``quantize_fp8_blocks``, except that
    every block which ``source_scale`` (the FP8 source's scales of this tensor) reproduces exactly --
    its FP8 values times that scale, rounded to ``weight.dtype`` as the loader rounds them, give
    ``weight`` back bit for bit -- keeps the source's scale (and so the source's FP8 bytes)."""
    q, scale = quantize_fp8_blocks(weight, block)
    if source_scale is None:
        return q, scale, 0
    shape = tuple(weight.shape)
    grid = _grid(shape, block)
    if tuple(source_scale.shape) != grid:
        return q, scale, 0
    src = source_scale.float()
    q_src = (weight.float() / _expand(src, shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    same = dequantize_fp8_blocks(q_src, src, block, dtype=weight.dtype) == weight
    padded = torch.ones(grid[0] * block[0], grid[1] * block[1], dtype=torch.bool)
    padded[: shape[0], : shape[1]] = same
    keep = padded.reshape(grid[0], block[0], grid[1], block[1]).all(dim=3).all(dim=1)
    full = _expand(keep, shape, block)
    q = torch.where(full, q_src.view(torch.uint8), q.view(torch.uint8)).view(torch.float8_e4m3fn)
    return q, torch.where(keep, src, scale), int(keep.sum())


def _source_scales(source_dir: Optional[str | os.PathLike]):
    """``(reader, names of its FP8 weights)`` of an FP8 block-quantised source checkpoint, else None."""
    from parallel.bridge.hf_files import HFCheckpointReader

    if source_dir is None or not (Path(source_dir) / "config.json").is_file():
        return None
    try:
        if fp8_block_size(json.loads((Path(source_dir) / "config.json").read_text())) is None:
            return None
        reader = HFCheckpointReader(source_dir)
    except (ValueError, OSError):  # gone, changed or damaged since it was converted: scales made afresh
        return None
    names = {n[: -len(SCALE_SUFFIX)] for n in reader.keys() if n.endswith(SCALE_SUFFIX)}
    return reader, names


def write_fp8_export(
    hf_dir: str | os.PathLike,
    *,
    block: Optional[tuple[int, int]] = None,
    source_dir: Optional[str | os.PathLike] = None,
) -> dict[str, int]:
    """Rewrite the plain HF checkpoint being written in ``hf_dir`` in DeepSeek-V3's FP8 block format.

    Quantised: the FP8 weights of ``source_dir`` (the checkpoint it was converted from) when that is
    an FP8 checkpoint, else the names ``FP8_WEIGHTS`` matches. ``block`` defaults to the source's
    ``weight_block_size`` or ``DEFAULT_BLOCK``. Shards are rewritten one tensor at a time (each
    atomically), the index lists the scales, and config.json gets ``quantization_config``.
    Returns ``{"quantized", "blocks", "blocks_kept"}`` (tensors, blocks, blocks whose source scale
    and FP8 bytes were kept).
    """
    from safetensors import safe_open

    from parallel.bridge.hf_files import INDEX_FILE, SINGLE_FILE, ST_DTYPES, HFTensorInfo, SafetensorsStreamWriter

    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    config = json.loads(config_path.read_text())
    source = _source_scales(source_dir)
    if block is None:
        src_cfg = json.loads((Path(source_dir) / "config.json").read_text()) if source else {}
        block = fp8_block_size(src_cfg) or DEFAULT_BLOCK
    wanted = source[1] if source else None
    index_path = hf_dir / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else [SINGLE_FILE]
    dtypes = {v: k for k, v in ST_DTYPES.items()}
    stats = {"quantized": 0, "blocks": 0, "blocks_kept": 0}
    added = {}
    try:
        for file in files:
            path = hf_dir / file
            with safe_open(str(path), "pt") as f:
                names = list(f.keys())
                plain = {n: (tuple(f.get_slice(n).get_shape()), dtypes[f.get_slice(n).get_dtype()]) for n in names}
                quant = [
                    n
                    for n in names
                    if len(plain[n][0]) == 2
                    and plain[n][1].is_floating_point
                    and (n in wanted if wanted is not None else FP8_WEIGHTS.fullmatch(n))
                ]
                if not quant:
                    continue
                infos = []
                for n in names:
                    if n in quant:
                        infos += [
                            HFTensorInfo(n, plain[n][0], torch.float8_e4m3fn),
                            HFTensorInfo(n + SCALE_SUFFIX, _grid(plain[n][0], block), torch.float32),
                        ]
                        # bytes the index's total_size gains: the scale, less what FP8 saves on the weight
                        added[n + SCALE_SUFFIX] = (
                            file,
                            infos[-1].nbytes + infos[-2].nbytes - HFTensorInfo(n, *plain[n]).nbytes,
                        )
                    else:
                        infos.append(HFTensorInfo(n, *plain[n]))
                tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
                writer = SafetensorsStreamWriter(tmp, infos)
                try:
                    for n in names:
                        tensor = f.get_tensor(n)
                        if n not in quant:
                            writer.write(n, tensor)
                            continue
                        src = source[0].read(n + SCALE_SUFFIX) if source and n + SCALE_SUFFIX in source[0] else None
                        q, scale, kept = requantize_fp8_blocks(tensor, block, src)
                        writer.write(n, q)
                        writer.write(n + SCALE_SUFFIX, scale.float().contiguous())
                        stats["quantized"] += 1
                        stats["blocks"] += scale.numel()
                        stats["blocks_kept"] += kept
                finally:
                    writer.close()
            os.replace(tmp, path)
    finally:
        if source:
            source[0].close()
        for leftover in hf_dir.glob(".*.tmp-*"):
            leftover.unlink()
    if index is not None:
        for scale, (file, change) in added.items():
            index["weight_map"][scale] = file
            if "total_size" in index.get("metadata", {}):
                index["metadata"]["total_size"] += change
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config["quantization_config"] = fp8_quantization_config(block)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return stats
