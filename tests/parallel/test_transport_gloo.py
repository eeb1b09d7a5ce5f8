"""parallel.transport over a real side band: one sender and two receivers in spawned processes.

Per streamable transport (broadcast, shm), rank 0 streams mixed dtypes and shapes (one tensor
larger than the bucket) to ranks 1 and 2 (``RemoteWeightSender`` -> ``receive_stream``); then a
stream whose source fails after a few tensors, which every receiver must see as an abort; then
a full stream again. Required: every receiver gets exactly the sent bytes, bucket by bucket
within the bound, the aborted stream raises on every receiver with the sender's error, no
bucket file is left, and the stream after the abort still lands. The broadcast transport also
runs through a ``CallChannel`` whose call makes the receivers take the bucket.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed

WORLD = 3  # the sender and two receivers
BUCKET_BYTES = 4096
TIMEOUT_S = 120.0


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("t", torch.arange(6).view(2, 3).t()),  # non-contiguous
        ("mask", torch.tensor([True, False, True])),
        ("big", torch.randn(64, 64, generator=g)),  # 16 KiB: larger than a bucket, travels alone
        ("half", torch.randn(40, 20, generator=g).to(torch.float16)),
        ("ids", torch.arange(300, dtype=torch.int64)),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
    ]


def _failing(seed: int):
    for i, pair in enumerate(_weights(seed)):
        if i == 5:
            raise RuntimeError("export failed on purpose")
        yield pair


def _port_from_rank0(port):
    import torch.distributed as dist

    holder = [port]
    dist.broadcast_object_list(holder, src=0)  # run_distributed's default group, only to share the port
    return holder[0]


def _stream_rank(rank: int, world_size: int, transport: str, shm_dir: str):
    from parallel.transport import RemoteWeightSender, SideBand, receive_stream

    if rank == 0:
        sender = RemoteWeightSender(world_size, transport=transport, shm_dir=shm_dir, timeout_s=TIMEOUT_S)
        _port_from_rank0(sender.listen())
        sender.connect()
        first = sender.send(_weights(0), BUCKET_BYTES)
        try:
            sender.send(_failing(1), BUCKET_BYTES)
            error = "no error"
        except RuntimeError as exc:
            error = str(exc)
        again = sender.send(_weights(2), BUCKET_BYTES)
        sender.close()
        return {"first": first, "error": error, "again": again}
    port = _port_from_rank0(None)
    side_band = SideBand("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S).connect()
    first = [[(n, t.clone()) for n, t in bucket] for bucket in receive_stream(side_band)]
    try:
        for _ in receive_stream(side_band):
            pass
        aborted = "no error"
    except RuntimeError as exc:
        aborted = str(exc)
    again = [[(n, t.clone()) for n, t in bucket] for bucket in receive_stream(side_band)]
    left = sorted(p.name for p in Path(shm_dir).iterdir())
    side_band.close()
    return {"first": first, "aborted": aborted, "again": again, "left": left}


def _call_channel_rank(rank: int, world_size: int):
    """Broadcast through a CallChannel: rank 0's call tells the receivers (over the default group)
    to take the bucket, and returns once they have."""
    import torch.distributed as dist

    from parallel.transport import CallChannel, SideBand, bucket_named_tensors, new_receiver, new_sender, transfer

    side_band = SideBand("127.0.0.1", 0, rank, world_size, timeout_s=TIMEOUT_S)
    side_band.port = _port_from_rank0(side_band.listen() if rank == 0 else None)
    side_band.connect()
    if rank == 0:
        sender = new_sender("broadcast", group=side_band.data_group)

        def call(meta):
            dist.broadcast_object_list([meta], src=0)  # "RPC": the receivers take it now
            dist.barrier()  # ... and have taken it when this returns

        stats = transfer(sender, bucket_named_tensors(_weights(3), BUCKET_BYTES), CallChannel(call))
        dist.broadcast_object_list([None], src=0)
        return stats.as_dict()
    receiver = new_receiver("broadcast", group=side_band.data_group)
    got = []
    while True:
        holder = [None]
        dist.broadcast_object_list(holder, src=0)
        if holder[0] is None:
            return got
        got.append([(n, t.clone()) for n, t in receiver.receive_bucket(holder[0])])
        dist.barrier()


def _check_buckets(buckets, weights) -> None:
    from parallel.transport import bucket_named_tensors

    expected = list(bucket_named_tensors(weights, BUCKET_BYTES))
    assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in b] for b in expected]
    for b in buckets:
        assert sum(t.numel() * t.element_size() for _, t in b) <= BUCKET_BYTES or len(b) == 1
    got = dict(p for b in buckets for p in b)
    for name, t in weights:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(prefix="test_transport_gloo_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield path
    os.rmdir(path)  # fails if a bucket file was left behind


@pytest.mark.parametrize("transport", ["broadcast", "shm"])
def test_stream_round_trip_abort_and_recovery(transport, shm_dir):
    sender, *receivers = run_distributed(_stream_rank, WORLD, transport, shm_dir, timeout_s=TIMEOUT_S)
    total = sum(t.numel() * t.element_size() for _, t in _weights(0))
    assert (sender["first"]["transport"], sender["first"]["bytes"]) == (transport, total)
    assert sender["first"]["num_tensors"] == len(_weights(0)) and sender["first"]["seconds"] > 0
    assert sender["error"] == "export failed on purpose"
    for got in receivers:
        _check_buckets(got["first"], _weights(0))
        assert len(got["first"]) == sender["first"]["num_buckets"] == 3  # ..., big alone, ...
        assert got["aborted"] == "weight sync aborted by the sender: RuntimeError: export failed on purpose"
        _check_buckets(got["again"], _weights(2))
        assert got["left"] == []  # every bucket file was unlinked, the aborted stream's too


def test_broadcast_through_a_call_channel():
    stats, *receivers = run_distributed(_call_channel_rank, WORLD, timeout_s=TIMEOUT_S)
    for got in receivers:
        _check_buckets(got, _weights(3))
    assert stats["num_buckets"] == len(receivers[0]) and stats["transport"] == "broadcast"
