"""The package works installed, not only checked out: the wheel is built, installed into a scratch
target and run from outside the checkout (``megatron-rl convert`` on a tiny model, ``plan`` on a
shipped recipe); and ``megatron-rl plan`` takes verl's ``--config-path`` / ``--config-name``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERL_YAML = ROOT / "megatron_rl" / "config" / "verl" / "ppo_megatron_trainer.yaml"
TINY_MODEL = (
    "{num_layers: 1, hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 2, num_query_groups: 2, "
    "kv_channels: 32, vocab_size: 512, max_position_embeddings: 2048, qk_layernorm: true, "
    "attention_backend: sdpa}"
)
VERL_CPU_MODEL = [  # a verl script's overrides with its model swapped for a tiny one and no data files
    "actor_rollout_ref.model.path=null",
    f"+actor_rollout_ref.model.config={TINY_MODEL}",
    "+actor_rollout_ref.model.family=qwen3",
    "data.train_files=null",
    "data.val_files=null",
    "+data.task=toy_reverse",
    "algorithm.adv_estimator=grpo",
    "trainer.n_gpus_per_node=8",
]


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """``(site, env)``: the wheel of the checkout's files installed into ``site``; ``env`` puts only it on the path."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    for name in filter(None, files):  # a copy: building in the checkout would leave build/ for everyone
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        cwd=tmp,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("megatron_rl-*.whl")
    site = tmp / "site"
    done = _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        cwd=tmp,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return site, env


def test_installed_wheel_converts_and_plans_outside_the_checkout(installed, tmp_path):
    site, env = installed
    where = _run(
        [sys.executable, "-c", "import megatron_rl, megatron_rl.convert; print(megatron_rl.__file__)"],
        cwd=tmp_path,
        env=env,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout
    assert not (site / "tools").exists()  # the converters ship as megatron_rl.convert, not as tools/
    assert (site / "megatron_rl" / "recipes" / "grpo.yaml").is_file()
    assert (site / "megatron_rl" / "config" / "verl" / "ppo_megatron_trainer.yaml").is_file()

    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    hf = build_tiny_hf_checkpoint(tmp_path / "hf", "qwen3")["path"]
    out = tmp_path / "mcore"
    proc = _run(
        [
            sys.executable,
            "-m",
            "megatron_rl.cli",
            "convert",
            "hf-to-mcore",
            "--hf-dir",
            str(hf),
            "--out-dir",
            str(out),
            "--tp",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(f"done: qwen3 {hf} (25 tensors, ")
    meta = json.loads((out / "megatron_rl_conversion.json").read_text())
    assert (meta["family"], meta["world_size"]) == ("qwen3", 1)

    plan = _run([sys.executable, "-m", "megatron_rl.cli", "plan", "grpo"], cwd=tmp_path, env=env)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "verdict: FITS" in plan.stdout


def test_plan_takes_a_verl_command_line(tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    text = VERL_YAML.read_text()
    assert text.count("    name: ???\n") >= 1
    (config / "my_run.yaml").write_text(text.replace("    name: ???\n", "    name: vllm\n", 1))  # the rollout's
    plan = [sys.executable, "-m", "megatron_rl.cli", "plan"]
    tp2 = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"

    proc = _run(
        [
            *plan,
            "--config-path=config",
            "--config-name",
            "my_run.yaml",
            *VERL_CPU_MODEL,
            "model_engine=megatron",
            tp2,
            "--json",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["fits"] is True

    # verl's own file (a name that is not in the directory): its rollout.name is still '???'
    proc = _run([*plan, "-cp", "config", "-cn", "ppo_trainer", *VERL_CPU_MODEL], cwd=tmp_path)
    assert proc.returncode == 2 and "actor_rollout_ref.rollout.name='???'" in proc.stderr, proc.stderr[-2000:]

    proc = _run(
        [*plan, "--config-path=config", "--config-name=my_run", *VERL_CPU_MODEL, "model_engine=fsdp"], cwd=tmp_path
    )
    assert proc.returncode == 2 and "model_engine='fsdp': only 'megatron' is built here" in proc.stderr, proc.stderr
