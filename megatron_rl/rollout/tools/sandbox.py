"""Run model-written Python in a separate, limited process: ``run_python(code, limits)``.

What confines the code (``megatron_rl.rollout.tools.sandbox_runner`` applies the in-process parts):

* **privileges**: a user namespace whose root is host ``nobody`` (this process, as root, writes
  the map; unprivileged, ``unshare --map-root-user`` maps it to this user), so the code owns no
  host file; then every capability set (bounding included) is emptied and ``no_new_privs`` set;
  ``/root`` is an empty tmpfs holding only the interpreter's prefix; a seccomp filter (libseccomp
  through ctypes) refuses process creation, non-AF_UNIX sockets, mount/ptrace/unshare/setns/bpf/
  io_uring/userfaultfd and the other kernel interfaces of ``sandbox_runner._DENIED_SYSCALLS``;

* **time**: ``cpu_seconds`` (RLIMIT_CPU: SIGXCPU) and ``wall_seconds`` (the parent kills the
  whole process group, and with it the PID namespace);
* **memory**: ``memory_mb`` of address space (RLIMIT_AS: the code gets MemoryError);
* **output**: stdout / stderr are pipes this process owns (unbuffered, so what was printed before
  an exit comes back), read with a byte cap and the wall deadline; at most ``max_output_bytes`` of
  each is returned; more than ``max_file_bytes`` on one pipe stops the run (``output_limit``), as
  it caps each file the code writes (RLIMIT_FSIZE);
* **files**: a private temporary working directory (HOME and TMPDIR too), removed afterwards;
  in a private mount namespace every other mount is read-only (else, running as root, the code
  drops to ``nobody``); an audit hook refuses writes outside it as well;
* **network**: a fresh network namespace (no interfaces up) where ``unshare`` may create one
  (as root, or unprivileged through a user namespace), else the audit hook refuses sockets;
* **processes**: a fresh PID namespace where available -- when its init ends, the kernel kills
  every process left in it --, else the process group is killed; process creation, signals and
  ctypes are refused by the audit hook.

A sandbox that cannot start, or code that fails or exceeds a limit, is a ``SandboxResult`` with
its ``status``, never an exception: the caller turns it into an observation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from ctypes.util import find_library
from pathlib import Path
from typing import Optional

__all__ = ["SandboxLimits", "SandboxResult", "Isolation", "isolation", "run_python"]

RUNNER = str(Path(__file__).with_name("sandbox_runner.py"))
_EXIT_MEMORY = 86  # sandbox_runner.EXIT_MEMORY (not imported: the runner is a script)
_NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (see the module docstring)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 8192
    max_file_bytes: int = 1 << 20
    max_open_files: int = 64
    max_disk_bytes: int = 64 << 20
    """Size of the working directory's tmpfs (with namespaces): the code's whole disk quota."""
    max_files: int = 1024
    """Inodes of that tmpfs: how many files and directories the code can make."""

    def __post_init__(self):
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "max_output_bytes", "max_file_bytes",
                     "max_open_files", "max_disk_bytes", "max_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name}={getattr(self, name)!r} must be > 0")


@dataclasses.dataclass
class SandboxResult:
    """How a run ended.

    ``status``: ``ok`` (exit 0), ``error`` (non-zero exit, e.g. an exception), ``timeout`` (wall
    limit), ``cpu_limit``, ``memory_limit``, ``output_limit`` (file-size limit), ``killed`` (SIGKILL
    from elsewhere: not the CPU limit, by the tree's own CPU seconds) or
    ``sandbox_error`` (the sandbox itself could not run; ``stderr`` says why).
    """

    status: str
    stdout: str
    stderr: str
    exit_code: Optional[int]
    seconds: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def observation(self, limits: SandboxLimits) -> str:
        """The text the model sees: stdout, stderr, and what stopped the run when it failed."""
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        why = {"timeout": f"killed: wall-time limit of {limits.wall_seconds:g} s exceeded",
               "cpu_limit": f"killed: CPU-time limit of {limits.cpu_seconds} s exceeded",
               "memory_limit": f"killed: memory limit of {limits.memory_mb} MiB exceeded",
               "output_limit": f"killed: output limit of {limits.max_file_bytes} bytes exceeded",
               "error": f"exit code {self.exit_code}", "killed": "killed by a signal the sandbox did not send", "sandbox_error": "the sandbox failed to run the code"}
        if self.status in why:
            parts.append(f"[{why[self.status]}]")
        if self.truncated:
            parts.append(f"[output truncated to {limits.max_output_bytes} bytes]")
        return "\n".join(parts) if parts else "[no output]"


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox use (``isolation()`` probes it once per process)."""

    prefix: tuple[str, ...]
    """Command prefix entering the namespaces (empty: none available)."""
    network_namespace: bool
    pid_namespace: bool
    readonly_mounts: bool
    """A private mount namespace in which everything but the working directory is read-only."""
    drop_uid: Optional[int]
    """uid the code runs as after leaving root (None: it keeps this process's user)."""
    seccomp: Optional[str] = None
    """libseccomp to build the code's system-call filter with (None: no filter)."""
    map_to: Optional[int] = None
    """Host uid/gid that this process (root) maps the user namespace's root to (None: ``unshare
    --map-root-user`` maps it to this process's own, unprivileged, user)."""


_NAMESPACES = ("--net", "--pid", "--mount", "--mount-proc", "--fork", "--kill-child")


@functools.lru_cache(maxsize=None)
def isolation() -> Isolation:
    """Probe ``unshare`` once: network + PID + mount namespaces inside a user namespace whose root
    is host ``nobody`` (this process, as root, writes the map) or this process's own unprivileged
    user; without them the code runs in a plain process group (as ``nobody`` when this process is root)."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    if unshare is not None:
        # Root inside a user namespace holds no capability over the host (no /proc/<caller>/mem,
        # no remount of host mounts, no setns); mapped to nobody, it owns no host file either.
        if root:  # the runner makes the namespaces (unshare(1) would exec it unmapped, without capabilities)
            candidate = Isolation((), True, True, True, None, find_library("seccomp"), _NOBODY)  # the runner unshares
        else:
            candidate = Isolation((unshare, "--user", "--map-root-user", *_NAMESPACES), True, True, True, None,
                                  find_library("seccomp"))
        probe = _execute("print('ok')", SandboxLimits(wall_seconds=30), candidate, True, True)
        if probe.status == "ok" and probe.stdout == "ok\n":
            return candidate
    return Isolation((), False, False, False, _NOBODY if root else None)


def _map_ids(proc: subprocess.Popen, host_id: int, deadline: float) -> None:
    """Once ``proc`` (the runner) is in its new user namespace, map the namespace's uid and gid 0
    to ``host_id``, then tell the runner (one byte on its stdin) to take them."""
    own = os.readlink("/proc/self/ns/user")
    while os.readlink(f"/proc/{proc.pid}/ns/user") == own:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise OSError(f"unshare (pid {proc.pid}) did not enter a user namespace")
        time.sleep(0.0005)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{proc.pid}/{name}", "w") as f:
            f.write(f"0 {host_id} 1\n")
    proc.stdin.write(b"1")
    proc.stdin.close()


def _drain(proc: subprocess.Popen, limit: int, hard_limit: int, deadline: float) -> tuple[dict, Optional[str]]:
    """Read the child's stdout / stderr pipes (owned by this process, so the code cannot replace them
    by a symlink or FIFO) until both close, ``deadline`` (``timeout``) or more than ``hard_limit``
    bytes on one of them (``output_limit``); keep at most ``limit + 1`` bytes of each."""
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    produced = dict.fromkeys(streams, 0)
    open_fds = set(streams)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return streams, "timeout"
        if max(produced.values()) > hard_limit:
            return streams, "output_limit"
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            produced[fd] += len(chunk)
            if not chunk:
                open_fds.discard(fd)
            elif len(streams[fd]) <= limit:
                streams[fd] += chunk[:limit + 1 - len(streams[fd])]
    return streams, None


def _text(data: bytearray, limit: int) -> tuple[str, bool]:
    return bytes(data[:limit]).decode("utf-8", errors="replace"), len(data) > limit


def _status(code: Optional[int], timed_out: bool, cpu_used: float = 0.0, cpu_limit: float = float("inf")) -> str:
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    signals = {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "output_limit"}
    sig = -code if code < 0 else code - 128 if code > 128 else None
    if sig in signals:
        return signals[sig]
    if code == _EXIT_MEMORY:
        return "memory_limit"
    if sig == signal.SIGKILL:  # the hard CPU limit (soft + 1 s) sends SIGKILL; else someone else did
        return "cpu_limit" if cpu_used >= cpu_limit else "killed"
    return "error"


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, refuse_sockets: Optional[bool] = None,
               python_guards: bool = True) -> SandboxResult:
    """Run ``code`` in the sandbox (module docstring); never raises for what the code does.

    ``refuse_sockets``: the audit hook's socket refusal; default on unless a network namespace
    isolates the code. ``python_guards=False`` leaves the audit hook out (tests show that the
    kernel-side isolation alone holds).
    """
    iso = isolation()
    refuse = (not iso.network_namespace) if refuse_sockets is None else refuse_sockets
    return _execute(code, limits, iso, refuse, python_guards)


def _execute(code: str, limits: SandboxLimits, iso: Isolation, refuse: bool, python_guards: bool) -> SandboxResult:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="mrl-sandbox-")
    proc = None
    try:
        code_path = Path(workdir) / "main.py"
        code_path.write_text(code)
        owner = iso.drop_uid if iso.drop_uid is not None else iso.map_to
        if owner is not None:
            os.chown(workdir, owner, owner)
        spec = {"workdir": workdir, "code_path": str(code_path), "cpu_seconds": limits.cpu_seconds,
                "memory_bytes": limits.memory_mb << 20, "file_bytes": limits.max_file_bytes,
                "max_open_files": limits.max_open_files, "drop_uid": iso.drop_uid, "refuse_sockets": refuse,
                "init": iso.pid_namespace, "readonly_mounts": iso.readonly_mounts, "python_guards": python_guards,
                "unshare": iso.map_to is not None, "seccomp": iso.seccomp,
                "disk_bytes": limits.max_disk_bytes, "max_files": limits.max_files}
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([*iso.prefix, sys.executable, "-I", "-u", RUNNER, json.dumps(spec)],
                                stdin=subprocess.DEVNULL if iso.map_to is None else subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=workdir, env=env, start_new_session=True)
        if iso.map_to is not None:
            _map_ids(proc, iso.map_to, start + limits.wall_seconds)
        streams, stopped = _drain(proc, limits.max_output_bytes, limits.max_file_bytes, start + limits.wall_seconds)
        timed_out = stopped == "timeout"
        cpu_used = 0.0
        if stopped is None:
            cpu_used = _wait(proc, start + limits.wall_seconds)
            timed_out = proc.returncode is None
        _kill_group(proc)
        stdout, cut_out = _text(streams[proc.stdout.fileno()], limits.max_output_bytes)
        stderr, cut_err = _text(streams[proc.stderr.fileno()], limits.max_output_bytes)
        status = "output_limit" if stopped == "output_limit" else _status(proc.returncode, timed_out, cpu_used,
                                                                                limits.cpu_seconds)
        return SandboxResult(status, stdout, stderr, None if stopped else proc.returncode,
                             time.monotonic() - start, cut_out or cut_err)
    except OSError as err:  # the sandbox itself failed (no temp space, no interpreter ...): an observation
        return SandboxResult("sandbox_error", "", f"{type(err).__name__}: {err}", None, time.monotonic() - start)
    finally:
        if proc is not None:
            if proc.returncode is None:
                _kill_group(proc)
            proc.stdout.close()
            proc.stderr.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(proc: subprocess.Popen, deadline: float) -> float:
    """Reap ``proc`` by ``deadline`` (else leave it running); the CPU seconds its tree used, as the
    kernel counted them (children it reaped included)."""
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        time.sleep(0.001)
    return 0.0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the PID namespace dies with its init) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
