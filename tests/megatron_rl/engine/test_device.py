"""A role's inputs reach its model on the model's device; what a rank returns is in host memory.

The driver's batches are host tensors. On CPU every tensor is on one device, so a missing move
cannot show -- unless the model lives elsewhere: here a real role is built, its model moved to
``meta``, and the engine's device set to match (what ``MegatronEngine.device`` is on a GPU). A
forward pre-hook records every tensor the model is handed (token and position ids, the packed
sequence's ``cu_seqlens``) and stops the pass; each must be on ``meta``. The host side uses
torch's lazy-tensor device (TorchScript backend, runs on CPU): a real non-CPU device whose tensors
refuse ``.numpy()`` exactly as CUDA tensors do, and which ``MegatronWorker.call`` must bring back.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.engine.device import tensors_in, to_device, to_host
from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import DENSE, make_batch, make_role


class _Stop(Exception):
    """Raised by the hook once the model's inputs are recorded."""


def _inputs_seen_by_model(rank, world_size, remove_padding):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    role = make_role(
        "ref",
        DENSE,
        init_mesh(ParallelConfig(), seed=3),
        {"ppo_micro_batch_size_per_gpu": 4},
        remove_padding=remove_padding,
    )
    model = role.engine.model[0]
    model.to("meta")
    role.engine.device = torch.device("meta")  # where a GPU rank's engine says its model is
    seen = []

    def hook(module, args, kwargs):
        seen.extend(tensors_in((args, kwargs)))
        raise _Stop

    model.register_forward_pre_hook(hook, with_kwargs=True)
    batch = make_batch(DENSE["vocab_size"], ragged=True)  # host tensors, as the driver sends them
    try:
        role.compute_log_prob(batch)
    except _Stop:
        pass
    params = {str(p.device) for p in model.parameters()}
    return params, [(tuple(t.shape), str(t.device)) for t in seen]


@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_every_tensor_handed_to_the_model_is_on_its_parameters_device(remove_padding):
    params, seen = run_distributed(_inputs_seen_by_model, 1, remove_padding)[0]
    assert params == {"meta"}
    # ids and position ids; packed: cu_seqlens_q/kv and their padded twins as well
    assert len(seen) == (6 if remove_padding else 2)
    assert {device for _, device in seen} == {"meta"}, seen


def test_to_device_moves_nested_tensors_and_dataclasses(lazy):
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=5, max_seqlen_kv=5
    )
    moved = to_device({"mb": {"ids": torch.arange(4)}, "packed": packed, "pair": (torch.ones(2), 3)}, lazy)
    assert moved["mb"]["ids"].device.type == "lazy"
    assert moved["packed"].cu_seqlens_q.device.type == "lazy" and moved["packed"].cu_seqlens_kv.device.type == "lazy"
    assert moved["packed"].cu_seqlens_q_padded is None and moved["packed"].max_seqlen_q == 5
    assert moved["pair"][0].device.type == "lazy" and moved["pair"][1] == 3
    assert packed.cu_seqlens_q.device.type == "cpu"  # the original is left alone
    back = to_host(moved)
    assert [t.device.type for t in tensors_in(back)] == ["cpu"] * 4
    assert back["mb"]["ids"].tolist() == [0, 1, 2, 3] and back["packed"].cu_seqlens_kv.tolist() == [0, 3, 8]


class _DeviceRole:
    """A role object whose method computes on another device, as a GPU rank's roles do. (A real role
    cannot run on the lazy device here: the CPU compatibility layer builds RoPE's tables on ``cpu``.)"""

    def __init__(self, device):
        self.device = device

    def compute_log_prob(self, batch, *, scale):
        out = batch["x"].to(self.device) * scale
        return {"log_probs": out, "nested": [out + 1], "count": 2}


def test_worker_call_hands_the_driver_host_tensors(lazy):
    from megatron_rl.workers.megatron_worker import MegatronWorker

    worker = MegatronWorker(rank=0, world_size=1)
    worker.role = _DeviceRole(lazy)
    out = worker.call("compute_log_prob", {"x": torch.arange(3.0)}, {"scale": 2.0})
    assert out["log_probs"].device.type == "cpu" and out["nested"][0].device.type == "cpu"
    assert out["log_probs"].tolist() == [0.0, 2.0, 4.0] and out["nested"][0].tolist() == [1.0, 3.0, 5.0]
    assert out["count"] == 2
