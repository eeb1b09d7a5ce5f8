"""Every transport's encode path with a non-CPU tensor, on a CPU machine.

torch's lazy-tensor device (its TorchScript backend, computed on the CPU) stands where a CUDA
export tensor would: it is not ``cpu``, and its ``.numpy()`` raises the very TypeError a CUDA
tensor's does ("can't convert ... device type tensor to numpy"). The host-reading transports
(``bytes``, ``shm``, ``broadcast`` over gloo) must copy such a tensor to the host once; what the
receivers get equals the source bit for bit. ``cuda_ipc`` refuses a stream that would hand one
handle to more than one receiving process.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from parallel.testing import run_distributed
from parallel.transport import get_transport
from parallel.transport.buckets import host_bytes
from parallel.transport.safetensors_format import serialize_safetensors, write_safetensors


def _bucket(device):
    g = torch.Generator().manual_seed(0)
    host = [
        ("w", torch.randn(5, 7, generator=g)),
        ("b", torch.randn(3, generator=g).bfloat16()),
        ("i", torch.arange(4, dtype=torch.int32)),
        ("empty", torch.zeros(0)),
    ]
    return host, [(name, t.to(device)) for name, t in host]


def _same(received, host):
    assert [n for n, _ in received] == [n for n, _ in host]
    for (_, got), (_, want) in zip(received, host):
        assert got.device.type == "cpu" and got.dtype == want.dtype and torch.equal(got, want)


def test_a_device_tensor_refuses_numpy_as_cuda_does(lazy):
    with pytest.raises(TypeError, match="can't convert lazy:0 device type tensor to numpy"):
        torch.ones(2, device=lazy).numpy()
    raw = host_bytes(torch.ones(2, device=lazy))
    assert raw.device.type == "cpu" and raw.numel() == 8
    cpu = torch.ones(2)
    assert host_bytes(cpu).data_ptr() == cpu.data_ptr()  # host tensors are not copied


def test_safetensors_blob_and_file_from_device_tensors(lazy, tmp_path):
    host, device = _bucket(lazy)
    blob = serialize_safetensors(device)
    _same(sorted(safetensors.torch.load(bytes(blob)).items()), sorted(host, key=lambda p: p[0]))
    path = tmp_path / "b.safetensors"
    size = write_safetensors(str(path), device)
    assert size == path.stat().st_size
    _same(sorted(safetensors.torch.load_file(str(path)).items()), sorted(host, key=lambda p: p[0]))


@pytest.mark.parametrize("name", ["bytes", "shm"])
def test_host_transports_send_device_tensors(lazy, tmp_path, name):
    host, device = _bucket(lazy)
    entry = get_transport(name)
    sender = entry.sender.create(shm_dir=str(tmp_path))
    received = entry.receiver.create().receive_bucket(sender.send_bucket(device))
    _same(received, host)
    sender.release()


def test_written_parameters_stay_resizable(tmp_path):
    """The file writer reads a tensor's memory without numpy: a parameter sent by reference can be
    offloaded afterwards (``resize_(0)``; after ``.numpy()`` it raises 'not resizable')."""
    param = torch.nn.Parameter(torch.randn(64))
    write_safetensors(str(tmp_path / "p.safetensors"), [("p", param.data)])
    param.data.untyped_storage().resize_(0)
    assert param.data.untyped_storage().nbytes() == 0


def _broadcast_case(rank, world_size):
    import torch._lazy.ts_backend
    import torch.distributed as dist

    from parallel.transport.broadcast import BroadcastReceiver, BroadcastSender

    torch._lazy.ts_backend.init()
    host, device = _bucket("lazy")
    group = dist.new_group(backend="gloo")
    meta = [BroadcastSender(group).send_bucket(device) if rank == 0 else None]
    dist.broadcast_object_list(meta, src=0)
    if rank == 0:
        return None
    got = BroadcastReceiver(group).receive_bucket(meta[0])
    return [(n, t.clone()) for n, t in got], host


def test_broadcast_sends_device_tensors_over_gloo():
    _, (got, host) = run_distributed(_broadcast_case, 2)
    _same(got, host)


def test_cuda_ipc_refuses_more_than_one_receiver_per_handle():
    from parallel.transport.stream import RemoteWeightSender

    with pytest.raises(
        ValueError,
        match=r"^checkpoint_engine.backend='cuda_ipc' hands each bucket to at most 1 "
        r"receiving process\(es\); this side band has 2",
    ):
        RemoteWeightSender(3, transport="cuda_ipc")  # refused before CUDA is even asked for
    with pytest.raises(ValueError, match="needs CUDA"):  # one receiver: on to the CUDA check (none here)
        RemoteWeightSender(2, transport="cuda_ipc")
    assert get_transport("cuda_ipc").max_receivers == 1 and get_transport("shm").max_receivers is None
