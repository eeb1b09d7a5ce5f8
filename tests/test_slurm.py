"""recipes/slurm on a real single-node SLURM cluster (slurm-wlm + munge, started and stopped here).

The module fixture installs slurm-wlm/munge with apt when missing (root only; otherwise the
module is skipped), writes a slurm.conf for this machine under a temp dir, starts munged,
slurmctld and slurmd, and stops them by PID at the end (checking they are gone). The tests:

* ``train.sbatch`` runs the CPU toy GRPO recipe end to end: Ray comes up inside the job, the
  trainer's driver joins that cluster (one Ray session, two drivers: the join check and the
  trainer), 2 steps run, the job exits 0, the run directory and the per-node logs exist, and no
  process of the job's Ray is left;
* a job asking for 2 nodes is refused at submission ("Node count specification invalid");
* a node that never joins (a node list with a host that does not exist) fails the job with exit
  status 3 and an error naming that node and its log, and Ray is torn down;
* the wait itself, with no Ray head at all, times out after RAY_JOIN_TIMEOUT_S naming the nodes;
* a training failure (an unknown adv_estimator) is the job's exit status, and Ray is torn down;
* a worker started by srun joins the head; a head that cannot start fails the job at once;
  scancel tears Ray down (exit 143); SIGTERM to the batch script alone (``--signal=B:TERM@120``,
  the time limit's warning) lets the training save a checkpoint before it stops (exit 143);
* submit_ray_job.sh: argument errors and the address it asks; the real ``ray job submit`` run
  where Ray's dashboard dependencies are installed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.slurm_support.cluster import SlurmCluster, ensure_slurm_installed

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "recipes" / "slurm" / "train.sbatch"
CLUSTER_SH = REPO / "recipes" / "slurm" / "ray_cluster.sh"
WAIT_PY = REPO / "recipes" / "slurm" / "wait_for_ray.py"
SUBMIT_SH = REPO / "recipes" / "slurm" / "submit_ray_job.sh"

# The CPU toy recipe shrunk to ~1 min on 2 cores: 4 prompts x 2 samples, no SFT warm-up, 2 steps.
TOY = [
    "trainer.total_training_steps=2",
    "trainer.sft_warmup_steps=0",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
]
# CPU-only test node: no GPUs (overrides the script's --gpus-per-node=8).
CPU_JOB = ["--nodes=1", "--gpus-per-node=0"]


@pytest.fixture(scope="module")
def slurm():
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd/munged for the test needs root")
    workdir = Path(tempfile.mkdtemp(prefix="slurmtest-"))
    cluster = SlurmCluster(workdir)
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    subprocess.run(["scancel", "--full", "--user=root"], env=cluster.env, capture_output=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout
        if not queue.strip():
            break
        time.sleep(0.5)
    cluster.stop()
    assert cluster.pids_alive() == [], f"SLURM daemons still running after stop: {cluster.pids_alive()}"
    shutil.rmtree(workdir, ignore_errors=True)


def _free_port_block(n: int = 3) -> int:
    """A port p with p..p+n-1 free (Ray head: GCS, client server, dashboard agent)."""
    for _ in range(200):
        port = random.randint(21000, 29000)
        socks = []
        try:
            for p in range(port, port + n):
                s = socket.socket()
                s.bind(("", p))
                socks.append(s)
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def _job_env(slurm: SlurmCluster, ray_tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("SLURM_") or k.startswith("RAY_"))}
    env.update(
        {
            "SLURM_CONF": str(slurm.conf),
            "MEGATRON_RL_PYTHON": sys.executable,
            "RAY_PORT": str(_free_port_block()),
            "RAY_TMPDIR": str(ray_tmp),
            **extra,
        }
    )
    return env


@pytest.fixture
def ray_tmp():
    """The job's RAY_TMPDIR: short and unique (Ray's unix socket paths under it must stay below
    ~107 characters, which pytest's tmp_path can exceed); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _sbatch(slurm: SlurmCluster, cwd: Path, env: dict, args: list[str], timeout: float = 400, wait: bool = False):
    """Submit a batch job and wait for its end; (exit status, job id, sbatch's output, job output).

    ``wait=True`` uses ``sbatch --wait`` (what users run: its exit status is the job's); otherwise
    the job's state is polled every 0.5 s (``sbatch --wait`` polls every few seconds and more
    slowly as time goes on, which adds up to ~10 s per job) and the status is read from ExitCode.
    """
    cmd = ["sbatch", *(["--wait"] if wait else []), f"--output={cwd}/slurm-%j.out", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    m = re.search(r"Submitted batch job (\d+)", text)
    job = m.group(1) if m else None
    rc = proc.returncode
    if job and not wait:
        deadline = time.monotonic() + timeout
        while True:
            info = subprocess.run(
                ["scontrol", "show", "job", "-o", job], env=slurm.env, capture_output=True, text=True
            ).stdout
            state = re.search(r"JobState=(\S+)", info)
            if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                code, sig = re.search(r" ExitCode=(\d+):(\d+)", info).groups()
                rc = int(code) if int(sig) == 0 else 128 + int(sig)
                break
            assert time.monotonic() < deadline, f"job {job} still {state.group(1) if state else '?'} after {timeout}s"
            time.sleep(0.5)
    out = (cwd / f"slurm-{job}.out").read_text() if job and (cwd / f"slurm-{job}.out").exists() else ""
    return rc, job, text, out


def _ray_procs(ray_tmp: Path) -> list[str]:
    """Command lines of live processes that belong to the Ray session under ``ray_tmp``."""
    procs = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if f"{ray_tmp}/" in cmd and state != "Z":
            procs.append(f"{d.name}: {cmd[:150]}")
    return procs


def test_train_sbatch_end_to_end(slurm, tmp_path, ray_tmp):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    rc, job, text, out = _sbatch(
        slurm,
        tmp_path,
        _job_env(slurm, ray_tmp),
        [*CPU_JOB, str(SBATCH), "grpo", *TOY, f"trainer.default_local_dir={run_dir}"],
        wait=True,
    )
    wall = time.monotonic() - start
    assert rc == 0, f"sbatch exit {rc}\n{text}\n{out}"
    print(f"\nend-to-end job {job}: {wall:.1f}s wall (sbatch --wait)")
    assert "all 1 node(s) joined the Ray cluster" in out
    assert "command exited with status 0" in out and "Ray stopped in" in out
    # The run's outputs.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # step 0: the validation before training; steps 1-2: training (with the mean reward).
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(0.0 <= m["critic/score/mean"] <= 1.0 for m in metrics[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["output_dir"] == str(run_dir)
    assert (run_dir / "final_hf" / "config.json").exists()
    assert list((run_dir / "final_hf").glob("*.safetensors"))
    # Per-node logs: the head's `ray start` and the training output.
    logs = tmp_path / "logs" / job
    assert sorted(p.name for p in logs.iterdir()) == [f"ray-head-{slurm.node}.log", "train.log"]
    assert "Ray runtime started" in (logs / f"ray-head-{slurm.node}.log").read_text()
    assert "done: 2 steps" in (logs / "train.log").read_text()
    # The trainer joined the job's cluster instead of starting its own: one Ray session, whose
    # drivers are the join check and the trainer, and whose workers ran the trainer's actors.
    sessions = sorted(p.name for p in ray_tmp.glob("session_2*"))
    assert len(sessions) == 1, sessions
    session_logs = ray_tmp / sessions[0] / "logs"
    assert len(list(session_logs.glob("python-core-driver-*"))) == 2
    assert list(session_logs.glob("python-core-worker-*"))
    assert _ray_procs(ray_tmp) == []


def test_too_many_nodes_is_refused(slurm, tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        ["sbatch", "--wait", "--nodes=2", "--gpus-per-node=0", str(SBATCH), "grpo"],
        cwd=tmp_path,
        env=_job_env(slurm, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "sbatch: error: Batch job submission failed: Node count specification invalid"
    assert time.monotonic() - start < 10  # refused at submission, not left pending
    assert "Submitted" not in proc.stdout


def test_node_that_never_joins_fails_the_job(slurm, tmp_path, ray_tmp):
    env = _job_env(slurm, ray_tmp, RAY_SLURM_NODES=f"{slurm.node} ghost01", RAY_JOIN_TIMEOUT_S="60")
    start = time.monotonic()
    rc, job, text, out = _sbatch(slurm, tmp_path, env, [*CPU_JOB, str(CLUSTER_SH), "echo", "never-runs"])
    wall = time.monotonic() - start
    print(f"\nmissing-node job {job}: {wall:.1f}s wall")
    assert rc == 3, f"{text}\n{out}"
    logs = tmp_path / "logs" / job
    # With more than one node the head advertises a non-loopback IPv4 of this machine.
    head_ip = re.search(rf"head {slurm.node} at ([0-9.]+):{env['RAY_PORT']},", out).group(1)
    assert not head_ip.startswith("127.")
    # The head may or may not have joined by the time ghost01's srun step has failed.
    error = re.search(
        rf"ERROR: the Ray start step for node\(s\) ghost01 exited before joining the cluster at "
        rf"{re.escape(head_ip)}:{env['RAY_PORT']}; missing ([12]) of 2 node\(s\): (.*)",
        out,
    )
    assert error, out
    assert error.group(2).endswith(f"ghost01 (log: {logs}/ray-worker-ghost01.log)")
    assert "never-runs" not in out and not (logs / "train.log").exists()
    # srun's own reason is in the node's log, and its tail is in the job output.
    reason = "srun: error: Unable to create step for job"
    assert reason in (logs / "ray-worker-ghost01.log").read_text()
    assert f"]   ghost01: {reason}" in out
    assert wall < 60  # failed as soon as the node's start step exited, not at the deadline
    assert "Ray stopped in" in out
    assert _ray_procs(ray_tmp) == []


PROBE = """
import ray
ray.init()  # RAY_ADDRESS, set by ray_cluster.sh
nodes = [n for n in ray.nodes() if n["Alive"]]
print("PROBE", len(nodes), ray.cluster_resources()["CPU"], ray.cluster_resources()["slurm_node:%s"])
"""


def test_worker_started_by_srun_joins(slurm, tmp_path, ray_tmp):
    # The node list names this node twice: the second Ray node is started the way every worker
    # node is, by `srun --overlap -N1 -n1 -w <node>`, and joins the head over TCP.
    env = _job_env(
        slurm,
        ray_tmp,
        RAY_SLURM_NODES=f"{slurm.node} {slurm.node}",
        RAY_JOIN_TIMEOUT_S="120",
        RAY_WORKER_START_ARGS=f"--dashboard-agent-listen-port={_free_port_block(1)}",
    )
    start = time.monotonic()
    rc, job, text, out = _sbatch(
        slurm, tmp_path, env, [*CPU_JOB, "--exclusive", str(CLUSTER_SH), sys.executable, "-c", PROBE % slurm.node]
    )
    print(f"\ntwo-Ray-node job {job}: {time.monotonic() - start:.1f}s wall")
    assert rc == 0, f"{text}\n{out}"
    assert "all 2 node(s) joined the Ray cluster" in out
    # Each Ray node offers the CPUs SLURM gave it (SLURM_CPUS_ON_NODE in its own step).
    assert f"PROBE 2 {2.0 * slurm.cpus} 2.0" in out
    logs = tmp_path / "logs" / job
    worker_log = (logs / f"ray-worker-{slurm.node}.log").read_text()
    assert f"worker {slurm.node} (" in worker_log and f"--num-cpus={slurm.cpus} --num-gpus=0" in worker_log
    assert "Ray runtime started" in worker_log
    assert "Ray stopped in" in out
    assert _ray_procs(ray_tmp) == []


def test_head_that_fails_to_start_fails_the_job(slurm, tmp_path, ray_tmp):
    env = _job_env(slurm, ray_tmp, RAY_START_ARGS="--no-such-option")
    rc, job, text, out = _sbatch(slurm, tmp_path, env, [*CPU_JOB, str(CLUSTER_SH), "echo", "never-runs"])
    assert rc == 3, f"{text}\n{out}"
    logs = tmp_path / "logs" / job
    assert (
        f"ERROR: the Ray start step for node(s) {slurm.node} exited before joining the cluster at "
        f"127.0.0.1:{env['RAY_PORT']}; missing 1 of 1 node(s): {slurm.node} (log: {logs}/ray-head-{slurm.node}.log)"
    ) in out
    assert f"]   {slurm.node}: Error: No such option '--no-such-option'." in out
    assert "never-runs" not in out and "Ray stopped in" in out
    assert _ray_procs(ray_tmp) == []


def test_scancel_tears_ray_down(slurm, tmp_path, ray_tmp):
    """scancel (and the time limit) sends SIGTERM: the command is stopped, Ray torn down, nothing left."""
    env = _job_env(slurm, ray_tmp)
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", *CPU_JOB, str(CLUSTER_SH), "sleep", "300"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    out_file = tmp_path / f"slurm-{job}.out"
    deadline = time.monotonic() + 120
    while not (out_file.exists() and "running: sleep 300" in out_file.read_text()):
        assert time.monotonic() < deadline, out_file.read_text() if out_file.exists() else "no job output"
        time.sleep(0.5)
    start = time.monotonic()
    subprocess.run(["scancel", job], env=slurm.env, check=True)
    while True:
        info = subprocess.run(
            ["scontrol", "show", "job", "-o", job], env=slurm.env, capture_output=True, text=True
        ).stdout
        queued = subprocess.run(["squeue", "-h", "-j", job], env=slurm.env, capture_output=True, text=True).stdout
        if "JobState=CANCELLED" in info and not queued.strip():
            break
        assert time.monotonic() - start < 60, info
        time.sleep(0.5)
    out = out_file.read_text()
    assert "received SIGTERM: stopping the command and Ray" in out and "Ray stopped in" in out, out
    assert "ExitCode=143:0" in info  # 128 + SIGTERM, from the script's trap
    assert _ray_procs(ray_tmp) == []


def test_preemption_signal_to_the_batch_script_saves_a_checkpoint(slurm, tmp_path, ray_tmp):
    """SIGTERM to the batch script only (what ``#SBATCH --signal=B:TERM@120`` sends before the time limit;
    here ``scancel --signal=TERM --batch``): the training finishes its step, saves a checkpoint
    (trainer.save_on_preemption) and stops; Ray is torn down; the job's exit status is 143."""
    from megatron_rl.trainer.step_checkpoints import verify_step

    run_dir = tmp_path / "run"
    env = _job_env(slurm, ray_tmp)
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--output={tmp_path}/slurm-%j.out",
            *CPU_JOB,
            str(SBATCH),
            "grpo",
            *TOY,
            "trainer.total_training_steps=50",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_on_preemption=true",
            f"trainer.default_local_dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    train_log = tmp_path / "logs" / job / "train.log"
    deadline = time.monotonic() + 300
    while not (train_log.exists() and "step 1/50 " in train_log.read_text()):
        assert time.monotonic() < deadline, train_log.read_text() if train_log.exists() else "no train.log"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=TERM", "--batch", job], env=slurm.env, check=True)
    start = time.monotonic()
    while True:
        info = subprocess.run(
            ["scontrol", "show", "job", "-o", job], env=slurm.env, capture_output=True, text=True
        ).stdout
        if re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", info):
            break
        assert time.monotonic() - start < 120, info
        time.sleep(0.5)
    out, log = (tmp_path / f"slurm-{job}.out").read_text(), train_log.read_text()
    assert "ExitCode=143:0" in info, info
    assert "received SIGTERM: stopping the command and Ray" in out and "Ray stopped in" in out, out
    saved = re.search(r"megatron-rl train: stopped by SIGTERM after step (\d+); checkpoint (\S+) saved", log)
    assert saved, log[-3000:]
    assert Path(saved.group(2)) == run_dir / f"global_step_{saved.group(1)}"
    assert verify_step(saved.group(2)) == []
    assert _ray_procs(ray_tmp) == []


def test_join_timeout_names_missing_nodes(tmp_path):
    port = _free_port_block(1)  # nothing listens there
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(WAIT_PY),
            "--address",
            f"127.0.0.1:{port}",
            "--nodes",
            "node01",
            "node02",
            "--timeout",
            "2",
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    wall = time.monotonic() - start
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (
        f"ERROR: the Ray head at 127.0.0.1:{port} did not answer within 2s (RAY_JOIN_TIMEOUT_S); "
        f"missing node01 (log: {tmp_path}/ray-head-node01.log), node02 (log: {tmp_path}/ray-worker-node02.log)"
    ) in proc.stdout
    assert 2 <= wall < 30
    bad = subprocess.run(
        [sys.executable, str(WAIT_PY), "--address", "h:1", "--nodes", "a", "--timeout", "5", "--launcher", "a:12"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--launcher must be NODE=PID, got 'a:12'" in bad.stderr


def test_training_failure_is_the_job_exit_status(slurm, tmp_path, ray_tmp):
    start = time.monotonic()
    rc, job, text, out = _sbatch(
        slurm,
        tmp_path,
        _job_env(slurm, ray_tmp),
        [
            *CPU_JOB,
            str(SBATCH),
            "grpo",
            *TOY,
            "algorithm.adv_estimator=nope",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    print(f"\nfailing-training job {job}: {time.monotonic() - start:.1f}s wall")
    assert rc == 2, f"{text}\n{out}"
    train_log = (tmp_path / "logs" / job / "train.log").read_text()
    assert "nope" in train_log and "adv_estimator" in train_log
    assert "command exited with status 2" in out and "Ray stopped in" in out
    assert _ray_procs(ray_tmp) == []
    state = subprocess.run(["scontrol", "show", "job", job], env=slurm.env, capture_output=True, text=True).stdout
    assert "JobState=FAILED" in state and "ExitCode=2:0" in state


def test_submit_ray_job_arguments_and_address(tmp_path):
    """submit_ray_job.sh's argument checks, and that it asks the given job server (none runs there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["MEGATRON_RL_PYTHON"] = sys.executable
    usage = subprocess.run([str(SUBMIT_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and usage.stderr == "usage: submit_ray_job.sh [--address URL] RECIPE [key=value ...]\n"
    bad = subprocess.run(
        [str(SUBMIT_SH), "grpo"],
        env=dict(env, RAY_JOB_ENV_VARS="NCCL_DEBUG=WARN B"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == "submit_ray_job.sh: RAY_JOB_ENV_VARS entries must be NAME=VALUE, got ['B']"
    port = _free_port_block(1)
    proc = subprocess.run(
        [str(SUBMIT_SH), "--address", f"http://127.0.0.1:{port}", "grpo", "trainer.total_training_steps=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stdout.startswith(
        f"submit_ray_job.sh: {REPO} -> http://127.0.0.1:{port}: megatron-rl train grpo trainer.total_training_steps=1\n"
    )
    assert f"ConnectionError: Failed to connect to Ray at address: http://127.0.0.1:{port}." in proc.stderr


def _dashboard_python() -> str | None:
    """A Python with Ray's dashboard (job server) dependencies: this one, or
    $MEGATRON_RL_TEST_DASHBOARD_PYTHON (e.g. a venv over the system site-packages plus aiohttp_cors,
    opencensus, opentelemetry-sdk/-exporter-prometheus/-proto, prometheus_client)."""
    for py in (os.environ.get("MEGATRON_RL_TEST_DASHBOARD_PYTHON"), sys.executable):
        if py and subprocess.run([py, "-c", "import ray.dashboard.optional_deps"], capture_output=True).returncode == 0:
            return py
    return None


def test_submit_ray_job_trains_on_the_job_cluster(slurm, tmp_path, ray_tmp):
    """The `ray job submit` path for real: a SLURM job starts Ray with the dashboard (job server) and
    runs submit_ray_job.sh against it; the toy run trains 2 steps through the job server."""
    py = _dashboard_python()
    if py is None:
        pytest.skip("Ray's dashboard/job server dependencies (ray[default]) are not installed")
    port = _free_port_block(1)
    env = _job_env(
        slurm,
        ray_tmp,
        MEGATRON_RL_PYTHON=py,
        RAY_DASHBOARD="true",
        RAY_DASHBOARD_PORT=str(port),
        RAY_JOB_ADDRESS=f"http://127.0.0.1:{port}",
    )
    run_dir = tmp_path / "run"
    rc, job, text, out = _sbatch(
        slurm,
        tmp_path,
        env,
        [
            *CPU_JOB,
            "--exclusive",
            str(CLUSTER_SH),
            str(SUBMIT_SH),
            "grpo",
            *TOY,
            f"trainer.default_local_dir={run_dir}",
        ],
    )
    assert rc == 0, f"{text}\n{out}"
    assert re.search(r"Job 'raysubmit_\w+' succeeded", out)
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert (run_dir / "final_hf" / "config.json").exists()
    assert _ray_procs(ray_tmp) == []
