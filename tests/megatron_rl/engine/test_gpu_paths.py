"""GPU-only paths not covered elsewhere, each handed host batches as the driver sends them
(``tools/bench_gpu.sh --check`` runs these with the other gpu-marked tests).

* the whole worker path on CUDA: ``MegatronWorker.call`` with a host shard -> the engine moves
  every micro-batch -> the driver gets host tensors, equal to the CPU run of the same weights;
* Megatron's ``DistributedOptimizer`` on NCCL (the real one, not ``parallel.cpu_compat``'s CPU
  path) equals the plain optimizer after one step;
* vLLM's sleep / wake-up releases and restores GPU memory and keeps the engine's output.
"""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_distributed_optimizer import TOL, _equal_step_case
from tests.megatron_rl.engine.test_engine import DENSE, make_batch, make_role

TRAIN = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 2}


def _worker_call_case(rank, world_size, ckpt):
    from megatron_rl.workers.megatron_worker import MegatronWorker
    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    role = make_role("actor", DENSE, init_mesh(ParallelConfig(), seed=7), TRAIN)
    if torch.cuda.is_available():
        load_model(role.engine.model, ckpt)
    else:
        save_model(role.engine.model, ckpt)
    worker = MegatronWorker(rank, world_size)
    worker.role, worker.engine = role, role.engine
    batch = make_batch(DENSE["vocab_size"], ragged=True)  # host tensors
    out = worker.call("compute_log_prob", batch, {"calculate_entropy": True})
    metrics = worker.call("update_policy", {**batch, "old_log_probs": out["log_probs"]}, {})
    devices = {v.device.type for v in out.values()}
    params = {p.device.type for _, p in role.engine.named_parameters()}
    return devices, params, out, metrics


def test_worker_call_runs_a_real_role_on_a_host_shard(tmp_path):
    """The CPU half of the next test, on its own: a real actor through ``MegatronWorker.call``."""
    devices, params, out, metrics = run_distributed(
        _worker_call_case, 1, str(tmp_path / "ckpt"), env={"CUDA_VISIBLE_DEVICES": ""}
    )[0]
    assert devices == {"cpu"} and params == {"cpu"}
    assert out["log_probs"].shape == out["entropys"].shape == (8, 5)
    assert metrics["actor/pg_loss"] == metrics["actor/pg_loss"] and "actor/grad_norm" in metrics  # finite, not NaN


@pytest.mark.gpu
def test_worker_call_on_cuda_takes_and_returns_host_tensors(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # the reference: the same weights on a CPU rank (CUDA hidden), which saves them for the GPU run
    _, _, cpu_out, cpu_metrics = run_distributed(
        _worker_call_case, 1, ckpt, timeout_s=600, env={"CUDA_VISIBLE_DEVICES": ""}
    )[0]
    devices, params, out, metrics = run_distributed(_worker_call_case, 1, ckpt, backend="nccl")[0]
    assert devices == {"cpu"} and params == {"cuda"}
    mask = make_batch(DENSE["vocab_size"], ragged=True)["response_mask"].bool()
    for key in ("log_probs", "entropys"):
        assert float((out[key][mask] - cpu_out[key][mask]).abs().max()) < 1e-3, key
    assert metrics["actor/pg_loss"] == pytest.approx(cpu_metrics["actor/pg_loss"], abs=1e-3)


@pytest.mark.gpu
def test_distributed_optimizer_on_nccl_equals_the_plain_one(tmp_path):
    world = 2 if torch.cuda.device_count() >= 2 else 1
    results = run_distributed(_equal_step_case, world, str(tmp_path / "ckpt"), backend="nccl")
    for res in results:
        assert res["diff"] <= 10 * TOL, res["diff"]
        if world == 2:
            sharded, full = res["state"]
            assert 0.45 * full <= sharded <= 0.55 * full + 8192, (sharded, full)
    assert set(results[0]["kind"]) == {"DistributedOptimizer"}


def _sleep_case(rank, world_size, hf_dir):
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout

    rollout = VLLMRollout(
        hf_dir,
        RolloutConfig(
            prompt_length=16, response_length=4, gpu_memory_utilization=0.2, enforce_eager=True, free_cache_engine=True
        ),
    )
    prompts = [[1, 2, 3, 4]]
    before = rollout.generate(prompts, validate=True)["responses"]
    free_awake = torch.cuda.mem_get_info()[0]
    rollout.sleep(level=1)
    free_asleep = torch.cuda.mem_get_info()[0]
    rollout.wake_up()
    after = rollout.generate(prompts, validate=True)["responses"]
    rollout.shutdown()
    return free_asleep - free_awake, torch.equal(before, after)


@pytest.mark.gpu
def test_vllm_sleep_releases_gpu_memory_and_wake_up_restores_the_engine(tmp_path):
    pytest.importorskip("vllm")
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    hf_dir = build_tiny_hf_checkpoint(
        tmp_path / "hf",
        "qwen3",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )["path"]
    released, same = run_distributed(_sleep_case, 1, str(hf_dir), timeout_s=600)[0]
    assert released > 2**30 and same  # 20 % of the GPU's KV-cache share comes back while asleep


def _pinned_offload_case(rank, world_size):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    role = make_role("actor", DENSE, init_mesh(ParallelConfig(), seed=5), TRAIN)
    batch = make_batch(DENSE["vocab_size"])
    role.update_policy({**batch, "old_log_probs": role.compute_log_prob(batch)["log_probs"]})  # Adam state exists
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    kept = role.engine.offload_to_cpu(grads=False)
    store = role.engine._offload
    pinned = all(h.is_pinned() for held in store._held.values() for _, _, h in held if h is not None)
    held = sum(store.held_bytes().values())
    caching = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
    role.engine.load_to_device(grads=False)
    return kept, held, pinned, caching


@pytest.mark.gpu
def test_offload_pins_exactly_what_it_holds_outside_the_caching_host_allocator():
    """The host copies are page-locked (fast copies back), hold the offloaded bytes and no more, and
    none of them comes from torch's caching host allocator (which rounds up to powers of two)."""
    kept, held, pinned, caching = run_distributed(_pinned_offload_case, 1, backend="nccl")[0]
    assert pinned and held == kept and caching == 0
