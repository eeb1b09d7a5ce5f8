"""parallel.transport without a process group: buckets, wire formats, the registry, the colocated /
bytes / shm transports through ``transfer`` over a synchronous channel, and the pipelined order."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from parallel.transport import (
    RESERVED,
    STREAMABLE,
    TRANSPORTS,
    CallChannel,
    bucket_meta,
    bucket_named_tensors,
    get_transport,
    new_receiver,
    new_sender,
    safetensors_views,
    serialize_safetensors,
    transfer,
    unpack_bucket,
    write_safetensors,
)
from parallel.transport.shm import SHM_PREFIX

BUCKET_BYTES = 4096


def mixed_weights() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes; ``big`` (16 KiB) is larger than a bucket; ``t`` is non-contiguous."""
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("t", torch.arange(6).view(2, 3).t()),
        ("mask", torch.tensor([True, False, True])),
        ("half", torch.randn(4, 4, generator=g).to(torch.float16)),
        ("big", torch.randn(64, 64, generator=g)),
        ("fp8", torch.randn(8, generator=g).to(torch.float8_e4m3fn)),
        ("bytes", torch.arange(10, dtype=torch.uint8)),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
    ]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (exact, and defined for every dtype incl. float8)."""
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="test_transport_", dir=base)
    yield path
    os.rmdir(path)  # fails if a bucket file was left behind


# ----------------------------------------------------------------------------- buckets and wire formats
def test_buckets_are_bounded_streamed_and_typed():
    named = [(f"w{i}", torch.full((i + 1, 10), float(i))) for i in range(6)]  # 40, 80, ..., 240 bytes
    buckets = list(bucket_named_tensors(iter(named), bucket_bytes=200))
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5"]]  # w5 (240 B) alone
    as_buckets = list(bucket_named_tensors([named[:2], named[2:]], bucket_bytes=200))  # buckets in, re-bucketed
    assert [[n for n, _ in b] for b in as_buckets] == [[n for n, _ in b] for b in buckets]
    with pytest.raises(
        TypeError, match=r"weights item 1 must be a \(hf_name: str, tensor: torch.Tensor\) pair, got list"
    ):
        list(bucket_named_tensors([("a", torch.ones(1)), ["b", torch.ones(1)]], 100))
    with pytest.raises(ValueError, match=r"bucket_bytes=0 must be > 0"):
        next(bucket_named_tensors(named, 0))


def test_wire_formats_round_trip_exactly(tmp_path):
    from safetensors.torch import load, load_file

    bucket = [
        ("a.weight", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("c", torch.arange(6).view(2, 3).t()),
        ("d", torch.tensor([True, False])),
    ]  # c is non-contiguous
    meta = bucket_meta(bucket)
    assert all(e["offset"] % 64 == 0 for e in meta["tensors"])
    flat = torch.zeros(meta["total_bytes"], dtype=torch.uint8)
    for (_, t), e in zip(bucket, meta["tensors"]):
        flat[e["offset"] : e["offset"] + e["nbytes"]] = t.contiguous().reshape(-1).view(torch.uint8)
    blob = serialize_safetensors(bucket)
    write_safetensors(str(tmp_path / "b.safetensors"), bucket)
    for decoded in (
        dict(unpack_bucket(flat, meta)),
        dict(safetensors_views(torch.frombuffer(blob, dtype=torch.uint8))),
        load(bytes(blob)),
        load_file(str(tmp_path / "b.safetensors")),
    ):  # readable by safetensors too
        assert all(decoded[n].dtype == t.dtype and torch.equal(decoded[n], t) for n, t in bucket)
    with pytest.raises(ValueError, match=r"tensor name 'a.weight' appears twice in one bucket"):
        serialize_safetensors(bucket[:1] * 2)


def test_a_bucket_holds_at_most_the_bound_unless_one_tensor_is_larger():
    weights = mixed_weights()
    buckets = list(bucket_named_tensors(weights, BUCKET_BYTES))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in weights]  # order kept, nothing lost
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= BUCKET_BYTES or len(b) == 1, [n for n, _ in b]
    assert [n for n, _ in next(b for b in buckets if b[0][0] == "big")] == ["big"]  # 16 KiB travels alone


# ----------------------------------------------------------------------------- registry
def test_registry_names_every_transport_gpu_ones_included():
    assert list(TRANSPORTS) == ["colocated", "bytes", "shm", "broadcast", "nccl", "cuda_ipc"]
    assert STREAMABLE == ("broadcast", "cuda_ipc", "nccl", "shm")
    assert [n for n, t in TRANSPORTS.items() if t.same_process] == ["colocated"]
    assert [n for n, t in TRANSPORTS.items() if t.needs_group] == ["broadcast", "nccl"]
    assert [(n, t.group_backend) for n, t in TRANSPORTS.items() if t.needs_group] == [
        ("broadcast", "gloo"),
        ("nccl", "nccl"),
    ]
    assert [n for n, t in TRANSPORTS.items() if t.requires_cuda] == ["nccl", "cuda_ipc"]
    assert RESERVED == {}  # nccl and cuda_ipc were reserved until built
    with pytest.raises(
        ValueError,
        match=r"^transport='gpu' is not allowed; choose one of "
        r"\['colocated', 'bytes', 'shm', 'broadcast', 'nccl', 'cuda_ipc'\]$",
    ):
        get_transport("gpu")
    with pytest.raises(
        ValueError,
        match=r"transport='bytes' is not allowed; choose one of "
        r"\['broadcast', 'cuda_ipc', 'nccl', 'shm'\]",
    ):
        get_transport("bytes", allowed=STREAMABLE)


def test_halves_say_what_their_link_lacks(tmp_path):
    with pytest.raises(ValueError, match=r"the shm transport needs shm_dir"):
        new_sender("shm")
    with pytest.raises(ValueError, match=r"shm_dir='.*missing' is not a directory"):
        new_sender("shm", shm_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"broadcast transport's sender needs the side band's data group"):
        new_sender("broadcast")
    with pytest.raises(ValueError, match=r"broadcast transport's receiver needs the side band's data group"):
        new_receiver("broadcast")


# ----------------------------------------------------------------------------- one process, synchronous channel
@pytest.mark.parametrize("name", ["colocated", "bytes", "shm"])
def test_round_trip_through_a_call_channel(name, shm_dir):
    weights = mixed_weights()
    sender, receiver = new_sender(name, shm_dir=shm_dir), new_receiver(name)
    received, files_seen = [], []

    def call(message):  # the receivers' side of an RPC: take the bucket, return when done
        if name == "shm":
            files_seen.append(sorted(p.name for p in Path(shm_dir).iterdir()))
        received.append([(n, t.clone()) for n, t in receiver.receive_bucket(message)])

    stats = transfer(sender, bucket_named_tensors(weights, BUCKET_BYTES), CallChannel(call))
    expected = list(bucket_named_tensors(weights, BUCKET_BYTES))
    assert [[n for n, _ in b] for b in received] == [[n for n, _ in b] for b in expected]
    got = dict(p for b in received for p in b)
    assert all(_equal(got[n], t) for n, t in weights)
    assert (stats.transport, stats.num_tensors, stats.num_buckets) == (name, len(weights), len(expected))
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in weights) and stats.seconds > 0
    assert set(stats.as_dict()) == {"transport", "bytes", "num_tensors", "num_buckets", "seconds"}
    if name == "shm":  # exactly one bucket file exists while it is being taken, none afterwards
        assert all(len(seen) == 1 and seen[0].startswith(SHM_PREFIX) for seen in files_seen)
        assert list(Path(shm_dir).iterdir()) == []


def test_colocated_passes_the_tensors_themselves():
    weights = mixed_weights()
    got = []
    transfer(
        new_sender("colocated"),
        bucket_named_tensors(weights, BUCKET_BYTES),
        CallChannel(lambda m: got.extend(new_receiver("colocated").receive_bucket(m))),
    )
    assert all(a is b for (_, a), (_, b) in zip(got, weights))


@pytest.mark.parametrize("fail_in", ["source", "channel"])
def test_a_failed_transfer_raises_and_leaves_no_file(fail_in, shm_dir):
    def source():
        for i, pair in enumerate(mixed_weights()):
            if fail_in == "source" and i == 6:  # bucket 3 (big) is not complete yet
                raise RuntimeError("export failed on purpose")
            yield pair

    calls = []

    def call(message):
        calls.append(message["path"])
        assert os.path.exists(message["path"])
        if fail_in == "channel" and len(calls) == 2:
            raise RuntimeError("receiver failed on purpose")

    with pytest.raises(RuntimeError, match=f"{'export' if fail_in == 'source' else 'receiver'} failed on purpose"):
        transfer(new_sender("shm", shm_dir=shm_dir), bucket_named_tensors(source(), 100), CallChannel(call))
    assert len(calls) >= 2 and list(Path(shm_dir).iterdir()) == []


# ----------------------------------------------------------------------------- the pipelined order
class _RecordingSender:
    name = "recording"

    def __init__(self, events):
        self.events, self.sent, self.released = events, 0, 0

    def send_bucket(self, bucket):
        self.sent += 1
        self.events.append(f"send{self.sent}")
        assert self.sent - self.released <= 2  # at most two buckets outstanding
        return self.sent

    def release(self):
        self.released += 1
        self.events.append(f"release{self.released}")

    def abort(self):
        self.events.append("abort")


class _RecordingChannel:
    def __init__(self, events, pipelined):
        self.events, self.pipelined, self.acks = events, pipelined, 0

    def deliver(self, message):
        self.events.append(f"deliver{message}")

    def wait_taken(self):
        self.acks += 1
        self.events.append(f"ack{self.acks}")

    def end(self):
        self.events.append("end")

    def abort(self, error):
        self.events.append(f"abort: {error}")


def test_a_pipelined_channel_prepares_the_next_bucket_before_confirming_the_last():
    buckets = [[("x", torch.ones(1))]] * 3
    events: list[str] = []
    transfer(_RecordingSender(events), buckets, _RecordingChannel(events, pipelined=True))
    assert events == [
        "send1",
        "deliver1",
        "send2",
        "ack1",
        "release1",
        "deliver2",
        "send3",
        "ack2",
        "release2",
        "deliver3",
        "ack3",
        "release3",
        "end",
    ]
    events.clear()
    transfer(_RecordingSender(events), buckets, _RecordingChannel(events, pipelined=False))
    assert events == [
        "send1",
        "deliver1",
        "ack1",
        "release1",
        "send2",
        "deliver2",
        "ack2",
        "release2",
        "send3",
        "deliver3",
        "ack3",
        "release3",
        "end",
    ]


def test_a_failure_meets_the_owed_acks_then_aborts():
    def source():
        yield [("x", torch.ones(1))]
        raise ValueError("bad bucket")

    events: list[str] = []
    with pytest.raises(ValueError, match="bad bucket"):
        transfer(_RecordingSender(events), source(), _RecordingChannel(events, pipelined=True))
    assert events == ["send1", "deliver1", "ack1", "abort", "abort: ValueError: bad bucket"]
