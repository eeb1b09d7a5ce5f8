"""Write a sharded Megatron model as an HF checkpoint directory, atomically."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.bridge.collective import broadcast_str, raise_together
from parallel.bridge.export import DEFAULT_BUCKET_BYTES, ExportStats, HFExporter
from parallel.bridge.hf_files import INDEX_FILE, SINGLE_FILE, SafetensorsStreamWriter, plan_shards
from parallel.bridge.rules import WeightMap


def _config_json(hf_config: Any) -> str:
    """config.json text of a transformers config (all fields) or a plain mapping."""
    if hasattr(hf_config, "to_json_string"):
        return hf_config.to_json_string(use_diff=False)
    return json.dumps(dict(hf_config), indent=2, sort_keys=True) + "\n"


def save_hf_checkpoint(chunks: Iterable[torch.nn.Module], weight_map: WeightMap, out_dir: str | os.PathLike,
                       hf_config: Any, *, mesh=None, max_shard_bytes: int = 4 * 2**30,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Optional[torch.dtype] = None,
                       overwrite: bool = False, extra_files: Iterable[str | os.PathLike] = (),
                       ignore: Sequence[str] = (), stats: Optional[ExportStats] = None, staging=None) -> Path:
    """Write the model as an HF checkpoint in ``out_dir``; call on all ranks (rank 0 writes).

    Tensors stream from ``HFExporter`` into safetensors shards of at most ``max_shard_bytes``
    (one file ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + index), then
    ``config.json`` (``hf_config``: a dict or a transformers config) and copies of
    ``extra_files`` (tokenizer, generation config) are added. Everything is written into a
    temporary sibling directory renamed into place at the end; on any error it is removed and
    every rank raises. An existing ``out_dir`` is an error unless ``overwrite``. ``staging``: the
    parameters are loaded bucket by bucket as the export needs them (``HFExporter.iter_weights``).
    """
    exporter = HFExporter(chunks, weight_map, mesh=mesh, dtype=dtype, ignore=ignore)
    final = Path(out_dir).resolve()
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra_files = [Path(f) for f in extra_files]
    errors: list[tuple[type, str]] = []
    if rank == 0:
        if final.exists() and not overwrite:
            errors.append((FileExistsError, f"output directory {final} exists; pass overwrite=True to replace it"))
        errors.extend((FileNotFoundError, f"extra file {f} does not exist") for f in extra_files if not f.is_file())
    raise_together(errors)
    tmp = Path(broadcast_str(str(final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")))
    plan = plan_shards(exporter.tensors, max_shard_bytes)
    names = [SINGLE_FILE] if len(plan) == 1 else \
        [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    error: Optional[str] = None
    stream: Optional[SafetensorsStreamWriter] = None
    try:
        if rank == 0:
            tmp.mkdir(parents=True)
        shard = -1
        for name, tensor in exporter.iter_weights(bucket_bytes=bucket_bytes, stats=stats, staging=staging):
            if error is not None:
                continue  # keep receiving so the other ranks finish their sends
            try:
                if stream is None or stream.done:
                    if stream is not None:
                        stream.close()
                    shard += 1
                    stream = SafetensorsStreamWriter(tmp / names[shard], plan[shard])
                stream.write(name, tensor)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"writing {tmp}: {type(exc).__name__}: {exc}"
        if rank == 0 and error is None:
            try:
                if stream is not None:
                    stream.close()
                if shard != len(plan) - 1 or (stream is not None and not stream.done):
                    raise RuntimeError(f"export ended after shard {shard + 1} of {len(plan)}")
                if len(plan) > 1:
                    index = {"metadata": {"total_size": sum(i.nbytes for i in exporter.tensors)},
                             "weight_map": {i.name: names[s] for s, infos in enumerate(plan) for i in infos}}
                    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                (tmp / "config.json").write_text(_config_json(hf_config))
                for f in extra_files:
                    shutil.copy2(f, tmp / f.name)
            except Exception as exc:  # noqa: BLE001
                error = f"writing {tmp}: {type(exc).__name__}: {exc}"
        raise_together([(OSError, error)] if error else [])
        if rank == 0:
            if final.exists():
                trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash)
            else:
                os.replace(tmp, final)
    finally:
        if stream is not None:
            stream.close()
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final
