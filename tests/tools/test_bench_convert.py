"""tools/bench_convert.py --smoke: a tiny Qwen3 through the floor and both conversions, the JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_prints_the_figures_and_json_last(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_convert.py"), "--smoke", "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in (
        "mb_per_s",
        "floor_mb_per_s",
        "peak_over_checkpoint",
        "peak_over_checkpoint_verify",
        "startup_s",
        "mcore_to_hf_mb_per_s",
        "mcore_to_hf_peak_over_checkpoint",
        "mcore_to_hf_startup_s",
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["checkpoint_bytes"] > 100_000
    # The tiny checkpoint is ~0.5 MiB: process memory dwarfs it (the ratio means something at scale only).
    assert result["peak_over_checkpoint"] > 10 and result["peak_bytes_verify"] > 0
    assert lines[0].startswith("floor: read + write ") and "MB/s" in lines[0]
    assert any(line.startswith("convert: ") for line in lines) and any("--verify" in line for line in lines)
    assert any(line.startswith("mcore-to-hf: ") for line in lines)
    assert "peak memory " in proc.stdout and "max |logit diff|" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # the temporary work directory is gone
