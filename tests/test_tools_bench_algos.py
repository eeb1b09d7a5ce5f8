"""tools/bench_algos.py: a small run prints the JSON figures and its loop reference is verl's GRPO."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.algos import ADV_ESTIMATORS
from tests.numerics import assert_within, max_abs_diff, rounding_bound

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_algos.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_algos", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grpo_bound(group_size: int, scale: float) -> float:
    """Two float32 GRPO paths, each within eps * (group_size + 3) * scale of the exact advantages.

    Dyadic rewards make the group means exact; the std (a group_size-term sum of squares, a divide
    and a sqrt) and the final division round, relative to the advantages' scale. A population std
    in place of the sample std moves them by ~15 %, a sample in the wrong group by ~1.
    """
    return 2 * rounding_bound(group_size + 3, scale)


def test_small_run_reports_agreeing_figures():
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--num-responses",
            "90",
            "--group-size",
            "4",
            "--response-length",
            "16",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=TOOL.parents[1],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "batch: 90 responses, groups of 4, 16 tokens, 1 threads"
    result = json.loads(lines[-1])
    for key in (
        "grpo_ms",
        "grpo_loop_ms",
        "grpo_speedup_vs_loop",
        "gae_ms",
        "rloo_ms",
        "reinforce_plus_plus_ms",
        "peak_rss_mib",
        "grpo_scores_only_speedup_vs_loop",
        "grpo_fresh_pages_ms",
        "grpo_loop_fresh_pages_ms",
        "grpo_speedup_vs_loop_fresh_pages",
        "grpo_cpu_ms",
        "grpo_loop_cpu_ms",
        "grpo_speedup_vs_loop_cpu_time",
        "grpo_speedup_vs_loop_fresh_pages_cpu_time",
    ):
        assert result[key] > 0, key
    assert (result["num_responses"], result["group_size"], result["response_length"]) == (90, 4, 16)
    # |advantage| <= (n - 1) / sqrt(n) for a group of n normalised by its sample std (1.5 for n = 4).
    assert_within(result["grpo_max_abs_diff_vs_loop"], _grpo_bound(4, 3 / 2), "bench_algos grpo vs loop")
    # The speedups are printed to 2 decimals, the times to 3: allow half a printed unit on top of 1 %.
    assert result["grpo_speedup_vs_loop"] == pytest.approx(
        result["grpo_loop_ms"] / result["grpo_ms"], rel=1e-2, abs=0.005
    )
    assert result["grpo_speedup_vs_loop_fresh_pages"] == pytest.approx(
        result["grpo_loop_fresh_pages_ms"] / result["grpo_fresh_pages_ms"], rel=1e-2, abs=0.005
    )
    assert result["thp"] is True and result["repeats"] == 1
    assert result["allocator"] == "glibc, freed memory reused"  # Linux/glibc: mallopt is there
    assert sum(line.startswith("grpo, ") for line in lines) == 2  # fresh pages, then reused memory


def test_fresh_pages_flag_keeps_glibc_defaults_for_the_headline():
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--num-responses",
            "40",
            "--group-size",
            "4",
            "--response-length",
            "8",
            "--repeats",
            "2",
            "--fresh-pages",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=TOOL.parents[1],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["allocator"] == "glibc defaults (fresh pages)"
    assert (result["grpo_ms"], result["grpo_loop_ms"]) == (
        result["grpo_fresh_pages_ms"],
        result["grpo_loop_fresh_pages_ms"],
    )
    assert sum(line.startswith("grpo, ") for line in lines) == 1


def test_interleaved_timing_takes_turns_after_one_warmup_round():
    tool = _load_tool()
    calls = []
    timings, results = tool.time_interleaved(
        {"a": lambda: calls.append("a") or len(calls), "b": lambda: calls.append("b") or len(calls)}, repeats=3
    )
    assert calls == ["a", "b"] * 4  # warm-up round + 3 timed rounds
    assert results == {"a": 7, "b": 8}
    for name in ("a", "b"):
        assert len(timings[name]["runs"]) == 3 and timings[name]["ms"] == sorted(timings[name]["runs"])[1]
        assert timings[name]["cpu_ms"] >= 0


def test_bad_size_is_rejected():
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--group-size", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TOOL.parents[1],
    )
    assert proc.returncode == 2 and "--group-size must be >= 1, got 0" in proc.stderr


@pytest.mark.parametrize("norm", [True, False])
def test_loop_reference_matches_the_registry(norm):
    tool = _load_tool()
    batch = tool.make_batch(num_responses=30, group_size=4, response_length=8, seed=3)  # last group has 2
    batch["index"][5] = "a-lonely-uid"  # a one-sample group: mean 0, std 1 in both
    batch["token_level_rewards"][5, 0] = 2.0
    loop = tool.grpo_loop_reference(
        batch["token_level_rewards"], batch["response_mask"], batch["index"], norm_adv_by_std_in_grpo=norm
    )
    ours, _ = ADV_ESTIMATORS["grpo"](
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"],
        index=batch["index"],
        norm_adv_by_std_in_grpo=norm,
    )
    assert ours.shape == loop.shape and ours.dtype == loop.dtype == torch.float32
    assert_within(max_abs_diff(ours, loop), _grpo_bound(4, float(loop.abs().max())), f"grpo norm={norm} vs loop")
    assert loop[5, 0].item() == pytest.approx(
        batch["token_level_rewards"][5].sum().item() / (1 + 1e-6)
        if norm
        else batch["token_level_rewards"][5].sum().item()
    )
    assert batch["token_level_rewards"].shape == (30, 8) and bool((batch["response_mask"].sum(-1) >= 1).all())
