"""Distributed checkpoints of sharded models through ``megatron.core.dist_checkpointing``.

A checkpoint saved at one layout (TP/PP/VPP/EP) loads at another: Megatron's sharded state
dict names every tensor by its global key and shard offsets. Saving is atomic: all ranks
write into a temporary sibling directory, and only after every rank finished does rank 0
write a completion marker and rename it into place, so a crash mid-save never leaves a
directory that looks complete. ``load_model`` refuses a directory without the marker.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

__all__ = ["save_model", "load_model", "is_complete_checkpoint", "COMPLETE_MARKER"]

COMPLETE_MARKER = "megatron_rl_complete.json"


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _sharded_state_dict(chunks: Iterable[torch.nn.Module]) -> dict[str, Any]:
    chunks = list(chunks)
    if len(chunks) == 1:
        return {"model": _unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _broadcast_str(value: str, group=None) -> str:
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a checkpoint whose save finished on every rank."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def save_model(chunks: Iterable[torch.nn.Module], path: str | os.PathLike, *, overwrite: bool = False,
               metadata: Optional[dict] = None) -> Path:
    """Save the model chunks of every rank to ``path`` atomically; call on all ranks."""
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
    dist_checkpointing.save(_sharded_state_dict(chunks), str(tmp))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"world_size": world, **(metadata or {})}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_model(chunks: Iterable[torch.nn.Module], path: str | os.PathLike) -> None:
    """Load ``path`` into this rank's model chunks (any layout); call on all ranks."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not is_complete_checkpoint(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER}); was its save interrupted?")
    chunks = list(chunks)
    state = dist_checkpointing.load(_sharded_state_dict(chunks), str(path))
    if len(chunks) == 1:
        _unwrap(chunks[0]).load_state_dict(state["model"], strict=True)
    else:
        for i, chunk in enumerate(chunks):
            _unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
