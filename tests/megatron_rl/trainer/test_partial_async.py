"""Partial rollouts through Ray (``trainer.v1.partial_rollout``): the rollout worker's weight push
runs in its own concurrency group, pauses the generation in flight and the generation continues
with the new weights; and ``recipes/grpo_async.yaml`` with partial rollouts trains two steps.

* The Ray worker: a long generation is submitted, the push is sent once the engine has run a few
  steps (``pause_stats`` answers on the push thread while the generation runs); every sample's
  tokens are version 0 up to the pause and version 1 after it, with the old / the new weights'
  log-probs (HF float32 reference, <= 1e-4).
* The recipe: two steps with finite metrics, the staleness metrics counted over per-token versions
  (``async/partial/*`` present, token fractions summing to 1).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from tests.megatron_rl.rollout.test_partial_rollout import LOGP_TOL, hf_token_log_probs  # noqa: E402
from tests.megatron_rl.trainer.test_async_trainer import SMALL, _run, toy_model  # noqa: E402,F401

# long enough that a push announced after step 4 lands before the end on a loaded machine
LONG, TEMPERATURE = 256, 0.7


def test_a_push_to_the_ray_worker_pauses_its_generation_and_it_continues_with_the_new_weights(tmp_path, ray_cluster):
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3, chat_prompts, load_hf_model
    from megatron_rl.workers.rollout_worker import create_rollout_worker

    m0, m1 = build_tiny_qwen3(tmp_path / "a", seed=0), build_tiny_qwen3(tmp_path / "b", seed=1)
    prompts = chat_prompts(m0["tokenizer"], ["What is 12 plus 30?", "hi"])
    cfg = RolloutConfig(prompt_length=32, response_length=LONG, n=2, temperature=TEMPERATURE, kv_cache_space_gib=1)
    worker, pg = create_rollout_worker(m0["path"], cfg, num_cpus=1, partial_rollout=True)
    new_weights = ray.put(list(m1["state_dict"].items()))  # in the object store before the generation starts
    try:
        future = worker.generate_tagged.remote(prompts, seed=3, ignore_eos=True)
        deadline = time.time() + 120
        while ray.get(worker.pause_stats.remote())["steps"] < 4 and time.time() < deadline:
            time.sleep(0.005)
        ray.get(worker.update_weights.remote(new_weights))
        out = ray.get(future)
        stats = ray.get(worker.pause_stats.remote())
    finally:
        ray.get(worker.shutdown.remote())
        ray.kill(worker)
        ray.util.remove_placement_group(pg)
    batch, versions = out["batch"], out["batch"]["rollout_policy_versions"]
    assert out["policy_version"] == 0 and stats["version"] == 1 and stats["pauses"] == 1
    assert batch["response_mask"].all() and batch["finish_reasons"] == ["length"] * 4
    cut = int((versions[0] == 0).sum())
    assert 4 <= cut < LONG, cut  # paused after the steps seen, before the end
    assert torch.equal(versions, (torch.arange(LONG) >= cut).long().expand(4, -1))
    logp = batch["rollout_log_probs"]
    old = hf_token_log_probs(load_hf_model(m0["config"], m0["state_dict"]), batch, TEMPERATURE)
    new = hf_token_log_probs(load_hf_model(m1["config"], m1["state_dict"]), batch, TEMPERATURE)
    before, after = (old - logp)[versions == 0].abs().max().item(), (new - logp)[versions == 1].abs().max().item()
    assert before < LOGP_TOL and after < LOGP_TOL, (before, after)
    assert (old - logp)[versions == 1].abs().max().item() > 0.1  # the two weight sets differ there


def test_grpo_async_recipe_with_partial_rollouts_trains_two_steps(toy_model, ray_cluster):  # noqa: F811 (fixture)
    history, _, trainer = _run(
        toy_model,
        "partial",
        "grpo_async",
        [
            "trainer.v1.partial_rollout=true",
            "trainer.total_training_steps=2",
            "trainer.v1.separate_async.parameter_sync_step=1",
        ],
    )
    assert trainer.config.trainer.v1.partial_rollout and len(history) == 2
    for h in history:
        assert math.isfinite(h["actor/pg_loss"]) and math.isfinite(h["critic/score/mean"])
        assert {
            "async/partial/partial_ratio",
            "async/partial/total_partial_num",
            "async/partial/max_partial_span",
        } <= set(h)
        fractions = [v for k, v in h.items() if k.startswith("async/token_fraction/staleness_")]
        assert fractions and abs(sum(fractions) - 1.0) < 1e-9  # integer token counts / total, in float64: ~1e-16 off
        assert 0.0 <= h["async/staleness_mean"] <= h["async/staleness_max"] <= 1.0
    assert history[0]["async/staleness_max"] == 0.0  # step 1 trains on the starting weights' rollouts


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.v1.trainer_mode=sync", "actor_rollout_ref.rollout.nnodes=0"],
            "trainer.v1.partial_rollout=True is not supported: the rollout engine pauses generations only for weight "
            "pushes that arrive while it generates, and trainer.v1.trainer_mode='sync'",
        ),
        (
            ["actor_rollout_ref.rollout.in_process_engine=false"],
            "trainer.v1.partial_rollout=True needs actor_rollout_ref.rollout.in_process_engine=True",
        ),
    ],
)
def test_partial_rollouts_with_an_engine_that_cannot_pause_are_refused_by_name(overrides, message):
    """Refused when the run config is built, before any worker starts."""
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_dict(compose("grpo_async", ["trainer.v1.partial_rollout=true", *overrides]))
    for mode, nnodes in (("separate_async", 1), ("colocate_async", 0)):  # the async modes accept it
        cfg = RunConfig.from_dict(
            compose(
                "grpo_async",
                [
                    "trainer.v1.partial_rollout=true",
                    f"trainer.v1.trainer_mode={mode}",
                    f"actor_rollout_ref.rollout.nnodes={nnodes}",
                ],
            )
        )
        assert cfg.trainer.v1.partial_rollout


def test_staleness_is_counted_over_tokens_by_their_own_version():
    """Trainer version 3; sample 0: 2 tokens of version 1 then 2 of version 3 (paused once); sample
    1: 3 tokens of version 2 (one padding position, its tag ignored)."""
    from megatron_rl.data.batch import Batch
    from megatron_rl.trainer.async_loop import staleness_metrics

    batch = Batch.from_single_dict(
        {
            "rollout_policy_versions": torch.tensor([[1, 1, 3, 3], [2, 2, 2, 0]]),
            "response_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
            "rollout_policy_version": torch.tensor([1, 2]),
        }
    )
    out = staleness_metrics(batch, 3)
    assert out["async/staleness_mean"] == (2 * 2 + 2 * 0 + 3 * 1) / 7 and out["async/staleness_max"] == 2.0
    assert {k: v for k, v in out.items() if "token_fraction" in k} == {
        "async/token_fraction/staleness_0": 2 / 7,
        "async/token_fraction/staleness_1": 3 / 7,
        "async/token_fraction/staleness_2": 2 / 7,
    }
    assert (
        out["async/partial/total_partial_num"],
        out["async/partial/partial_ratio"],
        out["async/partial/max_partial_span"],
    ) == (1.0, 0.5, 2.0)
