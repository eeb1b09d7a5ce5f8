"""Bad input and failures in the loop: reported, never silently averaged, checkpoints intact.

* a reward function that raises, or returns a non-finite value: the step is reported
  (``training/step_skipped``, the failing samples) and skipped -- no update; too many in a row
  stop the run with the error;
* a worker that dies mid-step: the run stops with the worker's error, naming the last good
  checkpoint, which is complete and still the latest;
* a layout that does not fit the cluster, or a model that does not fit the memory: ``megatron-rl
  train`` refuses before anything is allocated (exit 2, the reason).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

SMALL = [
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.logger=[console]",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.max_num_seqs=16",
]


class FlakyScore:
    """Varied scores; raises on the steps in ``raise_on``; NaN on the steps in ``nan_on``."""

    def __init__(self):
        self.step, self.raise_on, self.nan_on = 0, set(), set()

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        if self.step in self.raise_on:
            raise KeyError("ground truth format")
        if self.step in self.nan_on:
            return float("nan")
        return min(1.0, len(set(solution_str)) / 8)


def _trainer(tmp_path, overrides):
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.job.main_job import build_trainer

    config = RunConfig.from_dict(compose("grpo", [*SMALL, *overrides, f"trainer.default_local_dir={tmp_path}"]))
    trainer = build_trainer(config, tmp_path)
    score = FlakyScore()
    trainer.reward_fn = RewardFunction(trainer.tokenizer, score)
    return trainer, score


def test_failing_rewards_skip_the_step_and_repeated_failures_stop_the_run(tmp_path, ray_cluster):
    trainer, score = _trainer(tmp_path, ["trainer.max_consecutive_skipped_steps=2"])
    score.raise_on, score.nan_on = {1}, {4, 5}
    try:
        trainer.init_workers()
        with pytest.raises(RuntimeError) as err:
            trainer.fit(6, on_step=lambda m: setattr(score, "step", int(m["training/global_step"])))
    finally:
        trainer.shutdown()
    # The hook runs after a step: step k scores with score.step == k - 1.
    assert "2 steps in a row were skipped because the reward failed" in str(err.value)
    assert "non-finite" in str(err.value) or "nan" in str(err.value).lower()
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    skipped = [s for s, r in rows.items() if r.get("training/step_skipped") == 1.0]
    assert skipped == [2, 5, 6]
    for s in skipped:  # reported, not trained on: no reward mean, no update
        assert rows[s]["reward/num_failed_samples"] == 8.0
        assert "critic/score/mean" not in rows[s] and "actor/pg_loss" not in rows[s]
    for s in (1, 3, 4):
        assert math.isfinite(rows[s]["critic/score/mean"]) and math.isfinite(rows[s]["actor/pg_loss"])


def test_worker_death_stops_the_run_with_the_last_good_checkpoint_intact(tmp_path, ray_cluster):
    from megatron_rl.trainer.step_checkpoints import find_resume_dir

    trainer, _ = _trainer(tmp_path, ["trainer.save_freq=1"])

    def kill_after_step_1(metrics):
        if metrics["training/global_step"] == 1:
            ray.kill(trainer.actor.workers[0])

    try:
        trainer.init_workers()
        with pytest.raises(RuntimeError) as err:
            trainer.fit(3, on_step=kill_after_step_1)
    finally:
        trainer.shutdown()
    message = str(err.value)
    assert message.startswith(
        f"step 2: a worker failed, the run stops; the last good checkpoint is {tmp_path}/global_step_1"
    )
    assert "RayActorError" in message or "ActorDiedError" in message
    assert find_resume_dir(tmp_path) == (tmp_path / "global_step_1").resolve()
    assert (tmp_path / "global_step_1" / "actor" / "megatron_rl_complete.json").is_file()
    assert not (tmp_path / "global_step_2").exists()
    assert not list(tmp_path.glob(".global_step_*"))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "grpo", *args], capture_output=True, text=True, timeout=300
    )


def test_layout_or_memory_that_cannot_fit_is_refused_before_allocation(tmp_path):
    out = tmp_path / "run"
    done = _cli("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", f"trainer.default_local_dir={out}")
    assert done.returncode == 2
    assert "world_size=1 is not divisible by tensor_model_parallel_size" in done.stderr, done.stderr[-2000:]
    assert not out.exists()
    # 64 layers x 8192 hidden (~52 B parameters) cannot fit in this machine's RAM.
    done = _cli(
        "actor_rollout_ref.model.config.num_layers=64",
        "actor_rollout_ref.model.config.hidden_size=8192",
        "actor_rollout_ref.model.config.ffn_hidden_size=28672",
        "actor_rollout_ref.model.config.num_attention_heads=64",
        "actor_rollout_ref.model.config.num_query_groups=8",
        "actor_rollout_ref.model.config.kv_channels=128",
        f"trainer.default_local_dir={out}",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "GiB are available" in done.stderr and "optimizer state" in done.stderr, done.stderr[-2000:]
    assert not (out / "base_model").exists()
