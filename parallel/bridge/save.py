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
from parallel.bridge.export import DEFAULT_BUCKET_BYTES, ExportStats, HFExporter, _nbytes
from parallel.bridge.hf_files import INDEX_FILE, SINGLE_FILE, SafetensorsStreamWriter, plan_shards
from parallel.bridge.rules import WeightMap


def _config_json(hf_config: Any) -> str:
    """config.json text of a transformers config (all fields) or a plain mapping."""
    if hasattr(hf_config, "to_json_string"):
        return hf_config.to_json_string(use_diff=False)
    return json.dumps(dict(hf_config), indent=2, sort_keys=True) + "\n"


class _Shards:
    """The safetensors files of an export plan, written tensor by tensor in plan order."""

    def __init__(self, tmp: Path, names: list[str], plan: list):
        self._tmp, self._names, self._plan = tmp, names, plan
        self.shard = -1
        self._stream: Optional[SafetensorsStreamWriter] = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor, opening the next file when the current one is full."""
        if self._stream is None or self._stream.done:
            if self._stream is not None:
                self._stream.close()
            self.shard += 1
            self._stream = SafetensorsStreamWriter(self._tmp / self._names[self.shard], self._plan[self.shard])
        self._stream.write(name, tensor)

    @property
    def complete(self) -> bool:
        """Every planned file was written to its end."""
        return self.shard == len(self._plan) - 1 and (self._stream is None or self._stream.done)

    def close(self) -> None:
        """Close the open file (idempotent)."""
        if self._stream is not None:
            self._stream.close()


class _Background:
    """Writes the tensors handed to it in a thread (file writes release the GIL), at most
    ``limit`` bytes queued (one more bucket), so rank 0 loads and receives the next bucket while
    the last one is written. The first error stops the writing and is raised by the next call."""

    def __init__(self, shards: _Shards, limit: int):
        import threading
        from collections import deque

        self._shards, self._limit = shards, limit
        self._queue: deque = deque()
        self._queued, self._busy, self._error, self._stopped = 0, False, None, False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hf-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return
                name, tensor = self._queue.popleft()
                self._busy = True
            try:
                if self._error is None:
                    self._shards.write(name, tensor)
            except BaseException as exc:  # noqa: BLE001 - raised in the exporting thread
                self._error = exc
            with self._cond:
                self._queued -= _nbytes(tensor)
                self._busy = False
                del tensor
                self._cond.notify_all()

    def submit(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (waits while more than ``limit`` bytes are queued)."""
        self.raise_error()
        with self._cond:
            while self._queue and self._queued + _nbytes(tensor) > self._limit and self._error is None:
                self._cond.wait()
            self._queue.append((name, tensor))
            self._queued += _nbytes(tensor)
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every queued tensor is written (or dropped after an error: ``raise_error``)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def raise_error(self) -> None:
        """Raise the writer's first error, if any."""
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """End the thread once the queue is written (or dropped after an error)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()


class _ReleaseWhenWritten:
    """``staging`` whose releases wait for the background writer: a bucket's parameters (which
    the exported tensors may alias) are released after the next bucket is loaded -- the load
    overlaps the write -- and once everything queued is written."""

    def __init__(self, staging, background: _Background):
        self._staging, self._background, self._pending = staging, background, []

    def load(self, tensors) -> None:
        """Load the next bucket, then release the last one once written. A write error is not
        raised here: the export must go on on every rank (its loads are collective)."""
        self._staging.load(tensors)
        self._release_written()

    def release(self, tensors) -> None:
        """Release ``tensors`` once the tensors queued so far are written."""
        self._pending.extend(tensors)

    def _release_written(self) -> None:
        self._background.drain()
        pending, self._pending = self._pending, []
        self._staging.release(pending)

    def flush(self) -> None:
        """At the end: wait for the writer, release what waits, raise the writer's error."""
        self._release_written()
        self._background.raise_error()


def save_hf_checkpoint(
    chunks: Iterable[torch.nn.Module],
    weight_map: WeightMap,
    out_dir: str | os.PathLike,
    hf_config: Any,
    *,
    mesh=None,
    max_shard_bytes: int = 4 * 2**30,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
    extra_files: Iterable[str | os.PathLike] = (),
    ignore: Sequence[str] = (),
    stats: Optional[ExportStats] = None,
    staging=None,
) -> Path:
    """Write the model as an HF checkpoint in ``out_dir``; call on all ranks (rank 0 writes).

    Tensors stream from ``HFExporter`` into safetensors shards of at most ``max_shard_bytes``
    (one file ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + index), then
    ``config.json`` (``hf_config``: a dict or a transformers config) and copies of
    ``extra_files`` (tokenizer, generation config) are added. Everything is written into a
    temporary sibling directory renamed into place at the end; on any error it is removed and
    every rank raises. An existing ``out_dir`` is an error unless ``overwrite``. ``staging``: the
    parameters are loaded bucket by bucket as the export needs them (``HFExporter.iter_weights``),
    and rank 0 writes in a thread while it loads and receives the next bucket.
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
    names = (
        [SINGLE_FILE]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    error: Optional[str] = None
    shards = _Shards(tmp, names, plan)
    background = _Background(shards, bucket_bytes) if rank == 0 and staging is not None else None
    try:
        if rank == 0:
            tmp.mkdir(parents=True)
        if background is not None:
            staging = _ReleaseWhenWritten(staging, background)
        for name, tensor in exporter.iter_weights(bucket_bytes=bucket_bytes, stats=stats, staging=staging):
            if error is not None:
                continue  # keep receiving so the other ranks finish their sends
            try:
                if background is not None:
                    background.submit(name, tensor)
                else:
                    shards.write(name, tensor)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"writing {tmp}: {type(exc).__name__}: {exc}"
        if background is not None:
            try:
                staging.flush()
            except Exception as exc:  # noqa: BLE001
                error = error or f"writing {tmp}: {type(exc).__name__}: {exc}"
        if rank == 0 and error is None:
            try:
                shards.close()
                if not shards.complete:
                    raise RuntimeError(f"export ended after shard {shards.shard + 1} of {len(plan)}")
                if len(plan) > 1:
                    index = {
                        "metadata": {"total_size": sum(i.nbytes for i in exporter.tensors)},
                        "weight_map": {i.name: names[s] for s, infos in enumerate(plan) for i in infos},
                    }
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
        if background is not None:
            background.stop()
        shards.close()
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final
