"""NCCL transport: tensor bytes broadcast GPU to GPU from the export rank to the rollout workers.

For engines on other GPUs (separate placement; verl's ``checkpoint_engine.backend=nccl``). The
protocol is the gloo ``broadcast`` transport's -- the message is the bucket's flat layout
(``bucket_meta``), one asynchronous broadcast per tensor straight from its memory, each receiver
receiving into one flat ``uint8`` buffer per bucket -- over an NCCL group of the side band's
ranks (``SideBand.group_for("nccl")``, built lazily over the same store). Receivers allocate on
their current CUDA device; the work is ordered on the current stream before the views are
returned. ``release`` also waits for the sender's stream, so a tensor the export frees next is
not reused while NCCL still reads it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from parallel.transport.transport_base import Receiver
from parallel.transport.broadcast import BroadcastSender
from parallel.transport.buckets import Bucket, unpack_bucket
from parallel.transport.cuda import require_cuda
from parallel.transport.gloo import broadcast

__all__ = ["NcclSender", "NcclReceiver"]


def _need_group(group, side: str) -> None:
    if group is None:
        raise ValueError(
            f"the nccl transport's {side} needs the side band's NCCL group: connect a SideBand first "
            f"(SideBand.group_for('nccl'))"
        )


class NcclSender(BroadcastSender):
    """Rank 0 of an NCCL ``group``: the gloo ``broadcast`` sender's protocol (the message is the
    bucket's ``bucket_meta``), for CUDA tensors, waiting for the stream on release."""

    name = "nccl"

    def __init__(self, group, cuda_available: Optional[bool] = None):
        require_cuda(self.name, cuda_available)
        _need_group(group, "sender")
        super().__init__(group)

    @classmethod
    def create(cls, *, group=None, shm_dir: Optional[str] = None) -> "NcclSender":
        require_cuda(cls.name)
        return cls(group)

    def send_bucket(self, bucket: Bucket) -> dict[str, Any]:
        off_gpu = sorted({f"{n} ({t.device})" for n, t in bucket if t.device.type != "cuda"})
        if off_gpu:
            raise ValueError(f"the nccl transport sends CUDA tensors; not on a GPU: {off_gpu[:4]}")
        return super().send_bucket(bucket)

    def release(self) -> None:
        works = self._works[0]
        super().release()
        if works:  # the export may free a tensor next: NCCL must be done reading it
            torch.cuda.current_stream(works[0][1].device).synchronize()


class NcclReceiver(Receiver):
    """Receives each bucket into one flat CUDA ``uint8`` buffer laid out by the message."""

    name = "nccl"

    def __init__(self, group, cuda_available: Optional[bool] = None):
        require_cuda(self.name, cuda_available)
        _need_group(group, "receiver")
        self.group = group

    @classmethod
    def create(cls, *, group=None) -> "NcclReceiver":
        require_cuda(cls.name)
        return cls(group)

    def receive_bucket(self, message: dict[str, Any]) -> Bucket:
        flat = torch.empty(int(message["total_bytes"]), dtype=torch.uint8, device=torch.cuda.current_device())
        works = [broadcast(self.group, flat[e["offset"] : e["offset"] + e["nbytes"]]) for e in message["tensors"]]
        for work in works:
            work.wait()  # the current stream waits for NCCL's: the views are ready for whatever runs next
        return unpack_bucket(flat, message)
