"""tools/convert_hf_to_mcore.py and tools/convert_mcore_to_hf.py, run as users run them (subprocesses)
on a tiny Qwen3 checkpoint with a tokenizer: a bit-exact round trip at TP=2 with --verify, and bad
input -- each a non-zero exit with a clear message and no output directory left behind.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TO_MCORE = [sys.executable, str(ROOT / "tools" / "convert_hf_to_mcore.py")]
TO_HF_CLI = [sys.executable, "-m", "megatron_rl.cli", "convert", "mcore-to-hf"]
DIFF = re.compile(r"max \|logit diff\| = ([0-9.e+-]+) over 3 prompts")


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _hidden(directory: Path) -> list[str]:
    """Temporary directories a conversion may have left (they are hidden siblings of the output)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    built = build_tiny_hf_checkpoint(tmp_path_factory.mktemp("src") / "hf", "qwen3")
    assert built["tokenizer_size"] == 300 and built["config"].vocab_size == 300
    assert (built["path"] / "model.safetensors.index.json").is_file()  # sharded, as hub checkpoints are
    return built["path"]


def test_round_trip_through_the_tools_is_bit_exact(hf_dir, tmp_path):
    mcore, back = tmp_path / "mcore", tmp_path / "hf_back"
    mcore.mkdir()
    (mcore / "stale.txt").write_text("from an older conversion")  # --overwrite replaces the whole directory
    proc = _run(
        [
            *TO_MCORE,
            "--hf-dir",
            str(hf_dir),
            "--out-dir",
            str(mcore),
            "--tp",
            "2",
            "--verify",
            "--overwrite",
            "--ckpt-layout",
            "flat",
        ]
    )  # the dist checkpoint files directly in --out-dir
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (mcore / "stale.txt").exists()
    diff = float(DIFF.search(proc.stdout).group(1))
    assert diff < 1e-4
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"done: qwen3 {hf_dir} (25 tensors, ") and f"-> {mcore} (Megatron dist checkpoint" in last
    assert "at tp=2 pp=1 ep=1 etp=2 on 2 cpu ranks, float32, in " in last and last.endswith(f"{diff:.3e}")

    meta = json.loads((mcore / "megatron_rl_conversion.json").read_text())
    assert (meta["family"], meta["architecture"], meta["dtype"], meta["world_size"]) == (
        "qwen3",
        "Qwen3ForCausalLM",
        "float32",
        2,
    )
    assert meta["layout"]["tensor_model_parallel_size"] == 2 and meta["layout"]["pipeline_model_parallel_size"] == 1
    assert meta["hf_config"] == json.loads((hf_dir / "config.json").read_text())
    assert meta["tokenizer_size"] == 300 and meta["hf_tensors"] == 25
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "megatron_rl_complete.json",
        "metadata.json",
    ):
        assert (mcore / name).is_file(), name

    # Back through the console entry point; the Megatron directory is all it needs.
    proc = _run([*TO_HF_CLI, "--mcore-dir", str(mcore), "--out-dir", str(back), "--verify"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert float(DIFF.search(proc.stdout).group(1)) < 1e-4
    assert proc.stdout.strip().splitlines()[-1].startswith(f"done: qwen3 {mcore} -> {back} (25 tensors, ")
    source, written = _tensors(hf_dir), _tensors(back)
    assert sorted(written) == sorted(source)
    assert [n for n in source if written[n].dtype != source[n].dtype or not torch.equal(written[n], source[n])] == []
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name
    assert _hidden(tmp_path) == []

    # An existing output is never replaced without --overwrite.
    before = sorted(p.name for p in back.iterdir())
    proc = _run([*TO_HF_CLI, "--mcore-dir", str(mcore), "--out-dir", str(back)])
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: output directory {back} exists; pass --overwrite to replace it"
    assert sorted(p.name for p in back.iterdir()) == before and _hidden(tmp_path) == []

    # A damaged dist checkpoint is named file by file before any rank starts.
    damaged = shutil.copytree(mcore, tmp_path / "damaged")
    shard = sorted(damaged.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    proc = _run([*TO_HF_CLI, "--mcore-dir", str(damaged), "--out-dir", str(tmp_path / "from_damaged")])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: {damaged} is damaged: {shard} is truncated: 100 bytes, its tensors need " in proc.stderr, (
        proc.stderr
    )
    assert not (tmp_path / "from_damaged").exists() and _hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Bad input: all cases run at once (they are mostly start-up time), checked one by one.
# ---------------------------------------------------------------------------------------------
def _missing_shard(src: Path):
    victim = sorted(src.glob("model-*.safetensors"))[2]
    victim.unlink()
    total = len(list(src.glob("model-*.safetensors"))) + 1
    return [], (
        f"error: {src}/model.safetensors.index.json: 1 of {total} shard files are missing from {src}: ['{victim.name}']"
    )


def _truncated(src: Path):
    victim = sorted(src.glob("model-*.safetensors"))[4]
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    return [], f"error: {victim}: truncated or corrupt safetensors file ({len(data) - 100} bytes)"


def _edit_config(src: Path, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))


def _shape(src: Path):
    _edit_config(src, intermediate_size=128)  # the safetensors hold 96-wide MLPs
    return ["--tp", "2"], (
        "error: HF tensor 'model.layers.0.mlp.gate_proj.weight' has shape [96, 64] but the model "
        "config expects [128, 64] (Megatron parameter 'decoder.layers.0.mlp.linear_fc1.weight')"
    )


def _tokenizer(src: Path):
    _edit_config(src, vocab_size=280)
    return [], (
        f"error: the tokenizer in {src} has 300 tokens (ids up to 299) but the model's vocab_size is 280 "
        f"(config.json): ids >= 280 have no embedding row"
    )


def _layout(src: Path):
    return ["--tp", "3"], (
        "error: the layout tp=3 pp=1 ep=1 etp=3 on 3 ranks does not fit the model: "
        "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"
    )


BAD = {
    "missing_shard": _missing_shard,
    "truncated": _truncated,
    "shape": _shape,
    "tokenizer": _tokenizer,
    "layout": _layout,
}


@pytest.fixture(scope="module")
def bad_runs(hf_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("bad")
    started = {}
    for name, breaker in BAD.items():
        src = shutil.copytree(hf_dir, work / name / "hf")
        extra, message = breaker(src)
        out = work / name / "out"
        cmd = [*TO_MCORE, "--hf-dir", str(src), "--out-dir", str(out), *extra]
        started[name] = (
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT),
            message,
            out,
        )
    # An output directory that exists already (holding a file the tool must not touch).
    existing = work / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("keep")
    cmd = [*TO_MCORE, "--hf-dir", str(hf_dir), "--out-dir", str(existing)]
    started["exists"] = (
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT),
        f"error: output directory {existing} exists; pass --overwrite to replace it",
        None,
    )
    results = {}
    for name, (proc, message, out) in started.items():
        stdout, stderr = proc.communicate(timeout=240)
        results[name] = dict(rc=proc.returncode, stdout=stdout, stderr=stderr, message=message, out=out)
    return work, results


@pytest.mark.parametrize("case", [*BAD, "exists"])
def test_bad_input_fails_cleanly(bad_runs, case):
    work, results = bad_runs
    r = results[case]
    assert r["rc"] == 1, (r["stdout"][-2000:], r["stderr"][-2000:])
    assert r["message"] in r["stderr"], r["stderr"][-3000:]
    assert "Traceback" not in r["stderr"]
    if case == "exists":
        assert sorted(p.name for p in (work / "existing").iterdir()) == ["keep.txt"]
    else:
        assert not r["out"].exists()
        assert sorted(p.name for p in r["out"].parent.iterdir()) == ["hf"]  # no temporary directory either


def test_a_full_disk_is_named_before_any_rank_starts(hf_dir, tmp_path):
    """The output's file system has less room than the checkpoint needs (a 256 KiB tmpfs; root only)."""
    import os

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mount -t tmpfs failed")
    try:
        proc = _run([*TO_MCORE, "--hf-dir", str(hf_dir), "--out-dir", str(disk / "mcore")])
        left = sorted(p.name for p in disk.iterdir())
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert re.search(
        rf"error: disk full: the Megatron checkpoint needs ~[0-9.]+ [KM]iB at {disk / 'mcore'} but only "
        r"[0-9.]+ KiB are free on that file system",
        proc.stderr,
    ), proc.stderr
    assert left == []


@pytest.mark.gpu
def test_round_trip_under_torchrun_on_gpu(hf_dir, tmp_path):
    """The GPU path: ranks launched by torchrun (NCCL), --verify on both sides."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    proc = _run(
        [
            *torchrun,
            str(ROOT / "tools" / "convert_hf_to_mcore.py"),
            "--hf-dir",
            str(hf_dir),
            "--out-dir",
            str(mcore),
            "--verify",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on 1 cuda ranks" in proc.stdout and float(DIFF.search(proc.stdout).group(1)) < 1e-4
    proc = _run(
        [
            *torchrun,
            str(ROOT / "tools" / "convert_mcore_to_hf.py"),
            "--mcore-dir",
            str(mcore),
            "--out-dir",
            str(back),
            "--verify",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    source, written = _tensors(hf_dir), _tensors(back)
    assert sorted(written) == sorted(source) and all(torch.equal(written[n], source[n]) for n in source)
