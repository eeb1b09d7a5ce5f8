"""``megatron.override_transformer_config`` reaches the engine's TransformerConfig: activation
recompute (full/uniform and selective) gives the same log-probs, losses and update as none,
and an unknown field is refused by name."""

from __future__ import annotations

import pytest

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, DENSE, PROMPT, RESPONSE, make_batch, make_role
from tests.numerics import assert_within, gpt_forward_terms, max_abs_diff, rounding_bound


def _case(rank, world_size, overrides):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=3)
    try:
        actor = make_role("actor", DENSE, mesh, {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4},
                          transformer_overrides=overrides)
    except ValueError as err:
        return str(err)
    batch = make_batch(DENSE["vocab_size"])
    out = actor.compute_log_prob(batch)
    batch["old_log_probs"] = out["log_probs"] + batch["offset"]
    metrics = actor.update_policy(batch)
    return metrics, actor.compute_log_prob(batch)["log_probs"], actor.engine.tf_config.recompute_granularity


@pytest.mark.parametrize("overrides", [
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"recompute_granularity": "selective"},
], ids=["full", "selective"])
def test_recompute_equals_no_recompute(overrides):
    base, lp_base, none = run_distributed(_case, 1, {})[0]
    metrics, lp, granularity = run_distributed(_case, 1, overrides)[0]
    assert none is None and granularity == overrides["recompute_granularity"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert metrics[key] == pytest.approx(base[key], rel=1e-5, abs=1e-7), key
    # The log-probs after one update: a forward, a backward (the forward again, grads summed over
    # tokens) and the next forward, in two float32 runs that may round differently (twice the bound).
    # A layer skipped in the recomputed forward moves them by ~1e-1.
    terms = 3 * gpt_forward_terms(DENSE, PROMPT + RESPONSE) + BATCH * RESPONSE
    assert_within(max_abs_diff(lp, lp_base), 2 * rounding_bound(terms, max(1.0, float(lp_base.abs().max()))),
                  f"recompute {overrides['recompute_granularity']} lp")


def test_unknown_override_is_refused():
    err = run_distributed(_case, 1, {"recompute_granulrity": "full"})[0]
    assert err == "megatron.override_transformer_config has unknown TransformerConfig field(s) ['recompute_granulrity']"
