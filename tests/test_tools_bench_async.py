"""tools/bench_async.py: its long-tailed length draw and rate arithmetic, its argument checks, and a
tiny real run of the fully async mode (pinned rollout + trainer) that prints the promised JSON last."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.bench_async import response_length, steps_per_min  # noqa: E402


def test_response_lengths_are_long_tailed_deterministic_and_bounded():
    lengths = sorted(response_length(seed, 8, 96, 1.1) for seed in range(2000))
    assert lengths == sorted(response_length(seed, 8, 96, 1.1) for seed in range(2000))  # same seed, same length
    assert lengths[0] >= 8 and lengths[-1] == 96  # the cap is reached
    median, p95 = lengths[1000], lengths[1900]
    assert median <= 16 and p95 >= 4 * median  # most batches short, a heavy tail of long ones


def test_steps_per_min_counts_from_the_end_of_the_first_step():
    assert steps_per_min([10.0, 16.0, 22.0, 28.0]) == pytest.approx(10.0)  # 3 steps in 18 s
    with pytest.raises(ValueError, match="at least two"):
        steps_per_min([1.0])


def test_bad_arguments_exit_2_with_the_reason():
    for args, message in (
        (["--steps", "2"], "--steps=2 must be >= 3"),
        (["--modes", "fast"], "unknown ['fast']"),
        (["--min-len", "9", "--max-len", "8"], "--max-len=8 must be >= --min-len=9"),
    ):
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "tools", "bench_async.py"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-500:])


@pytest.mark.slow
def test_bench_async_tiny_run_prints_json_last():
    pytest.importorskip("vllm")
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "bench_async.py"),
        "--modes",
        "async",
        "--steps",
        "3",
        "--batch",
        "2",
        "--n",
        "2",
        "--min-len",
        "4",
        "--max-len",
        "16",
        "--sft-steps",
        "0",
        "--async-ahead",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps_per_min_async"] > 0 and 0.0 <= out["reward_async"] <= 1.0
    assert 0.0 <= out["staleness_mean_async"] <= 1.0 and out["peak_rss_gb_async"] > 0
    assert (out["steps"], out["samples"], out["cores"]) == (3, 12, {"rollout": 0, "trainer": 1})
