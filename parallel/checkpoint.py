"""Distributed checkpoints of sharded models through ``megatron.core.dist_checkpointing``.

A checkpoint saved at one layout (TP/PP/VPP/EP) loads at another: Megatron's sharded state
dict names every tensor by its global key and shard offsets. Saving is atomic: all ranks
write into a temporary sibling directory, and only after every rank finished does rank 0
write a completion marker and rename it into place, so a crash mid-save never leaves a
directory that looks complete. ``load_model`` refuses a directory without the marker.

Training state: given the Megatron optimizer and ``OptimizerParamScheduler``, the same
checkpoint also holds the optimizer state (sharded like the parameters, so it reshards too), the
scheduler's state and every rank's RNG states (``rng/rank_<r>.pt``: torch CPU/CUDA generators
and Megatron's model-parallel CUDA RNG tracker), as Megatron-LM's training checkpoints do.

Damage and full disks are named: ``verify_dist_checkpoint(path)`` lists what is missing or
truncated, checked against the checkpoint's own index (``.metadata`` records the byte range of
every tensor in every ``.distcp`` file), without reading the tensors. A save that runs out of
space raises ``DiskFullError`` (the path, the bytes needed and free) instead of the writer's
``unexpected pos`` or ``[Errno 28]``; ``check_free_space`` refuses a write that cannot fit.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "save_model",
    "load_model",
    "is_complete_checkpoint",
    "verify_dist_checkpoint",
    "COMPLETE_MARKER",
    "DiskFullError",
    "check_free_space",
    "free_bytes",
    "is_disk_full",
    "fmt_bytes",
    "dir_bytes",
    "resolve_checkpoint_dir",
    "TRACKER_FILE",
]

COMPLETE_MARKER = "megatron_rl_complete.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker: ``release`` or an iteration number, naming ``release/`` or ``iter_0000042/``."""


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The dist checkpoint directory of ``path``: ``path`` itself, or -- when ``path`` is a Megatron-LM
    ``--load`` directory (``latest_checkpointed_iteration.txt``) -- the ``release/`` or
    ``iter_XXXXXXX/`` directory its tracker names, as Megatron-LM's ``get_checkpoint_name`` does."""
    path = Path(path)
    tracker = path / TRACKER_FILE
    if not tracker.is_file():
        return path
    text = tracker.read_text().strip()
    if text == "release":
        return path / "release"
    try:
        return path / f"iter_{int(text):07d}"
    except ValueError:
        raise ValueError(f"{tracker}: {text!r} is not an iteration number or 'release'") from None


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _sharded_state_dict(
    chunks: Iterable[torch.nn.Module], optimizer=None, scheduler=None, *, is_loading: bool = False
) -> dict[str, Any]:
    chunks = list(chunks)
    if len(chunks) == 1:
        state = {"model": _unwrap(chunks[0]).sharded_state_dict()}
    else:
        state = {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}
    if optimizer is not None:
        # The optimizer's tensors are keyed by the parameters' sharded keys: it reshards with them.
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _broadcast_str(value: str, group=None) -> str:
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


# ----------------------------------------------------------------------------- full disks
class DiskFullError(RuntimeError):
    """A write that does not fit on its file system, named: what, where, bytes needed and free."""

    def __init__(
        self, message: str, *, path: str | os.PathLike = "", needed: Optional[int] = None, free: Optional[int] = None
    ):
        super().__init__(message)
        self.path, self.needed, self.free = str(path), needed, free


def fmt_bytes(n: Optional[float]) -> str:
    """``1.5 GiB`` / ``3.2 MiB`` / ``12 B``; ``?`` for None."""
    if n is None:
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free (for this user) on the file system that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed while we looked
                pass
    return total


def check_free_space(path: str | os.PathLike, needed: int, what: str, *, hint: str = "") -> None:
    """``DiskFullError`` unless ``needed`` bytes (with 2% slack) are free where ``path`` goes."""
    free = free_bytes(path)
    if free < needed * 1.02:
        raise DiskFullError(
            f"disk full: {what} needs ~{fmt_bytes(needed)} at {path} but only {fmt_bytes(free)} "
            f"are free on that file system{hint}",
            path=path,
            needed=needed,
            free=free,
        )


def is_disk_full(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) is ENOSPC / EDQUOT, in any wrapping
    (a Ray task error carries the worker's message only; torch's zip writer says ``unexpected pos``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DiskFullError):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "Disk quota exceeded" in text or "DiskFullError" in text:
            return True
        if exc.__cause__ is not None:  # ``raise ... from err``
            exc = exc.__cause__
        elif exc.__suppress_context__:  # ``raise ... from None``
            exc = None
        else:
            exc = exc.__context__
    return False


def _disk_full(exc: BaseException, path: Path, what: str) -> DiskFullError:
    free = free_bytes(path)
    return DiskFullError(
        f"disk full: {what} at {path} failed with {type(exc).__name__}: {exc}; "
        f"{fmt_bytes(free)} are free on that file system",
        path=path,
        free=free,
    )


# ----------------------------------------------------------------------------- integrity
def verify_dist_checkpoint(path: str | os.PathLike) -> list[str]:
    """What is wrong with the dist checkpoint at ``path`` (empty: nothing found), from its own
    records: the completion marker, Megatron's ``metadata.json`` and ``common.pt``, the index
    ``.metadata`` (every ``.distcp`` file must exist and reach the end of its last tensor) and, when
    the marker says RNG states were saved, ``rng/rank_<r>.pt`` of every rank. Reads no tensor."""
    path = resolve_checkpoint_dir(path)
    if not path.is_dir():
        return [f"{path} does not exist"]
    problems = []
    marker = path / COMPLETE_MARKER
    info: dict = {}
    if not marker.is_file():
        problems.append(f"{marker} is missing (the save did not finish)")
    else:
        try:
            info = json.loads(marker.read_text())
        except ValueError as exc:
            problems.append(f"{marker} is not valid JSON ({exc})")
    for name in ("metadata.json", "common.pt", ".metadata"):
        if not (path / name).is_file():
            problems.append(f"{path / name} is missing")
    if (path / ".metadata").is_file():
        from torch.distributed.checkpoint import FileSystemReader

        try:
            index = FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - any unreadable index is reported as such
            problems.append(f"{path / '.metadata'} cannot be read ({type(exc).__name__}: {exc})")
        else:
            ends: dict[str, int] = defaultdict(int)
            for item in (index.storage_data or {}).values():
                ends[item.relative_path] = max(ends[item.relative_path], int(item.offset) + int(item.length))
            for name, end in sorted(ends.items()):
                f = path / name
                if not f.is_file():
                    problems.append(f"{f} is missing (the index .metadata lists it)")
                elif f.stat().st_size < end:
                    problems.append(f"{f} is truncated: {f.stat().st_size} bytes, its tensors need {end}")
    if info.get("rng"):
        for rank in range(int(info.get("world_size", 1))):
            f = path / "rng" / f"rank_{rank}.pt"
            if not f.is_file():
                problems.append(f"{f} is missing (RNG state of rank {rank})")
    return problems


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a checkpoint whose save finished on every rank."""
    try:
        return (resolve_checkpoint_dir(path) / COMPLETE_MARKER).is_file()
    except ValueError:
        return False


class _Hooked:
    """A bucket's (write item, tensor) list that tells ``hooks`` which tensors it holds
    (``start``), calls ``hooks.before(tensor)`` as each is handed to the writer and
    ``hooks.after(tensor)`` once it is written (when the writer asks for the next one)."""

    def __init__(self, items: list, hooks):
        self._items, self._hooks = items, hooks

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        self._hooks.start([tensor for _, tensor in self._items])
        for item, tensor in self._items:
            self._hooks.before(tensor)
            yield item, tensor
            self._hooks.after(tensor)


def _write_in_process(transform_list, use_msc, rank, write_buckets, results_queue, hooks=None) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without its processes: every bucket
    (one ``.distcp`` file) is written here, one after the other, with the same per-file writer and fsync."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict = {}
    for i, bucket in enumerate(write_buckets):
        if hooks is not None:
            file_name, storage_key, (bytes_data, tensor_data) = bucket
            bucket = (file_name, storage_key, (bytes_data, _Hooked(tensor_data, hooks)))
        local, count = queue.Queue(), queue.Queue()
        count.put(i)  # the writer takes it back and marks it done, as its worker processes do
        kwargs = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, **kwargs)
        index, outcome = local.get_nowait()
        if isinstance(outcome, Exception):
            results_queue.put(outcome)
            return
        results[index] = outcome
    results_queue.put(results)


def _save_strategy(writer_threads: int, in_process: bool, hooks=None):
    """Megatron's torch_dist save strategy with ``writer_threads`` files per rank; ``in_process``:
    the rank writes them itself instead of forking one writer process per file (``hooks``: see
    ``save_model``'s ``write_hooks``)."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if not in_process:
        return torch_strategy.TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=writer_threads)

    class InProcessWriter(FileSystemWriterAsync):
        """The writer whose save function runs in the calling process (``_write_in_process``)."""

        def get_save_function_and_args(self):
            """Megatron's save function and arguments, with the multi-process writer replaced."""
            fn, stage, args = super().get_save_function_and_args()
            if fn is None:
                return fn, stage, args
            return partial(_write_in_process, *fn.args, hooks=hooks), stage, args

    class InProcessStrategy(torch_strategy.TorchDistSaveShardedStrategy):
        """``TorchDistSaveShardedStrategy`` writing through ``InProcessWriter``."""

        def async_save(self, sharded_state_dict, checkpoint_dir):
            """Megatron's ``async_save`` with its writer class swapped for the call (it names the class)."""
            original = torch_strategy.FileSystemWriterAsync
            torch_strategy.FileSystemWriterAsync = InProcessWriter
            try:
                return super().async_save(sharded_state_dict, checkpoint_dir)
            finally:
                torch_strategy.FileSystemWriterAsync = original

    return InProcessStrategy("torch_dist", 1, thread_count=writer_threads)


def save_model(
    chunks: Iterable[torch.nn.Module],
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    metadata: Optional[dict] = None,
    optimizer=None,
    scheduler=None,
    save_rng: bool = False,
    common: Optional[dict] = None,
    writer_threads: int = 2,
    in_process: bool = False,
    write_hooks: Optional[tuple] = None,
) -> Path:
    """Save the model chunks of every rank to ``path`` atomically; call on all ranks.

    With ``optimizer`` (a Megatron optimizer) / ``scheduler`` / ``save_rng`` the checkpoint also
    holds the training state (module docstring). ``common``: plain values stored beside the
    sharded tensors in ``common.pt`` (Megatron-LM reads ``checkpoint_version`` and ``iteration``).
    ``writer_threads``: ``.distcp`` files per rank (Megatron's ``thread_count``, default 2), each
    written by a forked writer process -- or, with ``in_process``, by the rank itself one after the
    other (no process that holds a copy-on-write image of the rank; the converters' choice).
    ``write_hooks`` (with ``in_process``): an object whose ``start(tensors)`` is given the tensors
    of each file before any is written, and ``before(tensor)`` / ``after(tensor)`` each tensor just
    before it is written and just after (a streaming caller fills it first and releases it after)."""
    if writer_threads < 1:
        raise ValueError(f"writer_threads={writer_threads} is not allowed; give a number of files per rank >= 1")
    if write_hooks is not None and not in_process:
        raise ValueError("write_hooks need in_process=True (a forked writer's calls would not reach this process)")
    from megatron.core import dist_checkpointing

    final = Path(path).resolve()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if final.exists() and not overwrite:
        raise FileExistsError(f"checkpoint directory {final} exists; pass overwrite=True to replace it")
    tmp = Path(_broadcast_str(str(final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")))
    if rank == 0:
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    try:
        dist_checkpointing.save(
            {**(common or {}), **_sharded_state_dict(chunks, optimizer, scheduler)},
            str(tmp),
            sharded_strategy=None
            if writer_threads == 2 and not in_process  # Megatron's default
            else _save_strategy(writer_threads, in_process, write_hooks),
        )
        if save_rng:
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    except Exception as exc:
        if is_disk_full(exc):
            raise _disk_full(exc, tmp, f"rank {rank} saving the checkpoint") from exc
        raise
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        (tmp / COMPLETE_MARKER).write_text(
            json.dumps(
                {
                    "world_size": world,
                    "optimizer": optimizer is not None,
                    "scheduler": scheduler is not None,
                    "rng": save_rng,
                    **(metadata or {}),
                }
            )
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def _tiles(parts, data: torch.Tensor) -> bool:
    """True when ``parts`` are contiguous views of ``data``'s storage that, in order, tile ``data``
    along dim 0 (so ``torch.cat(parts)`` equals ``data``)."""
    if not isinstance(parts, (list, tuple)) or not parts or not data.is_contiguous():
        return False
    offset, rows = data.storage_offset(), 0
    for part in parts:
        if (
            not isinstance(part, torch.Tensor)
            or not part.is_contiguous()
            or part.dtype != data.dtype
            or part.device != data.device
            or part.dim() != data.dim()
            or part.shape[1:] != data.shape[1:]
            or part.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()
            or part.storage_offset() != offset
        ):
            return False
        offset, rows = offset + part.numel(), rows + part.shape[0]
    return rows == data.shape[0]


def _merge_in_place(state: dict) -> None:
    """Make the tensor factories of ``state`` (fc1's gate/up halves) merge without a copy where the
    loaded halves already tile the parameter they were views of: the merge is then the parameter itself
    (``torch.cat`` would allocate every fc1 anew, all at once, before ``load_state_dict`` copies them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for factory in nested_values(state):
        if isinstance(factory, ShardedTensorFactory) and isinstance(factory.data, torch.Tensor):

            def merge(parts, _data=factory.data.detach(), _merge=factory.merge_fn):
                return _data if _tiles(parts, _data) else _merge(parts)

            factory.merge_fn = merge


def _check_loadable(path: str | os.PathLike) -> Path:
    """The checkpoint directory of ``path`` when complete and undamaged; the error says why not."""
    path = resolve_checkpoint_dir(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not is_complete_checkpoint(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER}); was its save interrupted?")
    damage = verify_dist_checkpoint(path)
    if damage:
        raise ValueError(f"checkpoint {path} is damaged: {'; '.join(damage)}")
    return path


def _leaf_paths(state: dict, prefix: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    """(key path, value) of every non-dict value of a nested dict."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _leaf_paths(value, (*prefix, key))
        else:
            yield (*prefix, key), value


class PartialLoad:
    """A model checkpoint loaded into ``chunks`` a few parameters at a time (a streamed conversion:
    a rank never holds its whole shard). ``load(tensors)`` reads exactly the checkpoint tensors
    that fill those tensors of this rank (parameters or persistent buffers; fc1's halves straight
    into their parameter), on all ranks together (collective: a rank with nothing to load still
    calls it, with none); a storage already loaded is not read again. ``release(tensors)`` gives
    their storage up. Empty storage (``megatron_rl.convert.streamed_model.build_empty_model``) gets its pages as
    it is loaded; tensors never asked for are never read. This is the ``staging`` of
    ``parallel.bridge.HFExporter.iter_weights``.

    On a single rank the first ``load`` reads every tensor at once: Megatron's load assumes that a
    rank asks for all of its shards of a tensor (an MoE or stacked-layer key spans the whole model)
    and, in a world of one, takes the shards not asked for as its own (it places them on rank
    ``(rank + 1) % world``). The releases still free each bucket once written."""

    def __init__(self, chunks: Iterable[torch.nn.Module], path: str | os.PathLike):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        self.path = _check_loadable(path)
        state = _sharded_state_dict(list(chunks), is_loading=True)
        _merge_in_place(state)
        self._by_storage: dict[int, list[tuple[tuple, Any]]] = defaultdict(list)
        for keys, leaf in _leaf_paths(state):
            data = getattr(leaf, "data", None)
            if (
                isinstance(leaf, (ShardedTensor, ShardedTensorFactory))
                and isinstance(data, torch.Tensor)
                and data.numel()
            ):
                self._by_storage[data.untyped_storage().data_ptr()].append((keys, leaf))

    def load(self, tensors: Iterable[torch.Tensor]) -> None:
        """Fill ``tensors`` (parameters of the chunks) from the checkpoint; collective."""
        from megatron.core import dist_checkpointing

        if not dist.is_initialized() or dist.get_world_size() == 1:  # see the class docstring
            tensors = [leaf.data for entries in self._by_storage.values() for _, leaf in entries]
        chosen = [
            entry for t in tensors if t.numel() for entry in self._by_storage.pop(t.untyped_storage().data_ptr(), [])
        ]
        wanted: dict = {}
        for keys, leaf in chosen:
            node = wanted
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = leaf
        targets = [(keys, leaf.data) for keys, leaf in chosen]  # the factories are replaced by what they build
        # The integrity check needs every shard of every tensor requested at once (an MoE layer's
        # experts may span loads); the export checks its coverage itself.
        loaded = dist_checkpointing.load(wanted, str(self.path), validate_access_integrity=False)
        with torch.no_grad():
            for keys, target in targets:
                value = loaded
                for key in keys:
                    value = value[key]
                if value.data_ptr() != target.data_ptr() or value.shape != target.shape:
                    target.copy_(value)

    @staticmethod
    def release(tensors: Iterable[torch.Tensor]) -> None:
        """Free the storage of ``tensors`` (their shapes stay; nothing reads them again)."""
        for t in tensors:
            t.untyped_storage().resize_(0)


def load_model(
    chunks: Iterable[torch.nn.Module],
    path: str | os.PathLike,
    *,
    optimizer=None,
    scheduler=None,
    load_rng: bool = False,
    in_place_merges: bool = False,
) -> None:
    """Load ``path`` into this rank's model chunks (any layout); call on all ranks.

    With ``optimizer`` / ``scheduler`` / ``load_rng``, restore that training state too: the
    checkpoint must hold it (ValueError otherwise). RNG states are per rank: restored only at the
    saving world size (a resharded load keeps this run's seeds, with a warning). ``in_place_merges``:
    factory-built tensors that load straight into their parameter (fc1's halves) are not
    concatenated into a copy first (``_merge_in_place``; the converters' verify)."""
    from megatron.core import dist_checkpointing

    path = _check_loadable(path)
    chunks = list(chunks)
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    for name, wanted in (("optimizer", optimizer), ("scheduler", scheduler), ("rng", load_rng)):
        if wanted is not None and wanted is not False and not marker.get(name, False):
            raise ValueError(f"{path} holds no {name} state (saved with {name}=None/False); cannot restore it")
    wanted = _sharded_state_dict(chunks, optimizer, scheduler, is_loading=True)
    if in_place_merges:
        _merge_in_place(wanted)
    state = dist_checkpointing.load(wanted, str(path))
    if len(chunks) == 1:
        _unwrap(chunks[0]).load_state_dict(state["model"], strict=True)
    else:
        for i, chunk in enumerate(chunks):
            _unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if marker.get("world_size") == world:
            _set_rng_state(torch.load(path / "rng" / f"rank_{rank}.pt", weights_only=False))
        elif rank == 0:  # resharded: per-rank RNG streams have no counterpart; keep this run's seeds
            import warnings

            warnings.warn(
                f"{path}: RNG states were saved by {marker.get('world_size')} ranks, this run has "
                f"{world}; they are not restored (model and optimizer state are)",
                stacklevel=2,
            )
