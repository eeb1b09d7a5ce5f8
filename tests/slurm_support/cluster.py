"""A real single-node SLURM cluster (Debian's slurm-wlm + munge) for tests, started and stopped
by the caller (docs/slurm.md, "The test cluster", says what works on these machines and why).

``SlurmCluster(workdir).start()`` writes a slurm.conf under ``workdir`` (state, spool, pid and
log files there too), starts munged, slurmctld and slurmd in the foreground mode (``-D``/``-F``,
so their PIDs are the daemons'), and waits until the node is ``idle``. ``stop()`` sends TERM to
slurmd, slurmctld, munged (in that order) by recorded PID and waits for each to exit.
``ensure_slurm_installed()`` installs the packages with apt when missing and possible.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")


def ensure_slurm_installed(timeout_s: float = 600) -> str | None:
    """None when slurmctld/slurmd/sbatch/munged are available (installing them with apt as root
    when missing); otherwise the reason they are not, for ``pytest.skip``."""
    needed = ("slurmctld", "slurmd", "sbatch", "munged")
    if all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in needed):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and cannot be (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 and cmd[1] == "install":
            return f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"
    if not all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in needed):
        return f"after installing {' '.join(PACKAGES)}, some of {needed} are still missing"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _mem_available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class SlurmCluster:
    """One slurmctld + one slurmd on this machine, node name = ``hostname -s``."""

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.conf = self.workdir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def write_conf(self) -> Path:
        w = self.workdir
        for d in ("state", "spool", "log"):
            (w / d).mkdir(parents=True, exist_ok=True)
        mem = int(_mem_available_mb() * 0.9)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=test",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "EnforcePartLimits=ALL",  # without it a 2-node job on this 1-node cluster pends forever
                    "MailProg=/bin/true",
                    "SlurmctldPort=6817",
                    "SlurmdPort=6818",
                    f"StateSaveLocation={w / 'state'}",
                    f"SlurmdSpoolDir={w / 'spool'}",
                    f"SlurmctldPidFile={w / 'slurmctld.pid'}",
                    f"SlurmdPidFile={w / 'slurmd.pid'}",
                    f"SlurmctldLogFile={w / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={w / 'log' / 'slurmd.log'}",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem} State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        return self.conf

    def _wait(self, what: str, check, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}; logs in {self.workdir / 'log'}"
                    )
            if check():
                return
            time.sleep(0.25)
        raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}; logs in {self.workdir / 'log'}")

    def _ok(self, cmd: str) -> bool:
        return subprocess.run(cmd, shell=True, env=self.env, capture_output=True).returncode == 0

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        self.write_conf()
        run_munge = Path("/run/munge")
        run_munge.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_munge, "munge", "munge")
        log = self.workdir / "log"
        # munged refuses a second instance on the same socket: reuse a running one (not ours to stop).
        if not self._ok("munge -n | unmunge"):
            self.procs["munged"] = subprocess.Popen(
                ["runuser", "-u", "munge", "--", _daemon("munged"), "-F"],
                stdout=open(log / "munged.out", "w"),
                stderr=subprocess.STDOUT,
            )
            self._wait("munged", lambda: self._ok("munge -n | unmunge"), timeout_s)
        self.procs["slurmctld"] = subprocess.Popen(
            [_daemon("slurmctld"), "-D", "-f", str(self.conf)],
            env=self.env,
            stdout=open(log / "slurmctld.out", "w"),
            stderr=subprocess.STDOUT,
        )
        self._wait("slurmctld", lambda: self._ok("scontrol ping | grep -q UP"), timeout_s)
        self.procs["slurmd"] = subprocess.Popen(
            [_daemon("slurmd"), "-D", "-f", str(self.conf)],
            env=self.env,
            stdout=open(log / "slurmd.out", "w"),
            stderr=subprocess.STDOUT,
        )
        self._wait("node idle", lambda: self.sinfo_state() == "idle", timeout_s)
        return self

    def sinfo_state(self) -> str:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return proc.stdout.strip()

    def stop(self, timeout_s: float = 30) -> dict[str, int | None]:
        """TERM slurmd, slurmctld, munged by PID; wait; KILL what did not exit. Returns exit codes."""
        codes: dict[str, int | None] = {}
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            codes[name] = proc.returncode
        return codes

    def pids_alive(self) -> list[str]:
        """Names of the daemons started here whose PID still runs."""
        return [name for name, proc in self.procs.items() if Path(f"/proc/{proc.pid}").exists() and proc.poll() is None]
