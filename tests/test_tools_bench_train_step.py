"""tools/bench_train_step.py runs a real training step and prints its JSON summary last."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_train_step_tiny():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_train_step.py"), "--seq", "64", "--steps", "1", "--warmup", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["preset"] == "tiny" and result["device"] == "cpu"
    assert result["step_ms"] > 0 and result["tokens_per_s"] > 0 and result["peak_bytes"] > 0
    tokens = 2 * 2 * 64  # mbs x micro-batches x seq
    assert abs(result["tokens_per_s"] - tokens / (result["step_ms"] / 1e3)) / result["tokens_per_s"] < 0.01


def test_bench_train_step_rejects_bad_sizes():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_train_step.py"), "--seq", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--seq must be >= 1, got 0" in out.stderr
