"""tools/bench_gpu.sh --smoke: every benchmark of the GPU run, at tiny sizes on CPU, one JSON line each
(so the one-command GPU run cannot rot)."""

import json
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_bench_gpu_smoke_prints_one_json_line_per_benchmark():
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "bench_gpu.sh"), "--smoke"], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert [line["benchmark"] for line in lines] == [
        "packing",
        "train_dense",
        "train_moe",
        "logprob",
        "offload",
        "algos",
        "bridge",
        "transports",
        "weight_sync",
        "rollout_node",
    ]
    by_name = {line["benchmark"]: line for line in lines}
    assert not [line for line in lines if "error" in line]
    assert {"padding_fraction", "ideal_speedup", "speedup", "peak_ratio"} <= set(by_name["packing"])
    assert by_name["train_dense"]["preset"] == "tiny" and by_name["train_moe"]["preset"] == "tiny-moe"
    assert by_name["train_dense"]["packed"] is True and by_name["train_moe"]["step_ms"] > 0
    assert by_name["offload"]["update_after_reload_ok"] is True
    if not torch.cuda.is_available():  # nothing to move on CPU
        assert by_name["offload"]["offloaded_bytes"] == 0
    assert "fused_ms" in by_name["logprob"] and "export_s" in by_name["bridge"]
    assert by_name["weight_sync"]["skipped"].startswith("smoke")
    transports = {row["transport"]: row for row in by_name["transports"]["rows"]}
    assert list(transports) == ["shm", "broadcast", "cuda_ipc", "nccl"]
    assert transports["shm"]["gb_per_s"] > 0 and transports["broadcast"]["over_floor"] > 0
    if not torch.cuda.is_available():
        assert transports["cuda_ipc"]["skipped"] == transports["nccl"]["skipped"] == "needs CUDA"
    node = by_name["rollout_node"]  # smoke: the 8-GPU node's expected engine maps (gpu_node.plan)
    assert node["gpus"] == 8 and node["colocated"]["replicas"] == 4 and node["colocated"]["side_band_world"] == 9
    assert node["colocated"]["engines"] == [[[0, 2 * r], [0, 2 * r + 1]] for r in range(4)]
    assert node["separate"]["engines"] == [[[1, 0]], [[1, 1]]]
    assert all(line["wall_s"] >= 0 for line in lines if "wall_s" in line)
