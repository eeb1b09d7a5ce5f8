"""``trainer.balance_batch``: the step's batch reordered so every DP slice holds a near-equal token
count, with verl's ``global_seqlen/*`` metrics; each role's token budget resolved from the keys it
defaults to and checked before any worker starts; the planner sizing activations from the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.data.batch import Batch
from megatron_rl.trainer.balance import balance_batch


def _batch(lengths):
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return Batch.from_dict(
        {"attention_mask": mask, "row": torch.arange(len(lengths))},
        {"uid": np.array([f"u{i}" for i in range(len(lengths))], dtype=object)},
    )


def test_balance_batch_evens_the_dp_slices_and_reports_verl_metrics():
    lengths = [100, 90, 80, 70, 10, 9, 8, 7]  # contiguous halves: 340 vs 34 tokens
    batch = _batch(lengths)
    metrics = balance_batch(batch, 2)
    assert metrics == {
        "global_seqlen/min": 34.0,
        "global_seqlen/max": 340.0,
        "global_seqlen/minmax_diff": 306.0,
        "global_seqlen/balanced_min": 187.0,
        "global_seqlen/balanced_max": 187.0,
        "global_seqlen/mean": 187.0,
    }
    order = batch["row"].tolist()
    halves = [sum(lengths[i] for i in order[:4]), sum(lengths[i] for i in order[4:])]
    assert halves == [187, 187] and sorted(order) == list(range(8))
    assert list(batch.non_tensor_batch["uid"]) == [f"u{i}" for i in order]  # every field moves together
    # Inside a slice: short, long, ..., short (the lightest samples at both ends).
    first = [lengths[i] for i in order[:4]]
    assert first[0] <= first[1] and first[-1] <= first[-2]


def test_balance_batch_needs_an_even_split():
    with pytest.raises(
        ValueError,
        match=r"^trainer.balance_batch: a batch of 3 samples cannot be split evenly over "
        r"the data-parallel size 2$",
    ):
        balance_batch(_batch([1, 2, 3]), 2)


def _specs(overrides):
    from megatron_rl.algos.needs import resolve_run
    from megatron_rl.config import RunConfig, compose
    from megatron_rl.trainer.placement import role_specs

    config = RunConfig.from_dict(compose("ppo", overrides))
    return role_specs(config, resolve_run(config), model_path="/unused", total_steps=1)


def test_role_budgets_default_to_the_actors_and_are_checked_before_any_worker():
    specs = _specs(
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
            "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu=160",
            "critic.ppo_max_token_len_per_gpu=128",
        ]
    )
    assert specs["actor"].config.train_token_budget() == 96 and specs["actor"].config.forward_token_budget() == 160
    assert specs["critic"].config.use_dynamic_bsz is True  # None: the actor's
    assert specs["critic"].config.forward_token_budget() == 128  # forward_max_token_len_per_gpu None: ppo_max_...
    assert _specs([])["critic"].config.forward_token_budget() is None
    with pytest.raises(
        ValueError,
        match=r"^actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64 is smaller than the "
        r"longest sample: data.max_prompt_length \+ data.max_response_length = "
        r"64\+16 = 80$",
    ):
        _specs(["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"])
    with pytest.raises(
        ValueError,
        match=r"^critic.forward_max_token_len_per_gpu=81 is not a multiple of 2, the "
        r"packed-sequence alignment of its layout \(tensor_model_parallel_size=2",
    ):
        _specs(
            [
                "critic.use_dynamic_bsz=true",
                "critic.forward_max_token_len_per_gpu=81",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                "critic.megatron.tensor_model_parallel_size=2",
                "critic.megatron.sequence_parallel=true",
            ]
        )


def test_planner_sizes_activations_from_the_token_budget_of_a_verl_30b_a3b_script():
    from megatron_rl.config import RunConfig, compose
    from megatron_rl.planner import plan_run
    from megatron_rl.planner.memory import estimate_role

    verl_keys = [
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=20480",
    ]
    fixed = plan_run(RunConfig.from_dict(compose("gpu/qwen3_30b_a3b_grpo")), architecture="qwen3_30b_a3b")
    dynamic = plan_run(RunConfig.from_dict(compose("gpu/qwen3_30b_a3b_grpo", verl_keys)), architecture="qwen3_30b_a3b")
    assert dynamic.fits
    # A 10,240-token micro-batch holds ~3.3x the tokens of one 3,072-token sequence (ppo_micro_batch_size_per_gpu=1).
    ratio = dynamic.roles["actor"].activation_bytes / fixed.roles["actor"].activation_bytes
    assert 3.0 < ratio < 4.5, ratio
    assert dynamic.roles["ref"].activation_bytes > fixed.roles["ref"].activation_bytes
    # Activations grow linearly with the budget; the head scores at most the budget's tokens.
    kw = dict(tp=4, pp=2, ep=8, etp=1, dp=2, expert_dp=2, dtype="bfloat16", trainable=True, num_microbatches=8)
    a, b = (estimate_role(fixed.model, max_token_len=t, **kw) for t in (8192, 16384))
    assert b.activation_bytes / a.activation_bytes == pytest.approx(2.0, rel=0.01)
    with pytest.raises(
        ValueError,
        match=r"^actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048 is smaller than the "
        r"longest sample: data.max_prompt_length \+ data.max_response_length = "
        r"1024\+2048 = 3072$",
    ):
        plan_run(
            RunConfig.from_dict(
                compose(
                    "gpu/qwen3_30b_a3b_grpo", verl_keys[:1] + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048"]
                )
            ),
            architecture="qwen3_30b_a3b",
        )
