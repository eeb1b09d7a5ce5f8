"""``--verify`` compares like with like in bf16 and still catches wrong mappings.

bf16 checkpoints of the five original families convert at TP=1 with ``--verify --verify-dtype
both``: the fp32 forward must match HF's within 1e-4 (max |logit diff|), the bf16 forward's per-token mean
|logit diff| within 3x HF's own bf16-vs-fp32 one on the same prompts (printed). Three deliberately wrong
mappings (the test-only ``MEGATRON_RL_CONVERT_FAULT`` hook: query heads 0/1 swapped, gate/up
swapped, expert e loaded from e+1) must fail both checks and leave no output. All cases run in
one process (``convert_cases.py``: the torchrun path, the process is the only rank).

They run the default layer-group verify (one decoder layer per group): every group's hidden states
agree for correct weights, and a wrong mapping (applied to every layer) is named at group 1. One
case keeps ``--verify-layers-per-group 0`` (both whole models), and a negative size is refused.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
FAULTS = {"qkv_heads": "qwen3", "gate_up": "llama", "expert_off_by_one": "qwen3_moe"}
LINE = re.compile(
    r"verify \((\w+) forward\): (max|per-token mean) \|logit diff\| = ([0-9.e+-]+) (?:\(max ([0-9.e+-]+)\) )?"
    r"over 3 prompts \(\d+ tokens\), tolerance ([0-9.e+-]+)(.*): (OK|FAILED)$",
    re.M,
)
GAP = re.compile(r"that gap: per-token mean ([0-9.e+-]+), max ([0-9.e+-]+)")
GROUPS = re.compile(
    r"^verify \((\w+) forward\) hidden states: 2 layer groups of 1 layer\(s\), .*: (every group agrees|"
    r"first diverging: layer group (\d) of 2 \(decoder layer (\d)\), [0-9.e+-]+ > [0-9.e+-]+)",
    re.M,
)


def _groups(stdout: str) -> dict[str, Optional[int]]:
    """{dtype: None when every layer group agrees, else the first diverging group (1-based)}."""
    return {
        dtype: (None if verdict == "every group agrees" else int(group))
        for dtype, verdict, group, _layer in GROUPS.findall(stdout)
    }


def _lines(stdout: str) -> dict[str, dict]:
    out = {}
    for dtype, kind, value, max_diff, tol, rest, verdict in LINE.findall(stdout):
        entry = dict(kind=kind, value=float(value), max=float(max_diff or value), tol=float(tol), ok=verdict == "OK")
        m = GAP.search(rest)
        if m:
            entry.update(mean_gap=float(m.group(1)), gap=float(m.group(2)))
        out[dtype] = entry
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    work = tmp_path_factory.mktemp("verify")
    cases, names = [], []
    for family in FAMILIES:
        build_tiny_hf_checkpoint(work / family, family, dtype=torch.bfloat16)
        names.append(family)
        cases.append(
            dict(
                tool="hf-to-mcore",
                argv=[
                    "--hf-dir",
                    str(work / family),
                    "--out-dir",
                    str(work / f"{family}.mcore"),
                    "--verify",
                    "--verify-dtype",
                    "both",
                ],
            )
        )
    for fault, family in FAULTS.items():
        names.append(fault)
        cases.append(
            dict(
                tool="hf-to-mcore",
                env={"MEGATRON_RL_CONVERT_FAULT": fault},
                argv=[
                    "--hf-dir",
                    str(work / family),
                    "--out-dir",
                    str(work / f"{fault}.mcore"),
                    "--verify",
                    "--verify-dtype",
                    "both",
                ],
            )
        )
    # The other direction, bf16 compute only: HF's forward of the written files is the other side.
    names.append("back")
    cases.append(
        dict(
            tool="mcore-to-hf",
            argv=[
                "--mcore-dir",
                str(work / "qwen3_moe.mcore"),
                "--out-dir",
                str(work / "back"),
                "--verify",
                "--verify-dtype",
                "model",
            ],
        )
    )
    # Both whole models at once (the pre-layer-group verify), and a group size that is refused.
    names.append("whole")
    cases.append(
        dict(
            tool="hf-to-mcore",
            argv=[
                "--hf-dir",
                str(work / "qwen3_moe"),
                "--out-dir",
                str(work / "whole"),
                "--verify",
                "--verify-dtype",
                "both",
                "--verify-layers-per-group",
                "0",
            ],
        )
    )
    names.append("bad_group")
    cases.append(
        dict(
            tool="hf-to-mcore",
            argv=[
                "--hf-dir",
                str(work / "qwen3"),
                "--out-dir",
                str(work / "bad"),
                "--verify",
                "--verify-layers-per-group",
                "-1",
            ],
        )
    )
    (work / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "tools" / "convert_cases.py"), str(work / "cases.json")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), proc.stdout[-4000:]
    return work, dict(zip(names, results))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_verify_passes_correct_weights(runs, family):
    work, results = runs
    r = results[family]
    assert r["rc"] == 0, (r["stdout"][-2000:], r["stderr"][-2000:])
    lines = _lines(r["stdout"])
    fp32, bf16 = lines["float32"], lines["bfloat16"]
    assert fp32["ok"] and fp32["kind"] == "max" and fp32["value"] < 1e-4 and fp32["tol"] == 1e-4
    assert bf16["ok"] and bf16["kind"] == "per-token mean" and bf16["mean_gap"] > 1e-3  # HF's own bf16 differs
    assert bf16["tol"] == pytest.approx(max(3 * bf16["mean_gap"], 2e-2), rel=1e-3)
    # Like with like: Megatron's bf16 forward is about as far from fp32 as HF's own.
    assert bf16["value"] < 2 * bf16["mean_gap"]
    assert _groups(r["stdout"]) == {"float32": None, "bfloat16": None}  # every layer group agrees in both
    assert (work / f"{family}.mcore" / "megatron_rl_conversion.json").is_file()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_wrong_mapping_fails_in_fp32_and_bf16(runs, fault):
    work, results = runs
    r = results[fault]
    assert r["rc"] == 1 and "Traceback" not in r["stderr"], (r["stdout"][-2000:], r["stderr"][-2000:])
    lines = _lines(r["stdout"])
    assert not lines["float32"]["ok"] and lines["float32"]["value"] > 0.5
    bf16 = lines["bfloat16"]
    assert not bf16["ok"] and bf16["value"] > 5 * bf16["tol"]
    assert "error: --verify: " in r["stderr"] and "the output was not written" in r["stderr"]
    # The wrong mapping is in every layer: the first layer group diverges, in both dtypes, and is named.
    assert _groups(r["stdout"]) == {"float32": 1, "bfloat16": 1}
    assert r["stderr"].count("(first diverging: layer group 1 of 2 (decoder layer 0))") == 2, r["stderr"][-2000:]
    assert not (work / f"{fault}.mcore").exists()
    assert not [p.name for p in work.iterdir() if p.name.startswith(f".{fault}.mcore")]


def test_bf16_verify_of_the_export(runs):
    r = runs[1]["back"]
    assert r["rc"] == 0, (r["stdout"][-2000:], r["stderr"][-2000:])
    bf16 = _lines(r["stdout"])["bfloat16"]
    assert bf16["ok"] and bf16["mean_gap"] > 1e-3 and "float32" not in _lines(r["stdout"])
    assert _groups(r["stdout"]) == {"bfloat16": None}  # HF's reference streamed from the files just written


def test_whole_model_verify_and_a_bad_group_size(runs):
    work, results = runs
    r = results["whole"]
    assert r["rc"] == 0, (r["stdout"][-2000:], r["stderr"][-2000:])
    lines = _lines(r["stdout"])
    assert lines["float32"]["ok"] and lines["float32"]["value"] < 1e-4 and lines["bfloat16"]["ok"]
    assert "hidden states" not in r["stdout"]  # no layer groups
    r = results["bad_group"]
    assert (
        r["rc"] == 1
        and "error: --verify-layers-per-group=-1 is not allowed; give 0 (the whole model at once) "
        "or a number of layers >= 1"
        in r["stderr"]
    ), r["stderr"][-2000:]
    assert not (work / "bad").exists()
