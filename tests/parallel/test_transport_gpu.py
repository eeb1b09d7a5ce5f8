"""The GPU transports (``nccl``, ``cuda_ipc``): on CPU their handle format, message checks and bad
input; on a GPU (``@pytest.mark.gpu``) real CUDA IPC between two processes and NCCL between two GPUs."""

from __future__ import annotations

import base64
import json
import multiprocessing

import pytest
import torch

from parallel.transport import STREAMABLE, RemoteWeightSender, new_receiver, new_sender
from parallel.transport.cuda import local_index, require_cuda
from parallel.transport.cuda_ipc import (
    HANDLE_FIELDS,
    CudaIpcReceiver,
    CudaIpcSender,
    check_layout,
    pack_handle,
    unpack_handle,
)
from parallel.transport.nccl import NcclReceiver, NcclSender

UUIDS = ["GPU-aaaa", "GPU-bbbb"]


def rebuild_args(device: int = 1) -> tuple:
    """rebuild_cuda_tensor's arguments with the types reduce_tensor gives them for a CUDA buffer."""
    return (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        b"\x00\x01ipc-mem-handle\xff",
        2 * 1024 * 1024,
        512,
        False,
        b"/torch_ref_counter_1234",
        7,
        b"\x10event-handle",
        True,
    )


def test_a_handle_packs_to_json_and_unpacks_onto_this_process_gpu_index():
    packed = pack_handle(rebuild_args(device=1), uuid="GPU-bbbb")
    wire = json.loads(json.dumps(packed))  # it travels as a stream header
    assert set(wire) == {f for f, _ in HANDLE_FIELDS} | {"device_uuid"}
    assert wire["storage_handle"] == base64.b64encode(b"\x00\x01ipc-mem-handle\xff").decode()
    assert (wire["tensor_cls"], wire["storage_cls"], wire["dtype"]) == ("Tensor", "TypedStorage", "uint8")
    # The receiver numbers the sender's GPU by its UUID: here it is its device 0, not the sender's 1.
    args = unpack_handle(wire, visible=["GPU-bbbb"])
    expected = list(rebuild_args())
    expected[6] = 0
    assert args == tuple(expected)
    assert isinstance(args[1], torch.Size) and args[0] is torch.Tensor and args[5] is torch.uint8


def test_a_malformed_or_foreign_handle_is_refused_before_anything_is_mapped():
    good = pack_handle(rebuild_args(), uuid="GPU-bbbb")
    with pytest.raises(
        ValueError,
        match=r"cuda_ipc: the sender's GPU GPU-bbbb is not visible to this process "
        r"\(visible: \['GPU-aaaa'\]\); CUDA IPC needs the receiving engine on "
        r"the sender's GPU \(colocated\), across GPUs use 'nccl'",
    ):
        unpack_handle(good, visible=["GPU-aaaa"])
    cases = [
        ({k: v for k, v in good.items() if k != "storage_handle"}, r"cuda_ipc handle fields .* differ from"),
        ({**good, "storage_handle": "not base64!"}, r"field 'storage_handle'='not base64!' is not base64 bytes"),
        ({**good, "dtype": "float99"}, r"field 'dtype'='float99' is not a torch dtype name"),
        ({**good, "tensor_cls": "ndarray"}, r"field 'tensor_cls'='ndarray' is not one of \['Parameter', 'Tensor',"),
        ({**good, "storage_size_bytes": -1}, r"field 'storage_size_bytes'=-1 is not a non-negative int"),
        ({**good, "tensor_size": [4, "x"]}, r"field 'tensor_size'=\[4, 'x'\] is not a list of non-negative ints"),
        ({**good, "requires_grad": 1}, r"field 'requires_grad'=1 is not a bool"),
        ("handle", r"cuda_ipc handle must be a dict, got str"),
    ]
    for handle, message in cases:
        with pytest.raises(ValueError, match=message):
            unpack_handle(handle, visible=UUIDS)
    with pytest.raises(ValueError, match=r"expected the 15 arguments of rebuild_cuda_tensor, got 3"):
        pack_handle((1, 2, 3), uuid="GPU-aaaa")
    with pytest.raises(ValueError, match=r"cannot pack class <class 'dict'>"):
        pack_handle((dict,) + rebuild_args()[1:], uuid="GPU-aaaa")
    assert local_index("GPU-bbbb", UUIDS) == 1


def test_a_layout_must_lie_inside_the_shared_buffer():
    from parallel.transport import bucket_meta

    layout = bucket_meta([("a", torch.zeros(10)), ("b", torch.zeros(3, dtype=torch.bfloat16))])
    check_layout(layout, 4096)  # 40 B at 0, 6 B at 64: fits
    with pytest.raises(ValueError, match=r"total_bytes=128 exceeds the shared buffer \(100 bytes\)"):
        check_layout(layout, 100)
    bad = {"tensors": [{"name": "a", "offset": 120, "nbytes": 40}], "total_bytes": 128}
    with pytest.raises(ValueError, match=r"does not lie inside total_bytes=128"):
        check_layout(bad, 4096)
    with pytest.raises(ValueError, match=r"must be bucket_meta's dict"):
        check_layout([], 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_gpu_transports_without_cuda_are_refused_by_key_before_anything_is_built():
    message = (
        r"checkpoint_engine.backend='{}' needs CUDA, but torch.cuda.is_available\(\) is False in this "
        r"process \(torch .*\); without a GPU choose one of \['colocated', 'bytes', 'shm', 'broadcast'\]"
    )
    for name in ("nccl", "cuda_ipc"):
        assert name in STREAMABLE
        with pytest.raises(ValueError, match=message.format(name)):
            new_sender(name, group=object())
        with pytest.raises(ValueError, match=message.format(name)):
            new_receiver(name, group=object())
        with pytest.raises(ValueError, match=message.format(name)):
            RemoteWeightSender(2, transport=name)  # before any port is bound
    with pytest.raises(ValueError, match=message.format("nccl")):
        require_cuda("nccl")


def test_gpu_halves_check_their_link_and_tensors():
    with pytest.raises(ValueError, match=r"the nccl transport's sender needs the side band's NCCL group"):
        NcclSender(None, cuda_available=True)
    with pytest.raises(ValueError, match=r"the nccl transport's receiver needs the side band's NCCL group"):
        NcclReceiver(None, cuda_available=True)
    with pytest.raises(ValueError, match=r"the nccl transport sends CUDA tensors; not on a GPU: \['w \(cpu\)'\]"):
        NcclSender(object(), cuda_available=True).send_bucket([("w", torch.ones(2))])
    with pytest.raises(
        ValueError,
        match=r"cuda_ipc sends CUDA tensors of one GPU per bucket; this bucket's are on "
        r"\['cpu'\]",
    ):
        CudaIpcSender(cuda_available=True).send_bucket([("w", torch.ones(2))])
    receiver = CudaIpcReceiver(cuda_available=True)
    receiver._visible = UUIDS
    with pytest.raises(ValueError, match=r"cuda_ipc message must be \{'handle', 'layout'\}"):
        receiver.receive_bucket({"path": "/dev/shm/x"})
    with pytest.raises(ValueError, match=r"the sender's GPU GPU-cccc is not visible"):  # raised before mapping
        receiver.receive_bucket({"handle": pack_handle(rebuild_args(), uuid="GPU-cccc"), "layout": {}})


# ----------------------------------------------------------------------------- on a GPU
def _ipc_receiver(queue, results):
    """Child process: rebuild each bucket from its handle, return the tensors' sums."""
    receiver = new_receiver("cuda_ipc")
    while True:
        message = queue.get()
        if message is None:
            return
        bucket = receiver.receive_bucket(json.loads(message))
        results.put([(n, t.dtype == torch.bfloat16, float(t.float().sum())) for n, t in bucket])
        del bucket


@pytest.mark.gpu
def test_cuda_ipc_between_two_processes_on_one_gpu():
    from parallel.transport import CallChannel, bucket_named_tensors, transfer

    ctx = multiprocessing.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_receiver, args=(queue, results))
    child.start()
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [(f"w{i}", torch.randn(64, 32 + i, device="cuda", generator=g)) for i in range(6)]
    weights.append(("bf", torch.randn(17, device="cuda", generator=g).bfloat16()))
    got = []

    def call(message):  # the engine's RPC: returns once the receiver holds the bucket
        queue.put(json.dumps(message))
        got.extend(results.get(timeout=60))

    stats = transfer(new_sender("cuda_ipc"), bucket_named_tensors(weights, 20_000), CallChannel(call))
    queue.put(None)
    child.join(60)
    assert child.exitcode == 0 and stats.num_buckets > 1
    assert [(n, bf) for n, bf, _ in got] == [(n, t.dtype == torch.bfloat16) for n, t in weights]
    assert all(abs(s - float(t.float().sum())) < 1e-3 for (_, _, s), (_, t) in zip(got, weights))


def _nccl_rank(rank, port, results):
    from parallel.transport import SideBand, receive_stream

    torch.cuda.set_device(rank)
    if rank == 0:
        sender = RemoteWeightSender(2, transport="nccl", port=port)
        sender.connect()
        weights = [(f"w{i}", torch.full((1000 + i,), float(i), device="cuda")) for i in range(5)]
        results.put(sender.send(weights, bucket_bytes=8192))
        sender.close()
    else:
        band = SideBand("127.0.0.1", port, 1, 2).connect()
        results.put([(n, float(t.sum()), str(t.device)) for b in receive_stream(band) for n, t in b])
        band.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two processes needs two GPUs")
def test_nccl_stream_between_two_gpus():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    stats = next(o for o in out if isinstance(o, dict))
    received = next(o for o in out if isinstance(o, list))
    assert stats["transport"] == "nccl" and stats["num_tensors"] == 5
    assert received == [(f"w{i}", float(i * (1000 + i)), "cuda:1") for i in range(5)]
