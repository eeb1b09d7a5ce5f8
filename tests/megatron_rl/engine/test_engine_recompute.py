"""``megatron.override_transformer_config`` reaches the engine's TransformerConfig: activation
recompute (full/uniform and selective) gives the same log-probs, losses and update as none,
and an unknown field is refused by name."""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import DENSE, make_batch, make_role
from tests.numerics import max_abs_diff


def _case(rank, world_size, overrides):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=3)
    try:
        actor = make_role(
            "actor",
            DENSE,
            mesh,
            {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4},
            transformer_overrides=overrides,
        )
    except ValueError as err:
        return str(err)
    batch = make_batch(DENSE["vocab_size"])
    out = actor.compute_log_prob(batch)
    batch["old_log_probs"] = out["log_probs"] + batch["offset"]
    metrics = actor.update_policy(batch)
    return metrics, actor.compute_log_prob(batch)["log_probs"], actor.engine.tf_config.recompute_granularity


@pytest.mark.parametrize(
    "overrides",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective"},
    ],
    ids=["full", "selective"],
)
def test_recompute_equals_no_recompute(overrides):
    base, lp_base, none = run_distributed(_case, 1, {})[0]
    metrics, lp, granularity = run_distributed(_case, 1, overrides)[0]
    assert none is None and granularity == overrides["recompute_granularity"]
    # Exact by construction: recompute reruns the same forward ops, in the same order, on the inputs the
    # checkpoint saved, so activations, gradients and the update are bitwise those of the stored run
    # (measured equal under ATEN_CPU_CAPABILITY=default and OMP_NUM_THREADS=1 and 2).
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert metrics[key] == base[key], key
    # The log-probs after one update: a layer skipped in the recomputed forward moves them by ~1e-1.
    assert torch.equal(lp, lp_base), f"recompute {overrides['recompute_granularity']} lp: {max_abs_diff(lp, lp_base)}"


def test_unknown_override_is_refused():
    err = run_distributed(_case, 1, {"recompute_granulrity": "full"})[0]
    assert err == "megatron.override_transformer_config has unknown TransformerConfig field(s) ['recompute_granulrity']"
