"""Every GPU-only path once, with tiny models: one PASS / FAIL / SKIP line per path.

    python tools/gpu_check.py [--timeout 290]      (tools/bench_gpu.sh --check runs it)

Each path is proven by gpu-marked tests of the suite (they hand the roles host batches, as the
driver does, so a missing device move fails them); this runs them in one pytest process with a
JUnit report and folds the test results into one line per path, so the first lent GPU answers
every question at once, in under 5 minutes on one node. Without CUDA every path is a SKIP (the
suite skips gpu-marked tests). FP8 rollout is a SKIP on a GPU without FP8 (compute capability
below 8.9). Exits 1 when a path failed or the run passed its time limit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PATHS: dict[str, list[str]] = {
    "device moves (host batch in, host results out)": [
        "tests/megatron_rl/engine/test_gpu_paths.py::test_worker_call_on_cuda_takes_and_returns_host_tensors"
    ],
    "TE layers + THD attention": [
        "tests/megatron_rl/engine/test_packing.py::test_transformer_engine_thd_attention_equals_padded"
    ],
    "context parallel CP=2 (bf16)": [
        "tests/megatron_rl/engine/test_engine.py::test_context_parallel_actor_equals_single_rank"
    ],
    "DistributedOptimizer on NCCL": [
        "tests/megatron_rl/engine/test_gpu_paths.py::test_distributed_optimizer_on_nccl_equals_the_plain_one"
    ],
    "offload and reload": [
        "tests/megatron_rl/engine/test_engine.py::test_offload_round_trip_keeps_weights_and_frees_gpu_memory",
        "tests/megatron_rl/engine/test_offload.py::test_offload_frees_the_planned_gpu_bytes",
        "tests/megatron_rl/engine/test_gpu_paths.py::"
        "test_offload_pins_exactly_what_it_holds_outside_the_caching_host_allocator",
    ],
    "FlexAttention packed segments": [
        "tests/megatron_rl/models/test_attention.py::test_flex_attention_on_cuda_equals_segments_with_gradients"
    ],
    "vLLM sleep / wake": [
        "tests/megatron_rl/engine/test_gpu_paths.py::test_vllm_sleep_releases_gpu_memory_and_wake_up_restores_the_engine"
    ],
    "CUDA-IPC sync": ["tests/parallel/test_transport_gpu.py::test_cuda_ipc_between_two_processes_on_one_gpu"],
    "NCCL sync": ["tests/parallel/test_transport_gpu.py::test_nccl_stream_between_two_gpus"],
    "FP8 rollout": [
        "tests/megatron_rl/rollout/test_fp8_rollout.py::test_fp8_vllm_engine_after_a_sync_matches_the_actor"
    ],
    "CPU compatibility off on CUDA": ["tests/parallel/test_cpu_compat.py::test_apply_is_a_no_op_with_cuda"],
}


def fp8_skip_reason() -> str | None:
    """Why FP8 rollout cannot run on this GPU (None: it can, or there is no GPU and the suite skips)."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return None if (major, minor) >= (8, 9) else f"no FP8 on compute capability {major}.{minor} (needs 8.9+)"


def failure_summary(message: str, text: str) -> str:
    """A failure's first line and, where they differ, the last line of its traceback: a rank's
    ``DistributedTestError`` starts "<case> failed on rank 0 of 1:" and its cause is the last line
    (the first H200 check printed only the first)."""
    lines = [line.strip() for line in f"{message}\n{text}".splitlines() if line.strip()]
    if not lines:
        return ""
    first, last = lines[0], lines[-1]
    return (first if last == first else f"{first} ... {last}")[:400]


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """``node id -> (pass | fail | skip, message)`` from a pytest JUnit report."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        node = f"{path}.py::{case.get('name')}"
        status, message = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, message = "fail", failure_summary(child.get("message") or "", child.text or "")
            elif child.tag == "skipped":
                status, message = "skip", (child.get("message") or "").strip()[:300]
        out[node] = status, message
    return out


def fold(paths: dict[str, list[str]], results: dict[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
    """``(PASS | FAIL | SKIP, path, detail)`` per path: FAIL if any test failed or did not run, SKIP if
    every test skipped, else PASS."""
    lines = []
    for name, nodes in paths.items():
        got = [results.get(n, ("fail", f"{n} did not run")) for n in nodes]
        failed = [m for s, m in got if s == "fail"]
        if failed:
            lines.append(("FAIL", name, failed[0]))
        elif all(s == "skip" for s, _ in got):
            lines.append(("SKIP", name, got[0][1]))
        else:
            lines.append(("PASS", name, ""))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=290.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    paths = dict(PATHS)
    skipped = {}
    reason = fp8_skip_reason()
    if reason is not None:
        skipped["FP8 rollout"] = reason
        paths.pop("FP8 rollout")
    nodes = [n for ns in paths.values() for n in ns]
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit1",
            *nodes,
        ]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            tail = proc.stdout[-2000:]
        except subprocess.TimeoutExpired:
            print(f"FAIL gpu check: the run passed its {args.timeout:.0f} s limit")
            return 1
        results = outcomes(junit) if junit.exists() else {}
    if not results:
        print(f"FAIL gpu check: pytest wrote no report\n{tail}")
        return 1
    lines = fold(paths, results) + [("SKIP", name, why) for name, why in skipped.items()]
    for status, name, detail in lines:
        print(f"{status} {name}" + (f": {detail}" if detail else ""))
    return 1 if any(status == "FAIL" for status, _, _ in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
