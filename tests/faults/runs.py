"""Helpers of the fault cases: the finished run's recipe, subprocess commands, snapshots.

``snapshot(run)`` is the SHA-256 of every file under a run directory: a case that must change
nothing compares it before and after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied scores for a random model; the secondary key is NaN for odd-length responses
    return {"score": min(1.0, len(set(solution_str)) / 8), "acc": float("nan") if len(solution_str) % 2 else 1.0}
"""
SMALL = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "data.val_max_samples=4",
]
"""The toy recipe at its smallest: 2 prompts x 2 samples per step."""


def fixture_overrides(reward: Path, steps: int = 2) -> list[str]:
    """The finished run's overrides (a re-run with these resumes its checkpoint)."""
    return [
        f"trainer.total_training_steps={steps}",
        "trainer.sft_warmup_steps=2",
        *SMALL,
        "trainer.save_freq=1",
        "trainer.test_freq=2",
        "trainer.log_val_generations=1",
        "reward.reward_fn=null",
        f"reward.custom_reward_function.path={reward}",
    ]


def env() -> dict[str, str]:
    """The environment of a ``megatron-rl`` subprocess: this checkout first, no Ray cluster to join
    (``ray_session.env(env())`` adds the session's shared one: tests/ray_session.py)."""
    out = dict(os.environ)
    out.pop("RAY_ADDRESS", None)
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", *args]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(run: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``run`` (hidden leftovers included)."""
    return {str(p.relative_to(run)): sha256(p) for p in sorted(run.rglob("*")) if p.is_file()}


def copy_run(run: Path, dest: Path) -> Path:
    """A copy of the finished run (its checkpoints keep pointing at the original's starting model)."""
    shutil.copytree(run, dest, symlinks=True)
    return dest
