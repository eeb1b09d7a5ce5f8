"""tools/bench_weight_sync.py runs end to end at a tiny size (Megatron actor -> bridge export -> vLLM)
and reports every key it promises, one row per transport (``--transport all``, one engine)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_weight_sync_tiny_run_prints_json_last():
    import torch

    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "bench_weight_sync.py"),
        "--transport",
        "all",
        "--hidden",
        "64",
        "--intermediate",
        "128",
        "--layers",
        "2",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "32",
        "--vocab",
        "512",
        "--bucket-mb",
        "0.1",
        "--repeats",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {row["transport"]: row for row in result["rows"]}
    assert list(rows) == ["colocated", "bytes", "shm", "broadcast", "nccl", "cuda_ipc"]  # the transport column
    lines = proc.stdout.strip().splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["transport", "MiB"])
    assert [line.split()[0] for line in lines[head + 1 : -1]] == list(rows)  # the table: one row per transport
    if not torch.cuda.is_available():
        assert [rows[n] for n in ("nccl", "cuda_ipc")] == [
            {"transport": n, "skipped": "needs CUDA"} for n in ("nccl", "cuda_ipc")
        ]
        assert "nccl       needs CUDA" in proc.stdout
    for name in ("colocated", "bytes", "broadcast"):  # every CPU transport moved the same bytes
        assert rows[name]["bytes"] == rows["shm"]["bytes"] and rows[name]["sync_over_floor"] > 1, rows[name]
    out = {**rows["shm"], **{k: v for k, v in result.items() if k != "rows"}, "transport": "shm"}
    # embed + lm_head (512 x 64) + per layer q (64x64), k, v (32x64), o (64x64), gate/up/down (128x64), 4 norms
    per_layer = 64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3 + 64 * 2 + 32 * 2
    assert out["bytes"] == 4 * (2 * 512 * 64 + 2 * per_layer + 64)
    assert out["num_tensors"] == 3 + 2 * 11 and out["num_buckets"] >= 4  # 0.1 MiB buckets
    assert out["sync_s"] > 0 and out["floor_s"] > 0
    assert out["sync_over_floor"] == out["sync_s"] / out["floor_s"]
    assert (out["transport"], out["repeats"], out["bucket_mb"]) == ("shm", 2, 0.1)
    assert (out["source"], out["tp"]) == ("megatron_bridge_export", 1)
    assert 0 < out["export_max_live_bytes"] <= 2 * 0.1 * 2**20  # one bucket (+ one tensor) at a time
    assert out["sync_over_floor"] > 1  # a sync copies each byte more than once


def test_bench_weight_sync_rejects_bad_sizes():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "bench_weight_sync.py"), "--layers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "--layers=0 must be >= 1" in proc.stderr
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "bench_weight_sync.py"), "--tp", "2", "--kv-heads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "--kv-heads=1 must be divisible by --tp=2" in proc.stderr
