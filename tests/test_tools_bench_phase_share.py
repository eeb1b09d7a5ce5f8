"""tools/bench_phase_share.py: its reading of a run's ``timing_s/*``, the share comparison, and its refusals.
(The full check trains a recipe for a minute; its figures are in the tool's commit, not asserted here:
timings are the machine's.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.planner.step_run import PhaseTime
from megatron_rl.planner.step_time import StepTime
from tools.bench_phase_share import compare, measured_phases

ROOT = Path(__file__).resolve().parent.parent


def _row(step, gen, log_prob, update):
    return {
        "timing_s/step": step,
        "timing_s/gen": gen,
        "timing_s/old_log_prob": log_prob,
        "timing_s/update_actor": update,
        "timing_s/reward": 0.01,
        "response_length/mean": 15.0,
        "response_length/max": 16.0,
        "prompt_length/mean": 24.0,
    }


def test_measured_phases_drop_the_first_step_and_sum_the_rest(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [_row(9.0, 8.0, 0.5, 0.5), _row(1.0, 0.4, 0.2, 0.39), _row(1.0, 0.4, 0.2, 0.39)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    m = measured_phases(path)
    assert m["steps"] == 2 and m["timing"]["step"] == 2.0 and m["timing"]["gen"] == pytest.approx(0.8)
    assert (m["prompt_mean"], m["response_mean"], m["response_max"]) == (24.0, 15.0, 16.0)


def test_compare_judges_phases_above_the_minimum_share():
    phases = {
        "gen": PhaseTime(0.5, "engine overhead"),
        "old_log_prob": PhaseTime(0.1, "compute"),
        "update_actor": PhaseTime(0.39, "compute"),
        "update_weights": PhaseTime(0.01, "engine load"),
    }
    st = StepTime("CPU", "sync", phases, 1.0, 1.0, 1, kv=None, response_mean=15.0, response_p99=16.0)
    measured = {"steps": 2, "timing": {"step": 2.0, "gen": 0.8, "old_log_prob": 0.4, "update_actor": 0.78}}
    out = compare(st, measured, min_share=0.05, tolerance=0.3)
    gen, log_prob = out["phases"]["gen"], out["phases"]["old_log_prob"]
    assert gen["measured_share"] == 0.4 and gen["predicted_share"] == 0.5 and gen["relative_error"] == 0.25
    assert gen["within"] is True and log_prob["relative_error"] == -0.5 and log_prob["within"] is False
    sync = out["phases"]["update_weights"]  # measured 0 s: below the minimum share, reported, not judged
    assert sync["judged"] is False and sync["within"] is None and out["all_within"] is False
    assert out["unmodelled_share"] == pytest.approx(0.01)  # 2.0 - 1.98 of the step


def test_remax_baseline_generation_counts_with_gen():
    # the model's gen holds ReMax's greedy baseline (extra_generations); the trainer times it as gen_max
    phases = {"gen": PhaseTime(0.6, "engine overhead"), "update_actor": PhaseTime(0.4, "compute")}
    st = StepTime("CPU", "sync", phases, 1.0, 1.0, 1, kv=None, response_mean=15.0, response_p99=16.0)
    measured = {"steps": 1, "timing": {"step": 1.0, "gen": 0.4, "gen_max": 0.2, "reward": 0.05, "update_actor": 0.35}}
    gen = compare(st, measured, min_share=0.05, tolerance=0.3)["phases"]["gen"]
    assert gen["timer"] == "gen+gen_max" and gen["measured_s"] == pytest.approx(0.6) and gen["within"] is True


def test_rejects_a_single_step():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_phase_share.py"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--steps must be >= 2 (the first step is dropped), got 1" in out.stderr


def test_measured_phases_read_the_engines_busy_time_and_the_agents_turns(tmp_path):
    path = tmp_path / "metrics.jsonl"
    extra = {"async/rollout_idle_s": 0.25, "agent/num_turns/mean": 2.0, "agent/tool_call_rate": 0.5}
    rows = [_row(9.0, 8.0, 0.5, 0.5), {**_row(1.0, 0.0, 0.0, 0.9), **extra}, {**_row(1.0, 0.1, 0.0, 0.8), **extra}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    m = measured_phases(path)
    assert m["rollout_busy"] == pytest.approx(1.5)  # (1.0 - 0.25) twice: the first step dropped
    assert m["agent"] == {"agent/num_turns/mean": 2.0, "agent/tool_call_rate": 0.5}
    sync = tmp_path / "sync.jsonl"
    sync.write_text("\n".join(json.dumps(_row(1.0, 0.4, 0.2, 0.39)) for _ in range(3)) + "\n")
    assert measured_phases(sync)["rollout_busy"] is None and measured_phases(sync)["agent"] == {}


def test_overlapped_async_judges_the_engines_busy_time_and_the_trainers_wait():
    # separate_async: the trainer's timing_s/gen is its wait; the engine generated 0.5 s of each 1.0 s step
    phases = {
        "gen": PhaseTime(0.45, "engine overhead"),
        "old_log_prob": PhaseTime(0.0, "skipped"),
        "update_actor": PhaseTime(0.9, "compute"),
        "update_weights": PhaseTime(0.05, "engine load"),
    }
    st = StepTime(
        "CPU", "separate_async", phases, 0.95, 1.0, 1, kv=None, response_mean=15.0, response_p99=16.0, overlap=True
    )
    measured = {
        "steps": 2,
        "timing": {"step": 2.0, "gen": 0.02, "update_actor": 1.8, "update_weights": 0.1},
        "rollout_busy": 1.0,
    }
    out = compare(st, measured, min_share=0.05, tolerance=0.3)
    gen, wait = out["phases"]["gen"], out["phases"]["gen_wait"]
    assert gen["timer"] == "step-async/rollout_idle_s" and gen["measured_s"] == 0.5 and gen["within"] is True
    assert wait["timer"] == "gen" and wait["predicted_s"] == 0.0 and wait["measured_s"] == 0.01
    assert wait["judged"] is False  # 1 % of the step: trainer-bound on both sides
    assert out["unmodelled_share"] == pytest.approx(
        1 - (0.01 + 0.9 + 0.05)
    )  # the wait, not the busy time, is the trainer's
    with pytest.raises(SystemExit, match="async/rollout_idle_s"):
        compare(st, {**measured, "rollout_busy": None}, min_share=0.05, tolerance=0.3)
