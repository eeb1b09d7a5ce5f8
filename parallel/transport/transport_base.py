"""The transport protocol: a sender half on the exporting rank, a receiver half where tensors load.

A transport moves one *bucket* of ``(hf_name, tensor)`` pairs at a time (see ``buckets``):

    sender:   message = send_bucket(bucket)    start moving it; never waits for a receiver
              ... the message reaches every receiver over a Channel ...
    receiver: bucket  = receive_bucket(message)
    sender:   release()                        once the channel says every receiver has taken
                                               the oldest outstanding bucket: free what held it
              abort()                          after a failure: drop what is outstanding

The *message* is what a receiver needs to find the bucket: the tensors themselves
(colocated), a safetensors blob (bytes), a file path (shm), or the bucket's flat layout while
the bytes follow over a group (broadcast). Who carries the message is the ``Channel``'s
business (``execution.transfer``): a synchronous call such as an RPC into an engine's workers
(``CallChannel``), or the side band's control group for receivers in other processes
(``stream.StreamChannel``; only ``streamable`` transports, whose messages are JSON).

This is the plan / execution / copy-service split of Megatron-LM's
``megatron/core/resharding``: the bridge's export is the plan (built once, collectively),
``execution.transfer`` the execution, and a ``Transport`` the copy service.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional

from parallel.transport.buckets import Bucket, nbytes

__all__ = ["Sender", "Receiver", "Transport", "TransferStats"]


class Sender(abc.ABC):
    """The exporting side of a transport (one per link; reused for every sync)."""

    name: str = ""

    @classmethod
    def create(cls, *, group=None, shm_dir: Optional[str] = None) -> "Sender":
        """Build from what the link offers: ``group`` (a side-band data group whose rank 0 is
        this process) and ``shm_dir`` (a tmpfs directory). Each transport takes what it needs."""
        return cls()

    @abc.abstractmethod
    def send_bucket(self, bucket: Bucket) -> Any:
        """Start moving ``bucket``; return the message its receivers need. Must not wait for them."""

    def release(self) -> None:
        """Every receiver has taken the oldest outstanding bucket: free what still holds it."""

    def abort(self) -> None:
        """Drop every outstanding bucket after a failure (best effort, no receiver involved)."""


class Receiver(abc.ABC):
    """The loading side of a transport (one per receiving process and transport)."""

    name: str = ""

    @classmethod
    def create(cls, *, group=None) -> "Receiver":
        """Build from what the link offers: ``group`` (the side-band data group)."""
        return cls()

    @abc.abstractmethod
    def receive_bucket(self, message: Any) -> Bucket:
        """The bucket ``message`` describes, as ``(hf_name, tensor)`` pairs (views where possible).

        The tensors stay valid after the sender's ``release``."""


@dataclasses.dataclass(frozen=True)
class Transport:
    """A registry entry: a name, its two halves, and where it can run."""

    name: str
    sender: type[Sender]
    receiver: type[Receiver]
    streamable: bool
    """Its messages are JSON, so they can travel as stream headers to receivers in other processes."""
    same_process: bool
    """Receivers must live in the sender's process (tensors pass by reference)."""
    needs_group: bool
    """Its bytes travel over a group of the side band's ranks (connect one before the first bucket)."""
    summary: str
    group_backend: str = "gloo"
    """Which group of the side band carries its bytes (``SideBand.group_for``): ``gloo`` or ``nccl``."""
    requires_cuda: bool = False
    """Both halves need CUDA (``parallel.transport.cuda.require_cuda``)."""
    max_receivers: Optional[int] = None
    """How many receiving processes one message may reach (None: any). ``cuda_ipc``: 1 -- torch counts
    a CUDA IPC handle's consumers per handle, so a handle opened by two processes frees too early."""


@dataclasses.dataclass
class TransferStats:
    """What one transfer moved; every transport reports the same fields."""

    transport: str
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    seconds: float = 0.0

    def add(self, bucket: Bucket) -> None:
        self.num_buckets += 1
        self.num_tensors += len(bucket)
        self.bytes += sum(nbytes(t) for _, t in bucket)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
