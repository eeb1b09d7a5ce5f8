"""Broadcast transport: tensor bytes over the side band's gloo data group, from rank 0 to all.

The sender starts one asynchronous broadcast per tensor, straight from the tensor's memory
(no packing copy), and sends the bucket's flat layout (``bucket_meta``) as the message; each
receiver allocates one flat buffer per bucket, receives every tensor into its slot and reads
typed views of it. ``release`` completes the oldest bucket's broadcasts (the receivers have
them by then), which also drops the sender's references to its tensors.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch

from parallel.transport.transport_base import Receiver, Sender
from parallel.transport.buckets import Bucket, bucket_meta, host_bytes, unpack_bucket
from parallel.transport.gloo import broadcast

__all__ = ["BroadcastSender", "BroadcastReceiver"]


def _need_group(group, side: str) -> None:
    if group is None:
        raise ValueError(f"the broadcast transport's {side} needs the side band's data group: connect a SideBand first")


class BroadcastSender(Sender):
    """Rank 0 of ``group``; the message is the bucket's ``bucket_meta``."""

    name = "broadcast"

    def __init__(self, group):
        _need_group(group, "sender")
        self.group = group
        self._works: collections.deque[list[tuple[Any, torch.Tensor]]] = collections.deque()

    @classmethod
    def create(cls, *, group=None, shm_dir: Optional[str] = None) -> "BroadcastSender":
        return cls(group)

    def send_bucket(self, bucket: Bucket) -> dict[str, Any]:
        meta = bucket_meta(bucket)  # validates every tensor before the first byte goes out
        works = []
        for _, tensor in bucket:
            raw = host_bytes(tensor)  # gloo sends host memory: a GPU export tensor is copied once
            works.append((broadcast(self.group, raw), raw))  # raw stays referenced until sent
        self._works.append(works)
        return meta

    def release(self) -> None:
        for work, _ in self._works.popleft():
            work.wait()

    def abort(self) -> None:
        self._works.clear()  # gloo keeps the tensors of unfinished works alive itself


class BroadcastReceiver(Receiver):
    """Receives each bucket into one flat ``uint8`` buffer laid out by the message."""

    name = "broadcast"

    def __init__(self, group):
        _need_group(group, "receiver")
        self.group = group

    @classmethod
    def create(cls, *, group=None) -> "BroadcastReceiver":
        return cls(group)

    def receive_bucket(self, message: dict[str, Any]) -> Bucket:
        flat = torch.empty(int(message["total_bytes"]), dtype=torch.uint8)
        works = [broadcast(self.group, flat[e["offset"] : e["offset"] + e["nbytes"]]) for e in message["tensors"]]
        for work in works:
            work.wait()
        return unpack_bucket(flat, message)
