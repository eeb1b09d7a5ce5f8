"""Run model-written Python in a separate, limited process: ``run_python(code, limits)``.

What confines the code (``megatron_rl.rollout.tools.sandbox_runner`` applies the in-process parts):

* **privileges**: a user namespace whose root is host ``nobody`` (this process, as root, writes
  the map; unprivileged, the runner maps it to this user), so the code owns no
  host file; then every capability set (bounding included) is emptied and ``no_new_privs`` set;
  a seccomp filter (libseccomp through ctypes) refuses process creation, non-AF_UNIX sockets,
  mount/ptrace/unshare/setns/bpf/io_uring/userfaultfd/sched_setaffinity and the other kernel
  interfaces of ``sandbox_runner._DENIED_SYSCALLS``, and the limits, priority and scheduling of
  any process but the code's own (its init has the same uid); the init drops every signal
  handler, so the kernel keeps the code's signals from it;
* **files**: ``pivot_root`` into a minimal root (``root_layout()``): a read-only tmpfs holding the
  interpreter's prefix and the directories of its shared libraries (read-only, nosuid, nodev
  overlays whose top layer is that tmpfs: statvfs and mountinfo tell the sandbox's 1 MiB, never
  the host's disk, device or file system), a
  fresh ``/proc`` of the sandbox's PID namespace (its host-wide files -- ``stat``, ``meminfo``,
  ``cpuinfo``, ``loadavg``, ``uptime`` -- replaced by the sandbox's own figures: ``memory_mb``,
  the run's CPUs, idle, no load, no uptime; ``vmstat``, ``interrupts``, ``diskstats``, the boot id,
  the boot line, the kernel's config and symbols, the hardware lists and the host-wide counts of
  open files, inodes and cgroups empty, ``version`` no more than ``uname``, ``/proc/sys`` a
  read-only tree of a few settings (``sandbox_runner._PROC_SYS_KEPT``): nothing to fingerprint
  the host or time the caller by; a time
  namespace where the kernel has one, so CLOCK_MONOTONIC / CLOCK_BOOTTIME and the start times in
  ``/proc/<pid>/stat`` count from the sandbox's start, not the host's boot), a read-only
  ``/dev`` of null, zero and urandom (as root, nodes on a 4 KiB tmpfs of their own; unprivileged,
  the host's devtmpfs nodes, whose statvfs tells half the host's memory),
  and the working directory (also HOME and TMPDIR): a tmpfs of ``max_disk_bytes`` and
  ``max_files`` inodes, nodev, nosuid, noexec. The host's root is detached: no home, project,
  checkpoint, credential or Ray socket can be named. An audit hook refuses writes outside the
  working directory as well (a convenience, not the barrier);
* **time**: ``cpu_seconds`` (RLIMIT_CPU: SIGXCPU) and ``wall_seconds`` (the parent kills the
  whole process group, and with it the PID namespace);
* **the whole sandbox** (a cgroup per run where this process may make one, ``Isolation.cgroup``:
  root's own, or a subtree delegated to an unprivileged caller; on cgroup v2 in this process's cgroup or,
  from a delegated leaf, beside it: ``v2_run_parent``): ``memory_mb`` of memory,
  ``max_processes`` tasks, ``max_cpus`` of CPU bandwidth, and an affinity of ``ceil(max_cpus)``
  of this process's CPUs (``_cpu_share``); without a cgroup, ``memory_mb`` of address space for
  the code's process, the
  only one the seccomp filter lets it have (the code gets MemoryError), and ``max_processes``
  tasks through RLIMIT_NPROC, which the kernel counts per user namespace: the sandbox's tasks
  alone, threads included (with namespaces; set with a cgroup too);
* **output**: stdout / stderr are pipes this process owns (unbuffered, so what was printed before
  an exit comes back), read with a byte cap and the wall deadline; at most ``max_output_bytes`` of
  each is returned; more than ``max_file_bytes`` on one pipe stops the run (``output_limit``), as
  it caps each file the code writes (RLIMIT_FSIZE);
* **network**: a fresh network namespace (no interfaces up; no abstract Unix socket of the host)
  where the runner may create one (as root, or unprivileged through a user namespace), else the
  audit hook refuses sockets; fresh IPC and UTS namespaces too (no System V shared memory,
  semaphore or message queue of the host; the host named ``sandbox``, not the node the code
  runs on), and a cgroup namespace where the kernel has one
  (``/proc/<pid>/cgroup`` reads ``/``, not where the caller runs); a fresh session keyring, not
  the caller's (whose keys ``keyctl`` would read where no seccomp filter refuses it), and an
  empty ``/proc/keys`` (which lists the keys of the caller's uid when it is the one mapped in);
* **processes**: a fresh PID namespace where available -- when its init ends, the kernel kills
  every process left in it --, else the process group is killed.

``sysinfo(2)``, which has no namespace either, answers with the sandbox's figures (``memory_mb``, no
load, its own tasks): the filter sends it to the init, which writes the answer (``sandbox_sysinfo``;
``Isolation.sysinfo``; where the kernel cannot notify, the host's figures show). Core dumps cannot
happen (``RLIMIT_CORE`` = 1, which the filter keeps the code from changing: no core file, and the kernel
aborts a dump to a piped ``core_pattern`` helper, which a limit of 0 would still run as host root).

What the code still learns of the host, as Linux gives no namespace for it: the kernel's release
and version (``uname``), the numbers of the CPUs it is given, the CPU's vendor and model
(``cpuid`` is an instruction), unprivileged, the size of the host's devtmpfs (half its memory) through
``statvfs("/dev/null")``, and global serial numbers (mount ids, anonymous device numbers).

The status is the sandbox's own observation, never the code's word: the PID namespace's init
(which the code cannot signal or trace) reports the code's exit status or signal, its CPU
seconds and the tmpfs's fill on a pipe the code never holds; the cgroup's OOM-kill count says
``memory_limit``. A sandbox that cannot start, or code that fails or exceeds a limit, is a
``SandboxResult`` with its ``status``, never an exception: the caller turns it into an observation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from ctypes.util import find_library
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["SandboxLimits", "SandboxResult", "Isolation", "isolation", "run_python"]

RUNNER = str(Path(__file__).with_name("sandbox_runner.py"))
_NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (see the module docstring)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    """Memory of the whole sandbox (a cgroup's limit where the machine offers one, else the address space)."""
    max_output_bytes: int = 8192
    max_file_bytes: int = 1 << 20
    max_open_files: int = 64
    max_disk_bytes: int = 64 << 20
    """Size of the working directory's tmpfs (with namespaces): the code's whole disk quota."""
    max_files: int = 1024
    """Inodes of that tmpfs: how many files and directories the code can make."""
    max_processes: int = 32
    """Tasks (processes and threads) of the whole sandbox, the runner's three included (a cgroup's
    pids.max, and RLIMIT_NPROC in the sandbox's own user namespace)."""
    max_cpus: float = 1.0
    """CPU bandwidth of the whole sandbox, in CPUs (with a cgroup); its affinity, always: ``ceil(max_cpus)``
    of the caller's CPUs (at most all of them), which the code sees as its machine's."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limit {field.name}={value!r} must be a number > 0")
        for name in (
            "cpu_seconds",
            "memory_mb",
            "max_output_bytes",
            "max_file_bytes",
            "max_open_files",
            "max_disk_bytes",
            "max_files",
            "max_processes",
        ):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"sandbox limit {name}={getattr(self, name)!r} must be a whole number > 0")
        if self.max_processes < 4:
            raise ValueError(
                f"sandbox limit max_processes={self.max_processes!r} must be >= 4 (the runner takes three)"
            )


@dataclasses.dataclass
class SandboxResult:
    """How a run ended, as the sandbox observed it (never from an exit code the code chose).

    ``status``: ``ok`` (exit 0), ``error`` (non-zero exit, e.g. an exception; a MemoryError under
    the address-space limit too), ``timeout`` (wall limit), ``cpu_limit`` (killed by the CPU limit's
    signal after using the CPU seconds), ``memory_limit`` (the cgroup's OOM killer struck),
    ``output_limit`` (more than ``max_file_bytes`` on a pipe, or killed by SIGXFSZ with a file at
    that size), ``disk_limit`` (the working directory's tmpfs was full of bytes or inodes when the
    code ended), ``killed`` (by a signal the sandbox did not send) or ``sandbox_error`` (the sandbox
    itself could not run; ``stderr`` says why).
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
        why = {
            "timeout": f"killed: wall-time limit of {limits.wall_seconds:g} s exceeded",
            "cpu_limit": f"killed: CPU-time limit of {limits.cpu_seconds} s exceeded",
            "memory_limit": f"killed: memory limit of {limits.memory_mb} MiB exceeded",
            "output_limit": f"killed: output limit of {limits.max_file_bytes} bytes exceeded",
            "disk_limit": f"disk quota of the working directory ({limits.max_disk_bytes} bytes, "
            f"{limits.max_files} files) filled",
            "error": f"exit code {self.exit_code}",
            "killed": "killed by a signal the sandbox did not send",
            "sandbox_error": "the sandbox failed to run the code",
        }
        if self.status in why:
            parts.append(f"[{why[self.status]}]")
        if self.truncated:
            parts.append(f"[output truncated to {limits.max_output_bytes} bytes]")
        return "\n".join(parts) if parts else "[no output]"


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox use (``isolation()`` probes it once per process)."""

    network_namespace: bool
    """User, network, PID, mount, IPC and UTS namespaces, made by the runner itself."""
    pid_namespace: bool
    minimal_root: bool
    """``pivot_root`` into a root holding only the interpreter, its libraries, ``/proc``, a tiny
    ``/dev`` and the working directory (``sandbox_runner._minimal_root``)."""
    drop_uid: Optional[int]
    """uid the code runs as after leaving root (None: it keeps this process's user)."""
    seccomp: Optional[str] = None
    """libseccomp to build the code's system-call filter with (None: no filter)."""
    map_to: Optional[int] = None
    """Host uid/gid that this process (root) maps the user namespace's root to (None: the runner
    maps it to this process's own, unprivileged, user)."""
    cgroup: tuple[str, ...] = ()
    """Controllers (of ``memory``, ``pids``, ``cpu``) bounding each run as a whole, through a cgroup
    per run (the runner waits for this process to move it there, so it joins before the code
    runs). Root's own cgroups, or those delegated to an unprivileged user (directories it owns)."""
    bound_dirs: tuple[str, ...] = ()
    """Interpreter directories the kernel would not overlay (no overlayfs, or one before 5.11 in a user
    namespace), so the runner bound them read-only: their ``statvfs`` and ``mountinfo`` show the
    host's disk and device (a fingerprint, not a way out). Empty where every one is an overlay."""
    sysinfo: bool = False
    """``sysinfo(2)`` answers with the sandbox's figures (``sandbox_sysinfo``: the init answers it through
    seccomp user notification), not the host's memory, load and task count: the probe saw ``memory_mb``
    as ``sysconf(_SC_PHYS_PAGES)``."""


_PROBE = """import os
print('ok', os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))
wanted = %r
for line in open('/proc/self/mountinfo'):
    if len(line.split(' - ')[0].split()) > 4 and line.split()[4] in wanted:
        print(line, end='')
"""
"""The isolation probe: that code runs at all, and the mounts of the interpreter's directories as the
code sees them (those lines only: a whole mount table may pass the output cap)."""


def not_overlaid(mountinfo: str, dirs: Sequence[str]) -> tuple[str, ...]:
    """Of ``dirs``, those whose mount in ``mountinfo`` (``/proc/<pid>/mountinfo`` text) is not an
    overlay (or that are not mounted at all)."""
    types = {}
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) > 4 and right.split():
            types[fields[4]] = right.split()[0]
    return tuple(d for d in dirs if types.get(d) != "overlay")


@functools.lru_cache(maxsize=None)
def isolation() -> Isolation:
    """Probe once: network + PID + mount namespaces inside a user namespace whose root is host
    ``nobody`` (this process, as root, writes the map) or this process's own unprivileged user,
    with a minimal root; the cgroup controllers this process may use. Without namespaces the code
    runs in a plain process group (as ``nobody`` when this process is root)."""
    root = os.geteuid() == 0
    # Root inside a user namespace holds no capability over the host (no /proc/<caller>/mem, no
    # remount of host mounts, no setns); mapped to nobody, it owns no host file either. The runner
    # makes the namespaces (unshare(1) would exec it inside: its init's /proc files the code's).
    candidate = Isolation(
        True, True, True, None, find_library("seccomp"), _NOBODY if root else None, tuple(_cgroup_roots())
    )
    dirs = root_layout()[0]
    limits = SandboxLimits(wall_seconds=30)
    probe = _execute(_PROBE % (list(dirs),), limits, candidate, True, True)
    first, _, mounts = probe.stdout.partition("\n")
    if probe.status == "ok" and first.split()[:1] == ["ok"]:
        bound = not_overlaid(mounts, dirs)
        if bound:
            warnings.warn(
                f"sandbox: the kernel refused an overlay for {', '.join(bound)}; they are read-only binds, "
                "so the code's statvfs and mountinfo there show the host's disk and device",
                RuntimeWarning,
                stacklevel=2,
            )
        return dataclasses.replace(
            candidate, bound_dirs=bound, sysinfo=first.split()[1:] == [str(limits.memory_mb << 20)]
        )
    warnings.warn(
        f"sandbox: the namespaced sandbox failed its probe ({probe.status}: "
        f"{probe.stderr.strip()[-600:]!r}); code runs in a plain process group",
        RuntimeWarning,
        stacklevel=2,
    )
    return Isolation(False, False, False, _NOBODY if root else None)


@functools.lru_cache(maxsize=None)
def root_layout() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What the minimal root holds: (directories bound read-only, (path, target) symlinks).

    The directories: the interpreter's prefixes and the directories of the shared libraries that
    it and its extension modules link (``ldd``; else those of the C library this process mapped);
    the symlinks: those on the way to them (``/lib -> usr/lib``), so that the loader's paths resolve."""
    import sysconfig

    needed = {sys.base_prefix, sys.prefix}
    dynload = Path(sysconfig.get_path("platstdlib")) / "lib-dynload"
    try:
        out = subprocess.run(
            ["ldd", sys.executable, *map(str, sorted(dynload.glob("*.so")))], capture_output=True, text=True, timeout=60
        ).stdout
        libraries = {part for line in out.splitlines() for part in line.split() if part.startswith("/")}
    except (OSError, subprocess.SubprocessError):
        libraries = set()
    if not libraries:
        with open("/proc/self/maps") as f:
            libraries = {line.split()[-1] for line in f if "/libc.so" in line or "/ld-linux" in line}
    needed |= {os.path.dirname(path) for path in libraries if os.path.exists(path)}
    binds, links = set(), {}
    for path in needed:
        walked = "/"
        for part in Path(path).parts[1:]:
            walked = os.path.join(walked, part)
            if os.path.islink(walked):
                links[walked] = os.readlink(walked)
                walked = os.path.realpath(walked)
        binds.add(os.path.realpath(path))
    binds = {b for b in binds if not any(b != o and b.startswith(o.rstrip("/") + "/") for o in binds)}
    links = {p: t for p, t in links.items() if not any(p.startswith(b.rstrip("/") + "/") for b in binds)}
    return tuple(sorted(binds)), tuple(sorted(links.items()))


_CONTROLLERS = ("memory", "pids", "cpu")


_V2_LIMITS = {"memory": ("memory.max", "memory.high"), "pids": ("pids.max",), "cpu": ("cpu.max",)}
"""The files of a v2 cgroup that limit it, per controller (``max``: no limit)."""


def _v2_enabled(directory: str) -> list[str]:
    """Of ``_CONTROLLERS``, those the v2 cgroup ``directory`` enables for its children."""
    try:
        with open(os.path.join(directory, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
    except OSError:
        return []
    return [c for c in _CONTROLLERS if c in enabled]


def _v2_unlimited(directory: str, controllers: Sequence[str]) -> bool:
    """Whether the v2 cgroup ``directory`` sets no limit of ``controllers`` itself (each file reads ``max``)."""
    for name in controllers:
        for filename in _V2_LIMITS[name]:
            try:
                with open(os.path.join(directory, filename)) as f:
                    if f.read().split()[:1] != ["max"]:
                        return False
            except OSError:
                continue  # that controller is not on here: nothing of it to escape
    return True


def v2_run_parent(own: str, mount_point: str) -> Optional[tuple[str, list[str]]]:
    """Where each run's cgroup goes in a v2 hierarchy mounted at ``mount_point``, this process being in the
    cgroup directory ``own``, and the controllers it gets there; None: nowhere (the runs fall back to
    per-process limits). ``own`` itself when it enables controllers for children (a v2 cgroup with
    processes enables none -- the "no internal processes" rule -- unless it is the root). Else its parent,
    as under a delegation (systemd's ``Delegate=yes``: the trainer runs in a leaf scope of the user's
    delegated slice; SLURM's cgroup/v2: in ``task_<n>`` of its step's ``user`` cgroup), when the parent
    enables controllers, this process may write its ``cgroup.procs`` (moving the runner there needs the
    common ancestor's), and ``own`` sets no limit of them itself: a run beside it is then bounded by every
    limit that bounds this process (the parent's and above), and by the run's own."""
    names = _v2_enabled(own)
    if names:
        return own, names
    own, mount_point = own.rstrip("/"), mount_point.rstrip("/")
    parent = os.path.dirname(own)
    if own == mount_point or not (parent + "/").startswith(mount_point + "/"):
        return None
    names = _v2_enabled(parent)
    if not names or not os.access(os.path.join(parent, "cgroup.procs"), os.W_OK) or not _v2_unlimited(own, names):
        return None
    return parent, names


@functools.lru_cache(maxsize=None)
def _cgroup_roots() -> dict:
    """Controller -> the directory each run's cgroup is made in, for each of ``_CONTROLLERS`` where a
    child cgroup can be made (and removed) here: this process's cgroup in a v1 hierarchy, or in v2
    the one ``v2_run_parent`` picks (this process's own cgroup or, delegated, its parent)."""
    try:
        with open("/proc/self/cgroup") as f:
            own = dict((fields[1], fields[2]) for fields in (line.rstrip("\n").split(":", 2) for line in f))
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return {}
    roots = {}
    for row in mounts:
        sep = row.index("-")
        fstype, options, mount_root, point = row[sep + 1], row[sep + 3].split(","), row[3], row[4]
        if fstype == "cgroup":
            names = [c for c in _CONTROLLERS if c in options]
            path = next((own[k] for k in own if set(k.split(",")) >= set(names) and names), None)
        elif fstype == "cgroup2":
            path = own.get("")
        else:
            continue
        if path is None or not path.startswith(mount_root):
            continue
        directory = os.path.join(point, path[len(mount_root) :].lstrip("/"))
        if fstype == "cgroup2":
            found = v2_run_parent(directory, point)
            if found is None:
                continue
            directory, names = found
        for name in names:
            if name in roots:
                continue
            probe = os.path.join(directory, f"mrl-sandbox-probe-{os.getpid()}")
            try:
                os.mkdir(probe)
                os.rmdir(probe)
            except OSError:
                continue
            roots[name] = (directory, fstype == "cgroup2")
    return roots


class _Cgroup:
    """One run's cgroup (a directory per v1 hierarchy, or one v2 directory): memory, tasks and
    CPU bandwidth of the whole sandbox, and the OOM killer's own count of kills in it."""

    def __init__(self, controllers: tuple[str, ...], limits: SandboxLimits):
        self.dirs: dict[str, str] = {}
        roots = _cgroup_roots()
        name = f"mrl-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        memory = str(limits.memory_mb << 20)
        quota = int(limits.max_cpus * 100_000)
        settings = {
            "memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
            "pids": [("pids.max", str(limits.max_processes))],
            "cpu": [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", str(quota))],
        }
        settings_v2 = {
            "memory": [("memory.max", memory), ("memory.swap.max", "0")],
            "pids": [("pids.max", str(limits.max_processes))],
            "cpu": [("cpu.max", f"{quota} 100000")],
        }
        try:
            for controller in controllers:
                base, v2 = roots[controller]
                path = os.path.join(base, name)
                if path not in self.dirs.values():
                    os.mkdir(path)
                self.dirs[controller] = path
                for filename, value in (settings_v2 if v2 else settings)[controller]:
                    if filename.startswith("memory.memsw") and not os.path.exists(os.path.join(path, filename)):
                        continue  # no swap accounting: nothing to bound
                    with open(os.path.join(path, filename), "w") as f:
                        f.write(value)
        except OSError:
            self.remove()
            raise

    def add(self, pid: int) -> None:
        for path in dict.fromkeys(self.dirs.values()):
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def oom_kills(self) -> int:
        """How many processes the OOM killer took in this cgroup (0 without the memory controller)."""
        path = self.dirs.get("memory")
        if path is None:
            return 0
        for filename in ("memory.events", "memory.oom_control"):
            try:
                with open(os.path.join(path, filename)) as f:
                    fields = dict(line.split() for line in f if line.strip())
                return int(fields.get("oom_kill", 0))
            except OSError:
                continue
        return 0

    def remove(self, deadline_seconds: float = 5.0) -> None:
        """Kill whatever is left in the cgroup (host pids: root's to kill) and remove it."""
        deadline = time.monotonic() + deadline_seconds
        for path in dict.fromkeys(self.dirs.values()):
            while True:
                try:
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        pids = [int(p) for p in f.read().split()]
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy: a task is still exiting
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.001)
        self.dirs = {}


def _map_ids(proc: subprocess.Popen, host_id: int, deadline: float) -> None:
    """Once ``proc`` (the runner) is in its new user namespace, map the namespace's uid and gid 0
    to ``host_id``, then tell the runner (one byte on its stdin) to take them."""
    own = os.readlink("/proc/self/ns/user")
    while os.readlink(f"/proc/{proc.pid}/ns/user") == own:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise OSError(f"the sandbox runner (pid {proc.pid}) did not enter a user namespace")
        time.sleep(0.0005)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{proc.pid}/{name}", "w") as f:
            f.write(f"0 {host_id} 1\n")
    proc.stdin.write(b"1")
    proc.stdin.close()


def _drain(fds: list[int], limit: int, hard_limit: int, deadline: float) -> tuple[dict, Optional[str]]:
    """Read pipes owned by this process (so the code cannot replace them by a symlink or FIFO)
    until all close, ``deadline`` (``timeout``) or more than ``hard_limit`` bytes on one of them
    (``output_limit``); keep at most ``limit + 1`` bytes of each."""
    streams = {fd: bytearray() for fd in fds}
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
                streams[fd] += chunk[: limit + 1 - len(streams[fd])]
    return streams, None


def _text(data: bytearray, limit: int) -> tuple[str, bool]:
    return bytes(data[:limit]).decode("utf-8", errors="replace"), len(data) > limit


def _status(
    exit_code: Optional[int], report: Optional[dict], oom_kills: int, limits: SandboxLimits, cpu_used: float
) -> str:
    """How the run ended, from what the kernel told the sandbox: the code's exit status or signal
    (from its init's ``report`` where there is one, else from this process's own wait), the CPU
    seconds it used, the cgroup's OOM kills and the tmpfs's fill (``report``)."""
    if report is not None:
        cpu_used = report["cpu"]
    if oom_kills:
        return "memory_limit"
    sig = -exit_code if exit_code is not None and exit_code < 0 else None
    # RLIMIT_CPU signals only past the soft limit, but the utime + stime that wait4 reports are
    # tick-sampled: with 100 runs on 2 cores a run SIGXCPU'd at 2 s reported 1.75-2.00 s. A code
    # that signals itself before using 3/4 of its budget still reads 'killed'.
    used_cpu = cpu_used >= 0.75 * limits.cpu_seconds
    if sig in (signal.SIGXCPU, signal.SIGKILL) and used_cpu:  # SIGKILL: the hard limit (soft + 1 s)
        return "cpu_limit"
    if sig == signal.SIGXFSZ and report is not None and report.get("file_limit"):
        return "output_limit"
    if report is not None and report.get("disk_full"):
        return "disk_limit"
    if sig is not None:
        return "killed"
    return "ok" if exit_code == 0 else "error"


def run_python(
    code: str,
    limits: SandboxLimits = SandboxLimits(),
    *,
    refuse_sockets: Optional[bool] = None,
    python_guards: bool = True,
) -> SandboxResult:
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
    proc = cgroup = None
    status_read = status_write = None
    try:
        code_path = Path(workdir) / "main.py"
        code_path.write_text(code)
        owner = iso.drop_uid if iso.drop_uid is not None else iso.map_to
        if owner is not None:
            os.chown(workdir, owner, owner)
            os.chown(code_path, owner, owner)
        if iso.pid_namespace:  # the init writes its report here; the code never holds this pipe
            status_read, status_write = os.pipe()
        cgroup = _Cgroup(iso.cgroup, limits) if iso.cgroup else None
        wait = iso.map_to is not None or cgroup is not None  # the runner waits for a byte on its stdin
        binds, links = root_layout() if iso.minimal_root else ((), ())
        spec = {
            "workdir": workdir,
            "code_path": str(code_path),
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_mb << 20,
            "cpu_ids": _cpu_share(limits.max_cpus),
            "file_bytes": limits.max_file_bytes,
            "max_open_files": limits.max_open_files,
            "drop_uid": iso.drop_uid,
            "refuse_sockets": refuse,
            "init": iso.pid_namespace,
            "python_guards": python_guards,
            "status_fd": status_write,
            "unshare": iso.pid_namespace,
            "map_self": iso.map_to is None,
            "wait_for_caller": wait,
            "seccomp": iso.seccomp,
            "root": {"binds": binds, "links": links} if iso.minimal_root else None,
            "cgroup_memory": cgroup is not None and "memory" in cgroup.dirs,
            "disk_bytes": limits.max_disk_bytes,
            "max_files": limits.max_files,
            "max_processes": limits.max_processes,
            "own_user_namespace": iso.pid_namespace,
        }
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-u", RUNNER, json.dumps(spec)],
            stdin=subprocess.PIPE if wait else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            pass_fds=() if status_write is None else (status_write,),
        )
        if status_write is not None:
            os.close(status_write)
            status_write = None
        if cgroup is not None:
            cgroup.add(proc.pid)  # before the map: the runner waits for it, so the code starts inside
        if iso.map_to is not None:
            _map_ids(proc, iso.map_to, start + limits.wall_seconds)
        elif wait:  # in its cgroup now: the runner may go on
            proc.stdin.write(b"1")
            proc.stdin.close()
        fds = [proc.stdout.fileno(), proc.stderr.fileno()] + ([status_read] if status_read is not None else [])
        streams, stopped = _drain(fds, limits.max_output_bytes, limits.max_file_bytes, start + limits.wall_seconds)
        cpu_used = 0.0
        if stopped is None:
            cpu_used = _wait(proc, start + limits.wall_seconds)
            stopped = "timeout" if proc.returncode is None else None
        _kill_group(proc)
        stdout, cut_out = _text(streams[proc.stdout.fileno()], limits.max_output_bytes)
        stderr, cut_err = _text(streams[proc.stderr.fileno()], limits.max_output_bytes)
        report = None
        if status_read is not None and stopped is None:
            try:
                report = json.loads(bytes(streams[status_read]))
            except ValueError:  # the init died before reporting (it cannot be signalled from inside)
                return SandboxResult(
                    "sandbox_error",
                    stdout,
                    f"the sandbox's init ended without a report\n{stderr}",
                    None,
                    time.monotonic() - start,
                    cut_out or cut_err,
                )
        if stopped:
            exit_code = None
        elif report is None:
            exit_code = proc.returncode
        else:
            exit_code = report["exit"]
        status = stopped or _status(exit_code, report, cgroup.oom_kills() if cgroup else 0, limits, cpu_used)
        return SandboxResult(status, stdout, stderr, exit_code, time.monotonic() - start, cut_out or cut_err)
    except OSError as err:  # the sandbox itself failed (no temp space, no interpreter ...): an observation
        return SandboxResult("sandbox_error", "", f"{type(err).__name__}: {err}", None, time.monotonic() - start)
    finally:
        if proc is not None:
            if proc.returncode is None:
                _kill_group(proc)
            proc.stdout.close()
            proc.stderr.close()
            if proc.stdin is not None:
                proc.stdin.close()
        for fd in (status_read, status_write):
            if fd is not None:
                os.close(fd)
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)


def _cpu_share(max_cpus: float) -> list[int]:
    """The CPUs one run may use: ``ceil(max_cpus)`` of this process's, from a random one on (so
    that concurrent runs spread over the machine). The code sees these alone (its affinity, the
    CPUs of its ``/proc``), never how many the host has; it cannot widen them (the seccomp
    filter refuses ``sched_setaffinity``). Their numbers stay the host's: Linux has no CPU
    namespace to renumber them."""
    allowed = sorted(os.sched_getaffinity(0))
    start = secrets.randbelow(len(allowed))
    return [allowed[(start + i) % len(allowed)] for i in range(min(len(allowed), math.ceil(max_cpus)))]


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
