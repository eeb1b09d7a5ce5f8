"""tools/bench_packing.py: the long-tailed workload it promises, and a smoke run whose JSON (last line)
holds consistent figures."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "bench_packing.py"
sys.path.insert(0, str(ROOT))


def test_workload_is_long_tailed_with_a_quarter_of_the_limit_on_average():
    from tools.bench_packing import make_batch, make_workload

    prompts, responses = make_workload(256, (32, 256), 2048, seed=0)
    assert int(prompts.min()) >= 32 and int(prompts.max()) <= 256
    assert int(responses.min()) >= 1 and int(responses.max()) == 2048  # the tail reaches the limit
    assert 400 < float(responses.float().mean()) < 620  # about 2048 / 4
    assert float(responses.float().median()) < float(responses.float().mean())  # long right tail
    batch = make_batch(prompts[:3], responses[:3], 256, 2048, vocab=100)
    assert batch["attention_mask"].sum(-1).tolist() == (prompts[:3] + responses[:3]).tolist()
    assert batch["response_mask"].sum(-1).tolist() == responses[:3].tolist()


def test_smoke_run_prints_consistent_json_last():
    proc = subprocess.run([sys.executable, str(TOOL), "--smoke"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["preset"], out["samples"], out["micro_batch_size"], out["token_budget"]) == ("smoke", 16, 4, 4 * 80)
    assert abs(out["padding_fraction"] - (1 - out["valid_tokens"] / out["padded_tokens"])) < 1e-4
    assert abs(out["ideal_speedup"] - 1 / (1 - out["padding_fraction"])) < 1e-2
    assert abs(out["speedup"] - out["padded_s"] / out["packed_s"]) < 0.05 * out["speedup"]
    assert out["packed_micro_batches"] < out["padded_micro_batches"] == 4
    assert out["padded_mb_tokens"] == out["token_budget"] >= out["packed_mb_tokens"] > out["token_budget"] // 2
    assert out["padded_peak_bytes"] > 0 and out["packed_peak_bytes"] > 0
    assert abs(out["peak_ratio"] - out["packed_peak_bytes"] / out["padded_peak_bytes"]) < 1e-3


def test_bad_sizes_are_refused():
    proc = subprocess.run([sys.executable, str(TOOL), "--samples", "10"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--samples=10 must be a multiple of --micro-batch-size=4" in proc.stderr
    proc = subprocess.run([sys.executable, str(TOOL), "--repeats", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--repeats must be >= 1, got 0" in proc.stderr
