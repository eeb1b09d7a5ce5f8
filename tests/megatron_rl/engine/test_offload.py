"""Host offload of an engine's state (``megatron_rl.engine.offload``) on real Megatron-Core ranks.

At TP=2 and at PP=2 (gloo), for actor, critic (Adam, so there is optimizer state) and reference:
after ``offload_to_cpu`` the model, its DDP buffers and the optimizer hold 0 bytes of storage
(everything went to the offload store, the module tensors are empty); after ``load_to_device``
the next step equals, bit for bit, the same step of a twin engine that never offloaded.
"""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, DENSE, make_batch, make_role

ADAM = {"optimizer": "adam", "lr": 1e-2, "weight_decay": 0.01, "clip_grad": 1.0}
TRAIN = {"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 2, "optim": ADAM}


def _step(role_name, role, batch):
    """One step of the role; returns what the step produced (metrics or log-probs)."""
    if role_name == "actor":
        out = role.compute_log_prob(batch)["log_probs"]
        return role.update_policy({**batch, "old_log_probs": out + batch["offset"]})
    if role_name == "critic":
        out = role.compute_values(batch)["values"]
        return role.update_critic({**batch, "values": out + batch["offset"]})
    return {"log_probs": role.compute_log_prob(batch)["log_probs"]}


def _weights(role) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in role.engine.named_parameters()}


def _offload_case(rank, world_size, par):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(**par), seed=3)
    out = {}
    for name in ("actor", "critic", "ref"):
        cfg = TRAIN if name != "ref" else None
        role, twin = make_role(name, DENSE, mesh, cfg), make_role(name, DENSE, mesh, cfg)
        with torch.no_grad():  # the twin starts from the same weights
            for (_, a), (_, b) in zip(role.engine.named_parameters(), twin.engine.named_parameters()):
                b.copy_(a)
        batch = make_batch(DENSE["vocab_size"], seed=1)
        first = [_step(name, r, batch) for r in (role, twin)]  # Adam state exists after this
        engine = role.engine
        before = engine.resident_bytes()
        moved = engine.offload_to_cpu()
        after = engine.resident_bytes()
        held = engine._offload.held_bytes()
        try:
            _step(name, role, batch)
            refused = ""
        except RuntimeError as err:
            refused = str(err)
        restored = engine.load_to_device()
        back = engine.resident_bytes()
        batch2 = make_batch(DENSE["vocab_size"], seed=2)
        second = [_step(name, r, batch2) for r in (role, twin)]
        w_off, w_twin = _weights(role), _weights(twin)
        out[name] = {
            "before": before,
            "after": after,
            "back": back,
            "held": held,
            "moved": moved,
            "restored": restored,
            "refused": refused,
            "first_equal": first[0] == first[1] if name != "ref" else True,
            "second": second,
            "weights_equal": all(torch.equal(w_off[k], w_twin[k]) for k in w_off),
        }
    # a partial offload: only the parameters leave, the optimizer state stays
    role = make_role("actor", DENSE, mesh, TRAIN)
    _step("actor", role, make_batch(DENSE["vocab_size"], seed=1))
    role.engine.offload_to_cpu(params=True, grads=False, optimizer=False)
    out["partial"] = role.engine.resident_bytes()
    role.engine.load_to_device()
    return out


@pytest.mark.parametrize(
    "par", [dict(tensor_model_parallel_size=2), dict(pipeline_model_parallel_size=2)], ids=["tp2", "pp2"]
)
def test_offload_leaves_nothing_resident_and_the_next_step_is_unchanged(par):
    results = run_distributed(_offload_case, 2, par)
    for res in results:
        for name in ("actor", "critic", "ref"):
            r = res[name]
            assert r["before"]["params"] > 0
            if name != "ref":
                assert r["before"]["grads"] > 0 and r["before"]["optimizer"] > 0
                # Adam's exp_avg + exp_avg_sq (fp32 masters are the params themselves): 2x the parameters
                assert r["before"]["optimizer"] >= 2 * r["before"]["params"] - 4096
            else:
                assert r["before"]["grads"] == 0 and r["before"]["optimizer"] == 0
            assert r["after"] == {"params": 0, "grads": 0, "optimizer": 0}, (name, r["after"])
            assert r["moved"] == sum(r["before"].values()) == r["restored"]
            # parameters and optimizer state were copied to the host; gradients released (zeroed on return)
            assert r["held"] == {"params": r["before"]["params"], "grads": 0, "optimizer": r["before"]["optimizer"]}
            assert r["back"] == r["before"]
            assert "offloaded to host memory" in r["refused"]
            if name == "ref":
                assert torch.equal(r["second"][0]["log_probs"], r["second"][1]["log_probs"])
            else:
                assert r["first_equal"] and r["second"][0] == r["second"][1]
            assert r["weights_equal"], name
        partial = res["partial"]
        assert partial["params"] == 0 and partial["grads"] > 0 and partial["optimizer"] > 0


def _gpu_offload_case(rank, world_size):
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.planner.memory import estimate_role
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    role = make_role("actor", DENSE, init_mesh(ParallelConfig(), seed=5), TRAIN)
    batch = make_batch(DENSE["vocab_size"])  # host tensors, as the driver sends them
    _step("actor", role, batch)  # Adam state exists
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    held = sum(role.engine.resident_bytes(device="cuda").values())
    role.engine.offload_to_cpu()
    dropped = before - torch.cuda.memory_allocated()
    planned = estimate_role(ModelConfig(**DENSE), dtype="float32", sequence_parallel=False).state_bytes
    role.engine.load_to_device()
    return dropped, held, planned


@pytest.mark.gpu
def test_offload_frees_the_planned_gpu_bytes():
    """On a GPU: torch.cuda.memory_allocated drops by what the engine held and the planner's state bytes."""
    dropped, held, planned = run_distributed(_gpu_offload_case, 1, backend="nccl")[0]
    assert dropped == pytest.approx(held, rel=0.01)
    assert dropped == pytest.approx(planned, rel=0.02)


def test_a_storage_that_cannot_be_released_is_refused_before_anything_moves():
    from megatron_rl.engine.offload import OffloadStore, resident_bytes

    model = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))]
    import numpy as np

    # a numpy buffer (what ray.get hands back for a tensor) cannot be resized: offload could not free it
    model[0][1].weight.data = torch.from_numpy(np.ones((2, 4), dtype=np.float32))
    before = resident_bytes(model, None)
    store = OffloadStore()
    with pytest.raises(
        RuntimeError,
        match=r"cannot offload params: 1 storage\(s\) of it \(32 bytes first\) are not "
        r"resizable",
    ):
        store.offload(model, None, ["params"])
    assert resident_bytes(model, None) == before and not store.offloaded("params")
