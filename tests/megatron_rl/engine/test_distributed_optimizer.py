"""``megatron.use_distributed_optimizer``: Megatron's ZeRO-1 optimizer on gloo ranks
(``parallel.cpu_compat._distributed_optimizer_on_cpu``).

At DP=2 one Adam step with the optimizer state sharded over DP gives the weights of the
non-distributed optimizer (to float32 rounding, see ``_adam_bound``), each rank holding about half the state; the optimizer
checkpoint of DP=2 loads at DP=1 and the one of DP=1 at DP=2, and the next step from either
equals the next step of the run that never left DP=2.
"""

from __future__ import annotations

import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, DENSE, PROMPT, RESPONSE, make_batch
from tests.megatron_rl.engine.test_offload import TRAIN, _weights
from tests.numerics import assert_within, gpt_forward_terms, rounding_bound

TOL = 1e-6  # the GPU variant's base (tests/megatron_rl/engine/test_gpu_paths.py); the CPU test uses _adam_bound
CONFIG = TRAIN
ADAM_ROUNDINGS = 8  # one AdamW update: m, v, bias corrections, sqrt, divide, decay, subtract
BACKWARD_TERMS = 2 * gpt_forward_terms(DENSE, PROMPT + RESPONSE) + BATCH * RESPONSE


def _adam_bound(weights: dict) -> float:
    """Two float32 AdamW steps of the same model: the update's elementwise roundings at the weights'
    scale, plus the gradients' rounding (the backward's eps * n, relative: Adam divides by sqrt(v))
    entering times lr. Optimizer state on the wrong shard or lost moves the weights by ~lr = 1e-2."""
    scale = max(float(w.abs().max()) for w in weights.values())
    return rounding_bound(ADAM_ROUNDINGS, scale) + CONFIG["optim"]["lr"] * 2 * rounding_bound(BACKWARD_TERMS, 1.0)


def _actor(mesh, distributed: bool):
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.config import ActorConfig
    from megatron_rl.roles import build_role

    return build_role(
        "actor", ModelConfig(**DENSE), mesh, ActorConfig.from_dict(CONFIG), distributed_optimizer=distributed
    )


def _step(role, batch, mesh):
    dp, rank = mesh.size("dp"), mesh.dp_rank
    shard = {k: v.chunk(dp)[rank] for k, v in batch.items()}
    old = role.compute_log_prob(shard)["log_probs"]
    return role.update_policy({**shard, "old_log_probs": old + shard["offset"]})


def _equal_step_case(rank, world_size, ckpt):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=3)
    dist_role, plain = _actor(mesh, True), _actor(mesh, False)
    with torch.no_grad():
        for (_, a), (_, b) in zip(dist_role.engine.named_parameters(), plain.engine.named_parameters()):
            b.copy_(a)
    batch = make_batch(DENSE["vocab_size"], seed=1)
    metrics = [_step(r, batch, mesh) for r in (dist_role, plain)]
    w_dist, w_plain = _weights(dist_role), _weights(plain)
    state = [r.engine.resident_bytes()["optimizer"] for r in (dist_role, plain)]
    _step(dist_role, make_batch(DENSE["vocab_size"], seed=2), mesh)
    dist_role.engine.save_checkpoint(ckpt)  # after two steps (a fresh load takes one dummy step: 'step' must move)
    nxt = _step(dist_role, make_batch(DENSE["vocab_size"], seed=3), mesh)
    return {
        "diff": max(float((w_dist[k] - w_plain[k]).abs().max()) for k in w_dist),
        "metrics": metrics,
        "state": state,
        "next": _weights(dist_role),
        "next_metrics": nxt,
        "kind": [type(o).__name__ for o in getattr(dist_role.engine.optimizer, "chained_optimizers", [])],
    }


def _resume_case(rank, world_size, ckpt_in, ckpt_out, distributed):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=4)  # other init weights: everything must come from the checkpoint
    role = _actor(mesh, distributed)
    role.engine.load_checkpoint(ckpt_in)
    if ckpt_out:
        role.engine.save_checkpoint(ckpt_out)
    _step(role, make_batch(DENSE["vocab_size"], seed=3), mesh)
    return _weights(role)


def _max_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_distributed_optimizer_equals_the_plain_one_and_reshards_over_dp(tmp_path):
    dp2, dp1, back = str(tmp_path / "dp2"), str(tmp_path / "dp1"), str(tmp_path / "back")
    first = run_distributed(_equal_step_case, 2, dp2)
    bound = _adam_bound(first[0]["next"])
    for res in first:
        assert_within(res["diff"], bound, "distributed vs plain optimizer at dp=2")
        assert res["metrics"][0]["actor/pg_loss"] == res["metrics"][1]["actor/pg_loss"]
        sharded, full = res["state"]
        assert 0.45 * full <= sharded <= 0.55 * full + 8192, (sharded, full)  # half the Adam state per rank
    assert set(first[0]["kind"]) == {"DistributedOptimizer"}
    # DP=2 -> DP=1 (and saved again at DP=1) -> DP=2: the next step is the one DP=2 took
    (at_dp1,) = run_distributed(_resume_case, 1, dp2, dp1, True)
    assert_within(_max_diff(at_dp1, first[0]["next"]), bound, "dp2 -> dp1 next step")
    again = run_distributed(_resume_case, 2, dp1, back, True)
    for weights in again:
        assert_within(_max_diff(weights, first[0]["next"]), bound, "dp1 -> dp2 next step")
