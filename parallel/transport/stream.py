"""A whole sync as one self-describing stream over a ``SideBand``, to receivers in other processes.

Sender (rank 0 of the side band) and receivers (ranks 1..n, e.g. every vLLM worker of every
rollout replica) run concurrently: ``RemoteWeightSender.send(weights, bucket_bytes)`` on one
side, ``receive_stream(side_band, ...)`` on the other. On the control group every bucket is

    header {"kind": "bucket", "transport": name, "message": <the transport's JSON message>}
    ... the transport's own traffic (broadcast: the tensors, over the data group) ...
    ack    (all ranks meet once every receiver holds the bucket; the sender may release it)

and the stream ends with ``{"kind": "end"}``, or ``{"kind": "abort", "error"}`` when the sender
failed, which makes every receiver raise ``RuntimeError("weight sync aborted by the sender:
...")``. Only ``streamable`` transports (``shm``, ``broadcast``, ``nccl``, ``cuda_ipc``) can stream.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

from parallel.transport.transport_base import Receiver
from parallel.transport.buckets import Bucket, bucket_named_tensors
from parallel.transport.execution import transfer
from parallel.transport.gloo import DEFAULT_TIMEOUT_S, SideBand, ack, recv_header, send_header
from parallel.transport.cuda import require_cuda
from parallel.transport.transport_registry import STREAMABLE, get_transport, link_group, new_receiver

__all__ = ["StreamChannel", "RemoteWeightSender", "receive_stream", "stream_receivers"]


class StreamChannel:
    """The sender's end of the stream: headers and acknowledgements over ``control_group``."""

    pipelined = True

    def __init__(self, control_group, transport: str):
        self.group, self.transport = control_group, transport

    def deliver(self, message: Any) -> None:
        send_header(self.group, {"kind": "bucket", "transport": self.transport, "message": message})

    def wait_taken(self) -> None:
        ack(self.group)

    def end(self) -> None:
        send_header(self.group, {"kind": "end"})

    def abort(self, error: str) -> None:
        send_header(self.group, {"kind": "abort", "error": error})


def stream_receivers(side_band: SideBand) -> Callable[[str], Receiver]:
    """``name -> Receiver`` over ``side_band``'s data group, one receiver per transport, made on first use."""
    made: dict[str, Receiver] = {}

    def receiver(name: str) -> Receiver:
        if name not in made:
            get_transport(name, allowed=STREAMABLE)
            made[name] = new_receiver(name, group=link_group(name, side_band))
        return made[name]

    return receiver


def receive_stream(side_band: SideBand, receiver_for: Optional[Callable[[str], Receiver]] = None) -> Iterator[Bucket]:
    """Yield the buckets of one stream as they arrive, until its end; raises if the sender aborted.

    Each bucket is acknowledged as soon as it is held (mapped / received), before it is yielded,
    so the sender prepares the next one while the caller loads this one.
    """
    if not side_band.connected:
        raise RuntimeError("receive_stream before the side band is connected")
    receiver_for = receiver_for or stream_receivers(side_band)
    group = side_band.control_group
    while True:
        header = recv_header(group)
        kind = header["kind"]
        if kind == "end":
            return
        if kind == "abort":
            raise RuntimeError(f"weight sync aborted by the sender: {header.get('error')}")
        if kind != "bucket":
            raise ValueError(f"weight stream header kind {kind!r} is unknown; allowed: 'bucket', 'end', 'abort'")
        bucket = receiver_for(header["transport"]).receive_bucket(header["message"])
        ack(group)  # held: the sender may release its copy
        yield bucket


class RemoteWeightSender:
    """Rank 0 of a side band: streams buckets to receivers in other processes.

    Args:
        world_size: 1 + the number of receiving processes (every vLLM worker of every replica).
        transport: a streamable transport (``broadcast``, ``shm``, ``nccl`` or ``cuda_ipc``).
        master_addr: the address receivers reach this process at; ``port=0`` lets the OS pick.
        shm_dir: the tmpfs directory of the ``shm`` transport's files (required for it).
    """

    def __init__(
        self,
        world_size: int,
        *,
        transport: str,
        master_addr: str = "127.0.0.1",
        port: int = 0,
        shm_dir: Optional[str] = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.entry = get_transport(transport, allowed=STREAMABLE)
        receivers = world_size - 1  # every bucket's header reaches every receiver of the side band
        if self.entry.max_receivers is not None and receivers > self.entry.max_receivers:
            raise ValueError(
                f"checkpoint_engine.backend={transport!r} hands each bucket to at most "
                f"{self.entry.max_receivers} receiving process(es); this side band has {receivers} "
                "(every vLLM worker receives every header): one CUDA IPC handle opened by several "
                "processes breaks torch's per-handle reference counting; use 'nccl' for a rollout "
                "with more than one worker"
            )
        if self.entry.requires_cuda:
            require_cuda(transport)  # before any port is bound
        self.transport = transport
        self.side_band = SideBand(
            master_addr, port, 0, world_size, timeout_s=timeout_s, nccl=self.entry.group_backend == "nccl"
        )
        self.shm_dir = shm_dir
        # A transport without a group is built (and its settings checked) now, one with a group once connected.
        self._sender = None if self.entry.needs_group else self.entry.sender.create(shm_dir=shm_dir)

    @property
    def group(self):
        """The control group once connected, else None."""
        return self.side_band.control_group

    def listen(self) -> int:
        """Host the side band's store without waiting for anyone; returns its port."""
        return self.side_band.listen()

    def connect(self) -> None:
        """Join the side band as rank 0; blocks until all ``world_size`` ranks have joined."""
        self.side_band.connect()
        if self._sender is None:
            self._sender = self.entry.sender.create(
                group=link_group(self.transport, self.side_band), shm_dir=self.shm_dir
            )

    def send(self, weights: Iterable[Any], bucket_bytes: int) -> dict[str, Any]:
        """Stream ``(hf_name, tensor)`` pairs (or buckets) as buckets of at most ``bucket_bytes``.

        Returns ``TransferStats.as_dict()``: ``{"transport", "bytes", "num_tensors", "num_buckets", "seconds"}``.
        """
        if not self.side_band.connected:
            raise RuntimeError("RemoteWeightSender.send before connect()")
        channel = StreamChannel(self.side_band.control_group, self.transport)
        return transfer(self._sender, bucket_named_tensors(weights, bucket_bytes), channel).as_dict()

    def close(self) -> None:
        """Leave the side band."""
        self.side_band.close()
