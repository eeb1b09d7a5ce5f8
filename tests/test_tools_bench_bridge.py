"""tools/bench_bridge.py exports a TP=2 model at a tiny size and reports every key it promises, last."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, str(ROOT / "tools" / "bench_bridge.py")]


def test_bench_bridge_tiny_run_prints_json_last():
    cmd = [
        *BENCH,
        "--hidden",
        "64",
        "--ffn",
        "128",
        "--layers",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "512",
        "--bucket-mb",
        "0.05",
        "--repeats",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Qwen3 layer: q, o (64x64), k, v (32x64), q/k norms (16), two norms (64), gate/up (128x64), down (64x128);
    # plus embedding and lm_head (512x64) and the final norm, all float32.
    per_layer = 2 * 64 * 64 + 2 * 32 * 64 + 2 * 16 + 2 * 64 + 3 * 128 * 64
    assert out["bytes"] == 4 * (2 * per_layer + 2 * 512 * 64 + 64)
    assert out["num_tensors"] == 3 + 2 * 11
    assert out["num_buckets"] >= 5  # 0.05 MiB buckets over ~0.5 MiB
    assert out["max_live_bytes"] <= int(0.05 * 2**20) + 4 * 512 * 64  # bucket + the largest parameter
    assert out["export_s"] > 0 and out["floor_s"] > 0
    assert out["export_over_floor"] == out["export_s"] / out["floor_s"]
    assert (out["tp"], out["all_ranks"], out["repeats"], out["dtype"]) == (2, False, 2, "fp32")


def test_bench_bridge_rejects_bad_sizes():
    proc = subprocess.run([*BENCH, "--heads", "3"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--heads=3 and --vocab=32000 must be divisible by --tp=2" in proc.stderr
