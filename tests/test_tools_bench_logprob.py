"""tools/bench_logprob.py runs end to end at tiny sizes and reports every key it promises."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_logprob_tiny_run_prints_json_last():
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "bench_logprob.py"),
        "--tokens",
        "64",
        "--vocab",
        "512",
        "--hidden",
        "32",
        "--chunk-size",
        "16",
        "--linear-chunk-size",
        "16",
        "--iters",
        "1",
        "--temperature",
        "0.8",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for prefix in ("", "linear_"):
        for key in ("naive_peak_bytes", "fused_peak_bytes", "peak_ratio", "naive_ms", "fused_ms", "time_ratio"):
            assert f"{prefix}{key}" in out, key
        assert out[f"{prefix}naive_ms"] > 0 and out[f"{prefix}fused_ms"] > 0
        assert out[f"{prefix}time_ratio"] == out[f"{prefix}fused_ms"] / out[f"{prefix}naive_ms"]
        # fused results equal float32 math on the same inputs
        assert out[f"{prefix}fused_max_abs_logp_err"] < 1e-5
        assert out[f"{prefix}fused_max_abs_entropy_err"] < 1e-5
    assert out["fused_max_rel_grad_err"] < 1e-5
    assert out["linear_fused_max_rel_grad_hidden_err"] < 1e-5
    assert out["linear_fused_max_rel_grad_weight_err"] < 1e-5
    assert (out["tokens"], out["vocab"], out["hidden"], out["dtype"]) == (64, 512, 32, "fp32")
    assert out["logits_bytes"] == 64 * 512 * 4
    assert "ce_ms" not in out  # the cross_entropy reference runs on CUDA only


def test_bench_logprob_rejects_bad_sizes():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "bench_logprob.py"), "--tokens", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "--tokens=0 must be >= 1" in proc.stderr
