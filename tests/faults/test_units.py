"""The fault machinery piece by piece, without a run (seconds): checkpoint manifests and the choice
of the checkpoint to resume, a full disk (a real small tmpfs where the test may mount one), the
reaper, the signal handling, the phase watchdog, non-finite reward keys, the operator's labels.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.trainer import step_checkpoints as ckpt
from megatron_rl.trainer.step_checkpoints import (
    LATEST_FILE,
    StepCheckpoint,
    find_resume_dir,
    select_checkpoint,
    verify_step,
)
from parallel.checkpoint import DiskFullError, check_free_space, is_disk_full


def _save(root: Path, step: int, payload: bytes = b"x" * 5000) -> Path:
    with StepCheckpoint(root, step) as c:
        part = c.part("actor")
        part.mkdir()
        (part / "__0_0.distcp").write_bytes(payload)
        (part / "common.pt").write_bytes(b"c" * 100)
        return c.commit({"global_steps": step, "model_path": None})


# ----------------------------------------------------------------------------- manifests
def test_a_step_is_verified_against_its_manifest_and_every_damage_is_named(tmp_path):
    path = _save(tmp_path, 3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["actor/__0_0.distcp", "actor/common.pt", "trainer_state.json"]
    assert manifest["total_bytes"] == 5000 + 100 + (path / "trainer_state.json").stat().st_size
    assert verify_step(path) == [] and (tmp_path / LATEST_FILE).read_text() == "3\n"
    shard = path / "actor" / "__0_0.distcp"
    shard.write_bytes(b"x" * 4000)
    assert verify_step(path) == [f"{shard} has 4000 bytes, the manifest records 5000"]
    shard.write_bytes(b"y" + b"x" * 4999)
    assert verify_step(path) == [f"{shard} does not match its checksum in manifest.json (its contents changed)"]
    assert verify_step(path, checksums=False) == []  # sizes only
    shard.unlink()
    (path / "trainer_state.json").write_text("[]")
    state = path / "trainer_state.json"
    assert verify_step(path) == [
        f"{state} is not a valid trainer state (AttributeError: 'list' object has no attribute 'get')",
        f"{shard} is missing (listed in manifest.json)",
        f"{state} has 2 bytes, the manifest records {manifest['files']['trainer_state.json']['size']}",
    ]


def test_large_files_are_hashed_by_sampled_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "FULL_HASH_BYTES", 4 * 2**20)
    path = _save(tmp_path, 1, payload=os.urandom(9 * 2**20))
    shard = path / "actor" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1  # in the last block, which is always sampled
    shard.write_bytes(bytes(data))
    assert verify_step(path) == [f"{shard} does not match its checksum in manifest.json (its contents changed)"]


def test_resume_falls_back_past_damaged_checkpoints_or_refuses(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    assert find_resume_dir(tmp_path) == (tmp_path / "global_step_3").resolve()
    (tmp_path / "global_step_3" / "actor" / "__0_0.distcp").write_bytes(b"")
    choice = select_checkpoint(tmp_path)
    assert choice.path == (tmp_path / "global_step_2").resolve() and choice.step == 2
    assert choice.describe().startswith(
        f"global_step_3 is damaged: {tmp_path}/global_step_3/actor/__0_0.distcp has 0 "
        f"bytes, the manifest records 5000; resuming from {choice.path}"
    )
    with pytest.raises(
        ValueError,
        match=r"checkpoint .*global_step_3 is damaged: .*__0_0.distcp has 0 bytes.*"
        r"trainer.resume_fallback=true resumes",
    ):
        select_checkpoint(tmp_path, fallback=False)
    (tmp_path / LATEST_FILE).write_text("banana\n")  # a garbage pointer: the newest complete step
    assert select_checkpoint(tmp_path).path == (tmp_path / "global_step_2").resolve()
    (tmp_path / LATEST_FILE).write_text("9\n")  # a pointer at a step that does not exist
    assert select_checkpoint(tmp_path).path == (tmp_path / "global_step_2").resolve()
    (tmp_path / LATEST_FILE).write_text("1\n")  # newer directories than the pointer are another run's: ignored
    assert select_checkpoint(tmp_path).path == (tmp_path / "global_step_1").resolve()
    for step in (1, 2):
        (tmp_path / f"global_step_{step}" / "trainer_state.json").write_text("{")
    (tmp_path / LATEST_FILE).write_text("3\n")
    with pytest.raises(ValueError, match="no complete checkpoint under .* nothing was deleted"):
        select_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_1", "global_step_2", "global_step_3"]
    assert select_checkpoint(tmp_path, "disable").path is None
    assert select_checkpoint(tmp_path / "empty").path is None


def test_a_step_saved_again_replaces_the_old_one_whole(tmp_path):
    _save(tmp_path, 2, payload=b"old")
    (tmp_path / "global_step_2" / "actor" / "__0_0.distcp").write_bytes(b"")  # damaged
    _save(tmp_path, 2, payload=b"new")
    assert verify_step(tmp_path / "global_step_2") == []
    assert (tmp_path / "global_step_2" / "actor" / "__0_0.distcp").read_bytes() == b"new"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ----------------------------------------------------------------------------- full disks
@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    path = tmp_path / "disk"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mount -t tmpfs failed")
    yield path
    subprocess.run(["umount", str(path)], capture_output=True)


class _Group:
    """A worker group stand-in whose ranks write ``size`` bytes as their checkpoint part."""

    spec = None

    def __init__(self, size: int):
        self.size = size

    def save_checkpoint(self, path: Path) -> None:
        Path(path).mkdir(parents=True)
        with open(Path(path) / "__0_0.distcp", "wb") as f:
            f.write(b"\0" * self.size)


def test_a_full_disk_during_a_save_is_named_and_the_last_good_checkpoint_stays(small_disk):
    from megatron_rl.config import TrainerConfig
    from megatron_rl.trainer.callbacks import Checkpointer

    keeper = Checkpointer(small_disk, TrainerConfig(save_freq=1), {"actor": _Group(100_000)})
    keeper.save(1, {"global_steps": 1})
    # The estimate (the last checkpoint's size) fits, the write does not: ENOSPC from the file system itself.
    keeper.groups = {"actor": _Group(3 * 2**20)}
    with pytest.raises(DiskFullError) as err:
        keeper.save(2, {"global_steps": 2})
    message = str(err.value)
    assert message.startswith(
        f"disk full: saving checkpoint global_step_2 under {small_disk} failed (OSError); it needs ~"
    )
    assert f"the last good checkpoint is {small_disk / 'global_step_1'}" in message and " are free now" in message
    assert is_disk_full(err.value.__cause__) and err.value.__cause__.errno == errno.ENOSPC
    assert (small_disk / LATEST_FILE).read_text() == "1\n" and verify_step(small_disk / "global_step_1") == []
    assert sorted(p.name for p in small_disk.iterdir()) == ["global_step_1", LATEST_FILE]  # no temporary left


def test_the_free_space_is_checked_before_a_save_starts(small_disk):
    from megatron_rl.config import TrainerConfig
    from megatron_rl.trainer.callbacks import Checkpointer

    keeper = Checkpointer(small_disk, TrainerConfig(save_freq=1), {"actor": _Group(600_000)})
    keeper.save(1, {"global_steps": 1})  # 600 kB of 1 MiB: the next one (estimated the same) cannot fit
    with pytest.raises(
        DiskFullError,
        match=r"disk full: saving checkpoint global_step_2 needs ~586\.\d KiB at "
        rf"{small_disk} but only .* are free on that file system; the last good "
        rf"checkpoint is {small_disk / 'global_step_1'}",
    ):
        keeper.save(2, {"global_steps": 2})
    assert sorted(p.name for p in small_disk.iterdir()) == ["global_step_1", LATEST_FILE]


def test_the_hf_export_checks_its_space_first(small_disk, tmp_path):
    import torch
    from safetensors.torch import save_file

    from megatron_rl.job.final_export import FinalExport

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(512, 1024)}, str(model / "model.safetensors"))  # 2 MiB of float32

    class Trainer:
        model_path = str(model)

        class config:  # noqa: N801 - the attribute path the export reads
            class trainer:  # noqa: N801
                val_only = False

            class actor_rollout_ref:  # noqa: N801
                class actor:  # noqa: N801
                    class megatron:  # noqa: N801
                        dtype = "float32"

        def save_hf_checkpoint(self, out):  # never reached
            raise AssertionError("the export started")

    with pytest.raises(
        DiskFullError,
        match=rf"disk full: writing the HF checkpoint final_hf needs ~2\.0 MiB at "
        rf"{small_disk} but only",
    ):
        FinalExport(small_disk / "final_hf").on_fit_end(Trainer(), [])


def test_disk_full_is_recognised_through_wrappers():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = RuntimeError("ray::MegatronWorker.save_checkpoint() ... OSError: [Errno 28] No space left on device")
    assert is_disk_full(wrapped)
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("unexpected pos 704 vs 598") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(RuntimeError("unexpected pos 704 vs 598")) and not is_disk_full(ValueError("x"))
    with pytest.raises(DiskFullError, match=r"disk full: the test needs ~1\.0 TiB at /tmp but only"):
        check_free_space("/tmp", 2**40, "the test")


# ----------------------------------------------------------------------------- the reaper
_FAKE_DRIVER = """
import subprocess, sys, time
from megatron_rl.job.reaper import start_reaper
start_reaper()
# a child that starts its own child: Ray's raylet and its workers, in miniature
subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
print("up", flush=True)
time.sleep(600)
"""


def test_the_reaper_kills_what_a_killed_driver_left_and_nothing_else():
    import psutil

    from tests.faults.runs import env

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    driver = subprocess.Popen(
        [sys.executable, "-c", _FAKE_DRIVER], stdout=subprocess.PIPE, text=True, env=env(), start_new_session=True
    )
    try:
        assert driver.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 10
        while len(psutil.Process(driver.pid).children(recursive=True)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # a reaper poll sees the grandchild
        left = [p for p in psutil.Process(driver.pid).children(recursive=True) if "reaper" not in " ".join(p.cmdline())]
        assert len(left) == 2
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(left, timeout=10)
        assert alive == []
        assert bystander.poll() is None  # not the driver's: untouched
    finally:
        bystander.kill()
        driver.kill()


# ----------------------------------------------------------------------------- signals and the watchdog
def test_signals_abandon_or_finish_the_step():
    from megatron_rl.trainer.watchdog import StopSignals

    with StopSignals(log=lambda m: None) as signals:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert signals.exit_code == 143 and signals.name == "SIGTERM"
    with StopSignals(log=lambda m: None) as signals:
        signals.finish_step = True  # trainer.save_on_preemption: the first signal only asks
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert signals.stop_after_step and signals.exit_code == 130
        with pytest.raises(KeyboardInterrupt):  # the second one stops at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)


def test_after_the_last_step_a_signal_stops_at_once():
    # The final export (FinalExport, at fit's end) has no step to finish: trainer.save_on_preemption's
    # "finish the step first" does not hold there, and a signal that came before stops it before it starts.
    from megatron_rl.trainer.watchdog import StopSignals

    with StopSignals(log=lambda m: None) as signals:
        signals.finish_step = True
        with pytest.raises(KeyboardInterrupt), signals.at_once():
            assert not signals.finish_step
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert signals.finish_step and signals.exit_code == 143
        ran = []
        with pytest.raises(KeyboardInterrupt), signals.at_once():  # pending: nothing inside runs
            ran.append(True)
        assert ran == []


def test_the_watchdog_stops_a_phase_that_makes_no_progress(tmp_path):
    from megatron_rl.trainer import watchdog
    from megatron_rl.trainer.watchdog import PhaseWatchdog, phase

    dog = PhaseWatchdog(1.0, tmp_path, {}, step=lambda: 7).start()  # no workers: the driver's own stacks
    watchdog._ACTIVE = dog
    timing: dict = {}
    try:
        with pytest.raises(KeyboardInterrupt):
            with phase("gen", timing):
                time.sleep(20)
    finally:
        watchdog._ACTIVE = None
        dog.stop()
    assert dog.tripped.startswith("step 7: phase 'gen' made no progress for ")
    assert "trainer.phase_timeout_s=1 (a hang)" in dog.tripped and "no checkpoint was saved" in dog.tripped
    assert "test_units.py" in (dog.dump_dir / "driver.txt").read_text()  # where the main thread slept
    assert timing["gen"] < 10  # the sleep was cut short


# ----------------------------------------------------------------------------- reports
def test_non_finite_reward_keys_are_counted_not_averaged():
    import torch

    from megatron_rl.data.rewards import RewardOutput, finite_means

    assert finite_means({"acc": [1.0, math.nan, 0.0, math.inf, None, "x", True]}) == {
        "reward/acc/mean": 0.5,
        "reward/acc/num_nonfinite": 2.0,
    }
    assert finite_means({"acc": [math.nan]}) == {"reward/acc/num_nonfinite": 1.0}
    out = RewardOutput(torch.zeros(2, 3), torch.tensor([0.5, 1.0]), {"score": [0.5, 1.0], "acc": [math.nan, 1.0]})
    assert out.metrics() == {"reward/score/mean": 0.75, "reward/acc/mean": 1.0, "reward/acc/num_nonfinite": 1.0}


@pytest.mark.parametrize(
    "recipe, label",
    [
        ("grpo", "GRPO"),
        ("dapo", "DAPO"),
        ("ppo", "PPO"),
        ("gspo", "GSPO"),
        ("dr_grpo", "Dr.GRPO"),
        ("opd", "OPD"),
        ("rloo", "RLOO"),
        ("remax", "ReMax"),
        ("reinforce_plus_plus", "REINFORCE++"),
    ],
)
def test_the_bar_is_labelled_with_the_recipes_algorithm(recipe, label):
    from megatron_rl.config import load_config
    from megatron_rl.job.report import algorithm_label

    assert algorithm_label(load_config(recipe)) == label


def test_validation_lines_show_the_prompt_text():
    from megatron_rl.trainer.callbacks import prompt_text

    assert (
        prompt_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "Reverse: 1 2"}])
        == "Reverse: 1 2"
    )
    assert prompt_text("plain") == "plain"


def test_an_invalid_gpu_layout_gets_the_nearest_valid_one():
    from megatron_rl.job.main_job import load_run_config

    with pytest.raises(
        ValueError,
        match=r"world_size=16 is not divisible by .*; nearest valid layout: "
        r"actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8 \(peak ",
    ):
        load_run_config("gpu/qwen3_30b_a3b_grpo", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=16"])


def test_an_invalid_layout_that_no_valid_layout_fits_names_the_lowest_and_the_remedy():
    """Qwen3-235B-A22B on 4 nodes: EP=64 does not divide a stage's 16 ranks, and no valid layout of TP,
    PP, EP and the micro-batch fits 80 GiB: the refusal names the one with the lowest peak and what fits."""
    from megatron_rl.job.main_job import load_run_config

    with pytest.raises(
        ValueError,
        match=r"does not divide .*; nearest valid layout: none of the valid layouts fits "
        r"32 GPUs of 80 GiB; the one with the lowest peak is .*expert_model_parallel"
        r"_size=\d+ \(peak [\d.]+ GiB in '[a-z ]+'\); .*on \d+ nodes",
    ):
        load_run_config("gpu/qwen3_235b_a22b_grpo", ["trainer.nnodes=4"])
