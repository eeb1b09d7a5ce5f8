"""``tools/bench_gpu.sh --check`` (tools/gpu_check.py): one line per GPU-only path.

On this CPU machine the suite skips every gpu-marked test, so every path is a SKIP with the
suite's reason and the script exits 0; ``fold`` turns a failed or missing test into a FAIL line.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from tools.gpu_check import PATHS, fold

ROOT = Path(__file__).resolve().parents[1]


def test_check_prints_one_line_per_path():
    proc = subprocess.run(
        ["bash", "tools/bench_gpu.sh", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    lines = proc.stdout.strip().splitlines()
    assert [line.split(" ", 1)[1].split(":")[0] for line in lines] == list(PATHS), proc.stdout + proc.stderr
    if not torch.cuda.is_available():
        assert proc.returncode == 0 and all(line.startswith("SKIP ") for line in lines), proc.stdout


def test_a_failed_or_missing_test_fails_its_path():
    paths = {"a": ["t.py::x", "t.py::y"], "b": ["t.py::z"], "c": ["t.py::w"]}
    results = {"t.py::x": ("pass", ""), "t.py::y": ("fail", "AssertionError: 3 != 4"), "t.py::z": ("skip", "no GPU")}
    assert fold(paths, results) == [
        ("FAIL", "a", "AssertionError: 3 != 4"),
        ("SKIP", "b", "no GPU"),
        ("FAIL", "c", "t.py::w did not run"),
    ]
    assert fold({"a": ["t.py::x"]}, results) == [("PASS", "a", "")]


def test_a_rank_failure_names_its_cause_not_only_its_rank():
    from tools.gpu_check import failure_summary

    text = (
        'Traceback (most recent call last):\n  File "parallel/mesh.py", line 181, in init_mesh\n'
        "RuntimeError: Cannot re-initialize CUDA in forked subprocess\n"
    )
    assert failure_summary("parallel.testing.DistributedTestError: _case failed on rank 0 of 1:", text) == (
        "parallel.testing.DistributedTestError: _case failed on rank 0 of 1: ... "
        "RuntimeError: Cannot re-initialize CUDA in forked subprocess"
    )
    assert failure_summary("AssertionError: 1 != 2", "AssertionError: 1 != 2") == "AssertionError: 1 != 2"
    assert failure_summary("", "") == ""
