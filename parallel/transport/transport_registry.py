"""Transport names -> implementations: the one table every caller picks from.

``checkpoint_engine.backend`` (``megatron_rl.config.rollout.WeightSyncConfig``) names an entry;
``get_transport(name)`` is the only lookup, and an unknown name is a ``ValueError`` listing
the valid ones. ``nccl`` (verl's backend name) and ``cuda_ipc`` need CUDA: building either half
without it is a ``ValueError`` naming the key (``parallel.transport.cuda.require_cuda``).
"""

from __future__ import annotations

from typing import Optional

from parallel.transport.transport_base import Receiver, Sender, Transport
from parallel.transport.broadcast import BroadcastReceiver, BroadcastSender
from parallel.transport.bytes_blob import BytesReceiver, BytesSender
from parallel.transport.colocated import ColocatedReceiver, ColocatedSender
from parallel.transport.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from parallel.transport.nccl import NcclReceiver, NcclSender
from parallel.transport.shm import ShmReceiver, ShmSender

__all__ = [
    "TRANSPORTS",
    "RESERVED",
    "STREAMABLE",
    "GPU_TRANSPORTS",
    "get_transport",
    "new_sender",
    "new_receiver",
    "link_group",
]

TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            "colocated",
            ColocatedSender,
            ColocatedReceiver,
            streamable=False,
            same_process=True,
            needs_group=False,
            summary="the tensors by reference; receivers in the sender's process",
        ),
        Transport(
            "bytes",
            BytesSender,
            BytesReceiver,
            streamable=False,
            same_process=False,
            needs_group=False,
            summary="one safetensors blob per bucket, carried by the channel (an RPC)",
        ),
        Transport(
            "shm",
            ShmSender,
            ShmReceiver,
            streamable=True,
            same_process=False,
            needs_group=False,
            summary="one safetensors file per bucket under a tmpfs directory; receivers map it",
        ),
        Transport(
            "broadcast",
            BroadcastSender,
            BroadcastReceiver,
            streamable=True,
            same_process=False,
            needs_group=True,
            summary="tensor bytes broadcast over the side band's gloo data group",
        ),
        Transport(
            "nccl",
            NcclSender,
            NcclReceiver,
            streamable=True,
            same_process=False,
            needs_group=True,
            group_backend="nccl",
            requires_cuda=True,
            summary="tensor bytes broadcast GPU to GPU over an NCCL group of the side band's ranks",
        ),
        Transport(
            "cuda_ipc",
            CudaIpcSender,
            CudaIpcReceiver,
            streamable=True,
            same_process=False,
            needs_group=False,
            requires_cuda=True,
            max_receivers=1,
            summary="one GPU buffer per bucket shared by CUDA IPC handle with engines on that GPU",
        ),
    )
}
RESERVED: dict[str, str] = {}  # names kept for transports not built yet (none now)
STREAMABLE = tuple(sorted(name for name, t in TRANSPORTS.items() if t.streamable))
# ("broadcast", "cuda_ipc", "nccl", "shm")
GPU_TRANSPORTS = tuple(name for name, t in TRANSPORTS.items() if t.requires_cuda)  # ("nccl", "cuda_ipc")


def get_transport(name: str, *, allowed: Optional[tuple[str, ...]] = None) -> Transport:
    """The entry for ``name``; ``ValueError`` naming the valid ones (``allowed``, default all)."""
    allowed = tuple(TRANSPORTS) if allowed is None else allowed
    if name in allowed:
        return TRANSPORTS[name]
    note = f" ({name!r} is reserved for {RESERVED[name]}, not built yet)" if name in RESERVED else ""
    raise ValueError(f"transport={name!r} is not allowed; choose one of {list(allowed)}{note}")


def new_sender(name: str, *, group=None, shm_dir: Optional[str] = None) -> Sender:
    """A sender for transport ``name`` over what the link offers (see ``Sender.create``)."""
    return get_transport(name).sender.create(group=group, shm_dir=shm_dir)


def new_receiver(name: str, *, group=None) -> Receiver:
    """A receiver for transport ``name`` (see ``Receiver.create``)."""
    return get_transport(name).receiver.create(group=group)


def link_group(name: str, side_band):
    """The group of ``side_band`` that transport ``name``'s bytes travel over (None if it needs none)."""
    entry = get_transport(name)
    if side_band is None or not entry.needs_group:
        return None
    return side_band.group_for(entry.group_backend)
