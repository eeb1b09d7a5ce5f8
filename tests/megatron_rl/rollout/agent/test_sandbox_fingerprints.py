"""What the code can learn about the host from inside the sandbox (issue 27): each probe runs in
the real sandbox and what it saw is compared with the host's own answer.

Hidden: the host's disks (statvfs and mountinfo see overlays on the sandbox's root tmpfs, never
the host's device, its file-system type or size), the host's memory through devtmpfs (as root:
the device nodes live on a 4 KiB tmpfs of their own), the host's CPUs (the run's affinity is its
``ceil(max_cpus)`` share and cannot be widened), the host's boot line, kernel build and host-wide
counters in ``/proc``, the host's settings in ``/proc/sys`` (a few kept), the host's memory, load and
task count through ``sysinfo(2)`` (the init answers it). Not hidden, by Linux's design: the kernel release and version that
``uname(2)`` returns (no namespace covers them), the numbers of the CPUs the run is given (no CPU
namespace renumbers them), the CPU's vendor (``cpuid``), and global serial numbers (mount ids,
anonymous device numbers).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import pytest

from megatron_rl.rollout.tools import sandbox
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation, run_python

pytestmark = pytest.mark.skipif(
    not (isolation().minimal_root and isolation().seccomp), reason="needs user namespaces and libseccomp"
)
ROOT = os.geteuid() == 0  # only host root can make the sandbox its own device nodes


def probe(code: str, limits: SandboxLimits = SandboxLimits(wall_seconds=10)) -> dict:
    res = run_python(code, limits, python_guards=False)
    assert res.ok, res
    return json.loads(res.stdout)


def _host_mount_of(path: str) -> tuple[str, str, str]:
    """(major:minor, fs type, source) of the host mount that holds ``path``."""
    best = None
    with open("/proc/self/mountinfo") as f:
        for row in f:
            fields = row.split()
            point, sep = fields[4], fields.index("-")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and (
                best is None or len(point) > len(best[0])
            ):
                best = (point, fields[2], fields[sep + 1], fields[sep + 2])
    return best[1:]


def test_statvfs_reads_the_sandboxs_own_file_systems_not_the_hosts_disk():
    binds, _ = sandbox.root_layout()
    paths = ["/", *binds, sys.executable, os.__file__, "/dev/null", "/dev"]
    code = (
        "import json, os\nout = {}\nfor p in %r + [os.getcwd()]:\n    s = os.statvfs(p)\n"
        "    out[p] = [s.f_bsize * s.f_blocks, s.f_files, s.f_bsize * s.f_bfree]\n"
        "out['cwd'] = os.getcwd()\nprint(json.dumps(out))" % (paths,)
    )
    limits = SandboxLimits(wall_seconds=10, max_disk_bytes=8 << 20, max_files=300)
    got = probe(code, limits)
    host = os.statvfs(sys.prefix)
    assert host.f_bsize * host.f_blocks > 1 << 30  # the host's disk: what must not show
    for path in ["/", *binds, sys.executable, os.__file__]:  # the root tmpfs (1 MiB, 4096 inodes)
        assert got[path][:2] == [1 << 20, 4096], (path, got[path])
    assert got[got["cwd"]][:2] == [8 << 20, 300]  # the working directory: the run's own quota
    assert got["/dev"][:2] == [64 << 10, 64]
    if ROOT:
        assert got["/dev/null"][:2] == [4 << 10, 8], got["/dev/null"]  # the nodes' own tmpfs
    else:  # unprivileged, the nodes are the host's devtmpfs's: its size (half the host's memory) shows
        dev = os.statvfs("/dev/null")
        assert got["/dev/null"][:2] == [dev.f_bsize * dev.f_blocks, dev.f_files]


def test_mountinfo_names_no_host_device_file_system_or_size():
    device, fstype, source = _host_mount_of(sys.prefix)
    code = (
        "import json\nprint(json.dumps({n: open('/proc/' + n).read() for n in "
        "('self/mountinfo', 'self/mounts', '1/mountinfo', 'mounts')}))"
    )
    got = probe(code, SandboxLimits(wall_seconds=10, max_output_bytes=1 << 16))
    assert fstype not in ("tmpfs", "overlay") and source.startswith("/")  # e.g. ext4 on /dev/vda
    rows = [line.split() for line in got["self/mountinfo"].splitlines()]
    types = {row[row.index("-") + 1] for row in rows}
    assert types <= {"tmpfs", "overlay", "proc"} | ({"devtmpfs"} if not ROOT else set()), types
    for text in got.values():
        assert f" {device} " not in text and f" {fstype} " not in text and source not in text, text
    mounted = {row[4]: row for row in rows}
    for path in sandbox.root_layout()[0]:  # the host's directories: overlays named "sandbox"
        assert mounted[path][mounted[path].index("-") + 1 :][:2] == ["overlay", "sandbox"], mounted[path]
    sizes = {option for row in rows for option in row[-1].split(",") if option.startswith("size=")}
    if ROOT:  # every size the sandbox's own: 1 MiB root, 64 KiB /dev, 256 KiB masks, 4 KiB nodes, 64 MiB workdir
        assert sizes == {"size=1024k", "size=64k", "size=256k", "size=4k", "size=65536k"}, sizes


def test_the_cpus_are_the_runs_share_and_cannot_be_widened():
    host = sorted(os.sched_getaffinity(0))
    code = (
        "import json, os\nbefore = sorted(os.sched_getaffinity(0))\ntry:\n"
        "    os.sched_setaffinity(0, range(os.cpu_count() or 1, 1024))\n    widened = 'widened'\n"
        "except OSError as err:\n    widened = err.errno\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(json.dumps({'before': before, 'after': sorted(os.sched_getaffinity(0)), 'widened': widened,"
        " 'count': os.cpu_count(), 'list': status['Cpus_allowed_list'].strip()}))"
    )
    for max_cpus in (1.0, 2.5):
        got = probe(code, SandboxLimits(wall_seconds=10, max_cpus=max_cpus))
        share = min(len(host), -int(-max_cpus // 1))
        assert len(got["before"]) == share and set(got["before"]) <= set(host), (got, host)
        assert got["after"] == got["before"] and got["widened"] == errno.EPERM, got
        assert got["count"] == share  # /proc/stat and cpuinfo: the share too
        assert got["list"] == ",".join(map(str, got["before"])) or share > 1, got


def test_the_kernel_release_is_the_hosts_but_its_build_and_boot_line_are_not():
    """Linux gives ``uname(2)``'s release, version and machine no namespace: the code learns the
    host's kernel release whatever the sandbox does (``/proc/sys/kernel/osrelease`` says the
    same); only the node name is the UTS namespace's. ``/proc/version`` is cut down to what uname
    says (not the compiler and builder); the boot line, kernel config and symbols, the hardware
    lists and the host-wide counters (open files, inodes, dentries, cgroups) read empty."""
    empty = (
        "cmdline",
        "config.gz",
        "kallsyms",
        "iomem",
        "ioports",
        "devices",
        "cgroups",
        "sys/fs/file-nr",
        "sys/fs/inode-nr",
        "sys/fs/dentry-state",
        "sys/fs/aio-nr",
        "sys/kernel/pty/nr",
    )
    code = (
        "import json, os\nout = {'uname': list(os.uname())}\nfor n in %r:\n"
        "    out[n] = open('/proc/' + n, 'rb').read().decode('latin-1')\nprint(json.dumps(out))"
        % (("version", "sys/kernel/osrelease") + empty,)
    )
    got = probe(code)
    host = os.uname()
    assert got["uname"] == [host.sysname, "sandbox", host.release, host.version, host.machine]
    assert got["sys/kernel/osrelease"] == host.release + "\n"  # the host's, by Linux's design
    assert got["version"] == f"{host.sysname} version {host.release} {host.version}\n"
    assert open("/proc/version").read() != got["version"]  # the host's names the compiler as well
    for name in empty:
        if os.path.exists("/proc/" + name):
            assert got[name] == "" and open("/proc/" + name, "rb").read(1) != b"", name


def test_proc_sys_holds_a_few_settings_not_the_hosts_hundreds():
    code = (
        "import json, os\nout = {}\nfor top, _, files in os.walk('/proc/sys'):\n    for name in files:\n"
        "        path = os.path.join(top, name)\n        out[path[len('/proc/sys/'):]] = open(path).read()\n"
        "try:\n    open('/proc/sys/kernel/core_pattern', 'w')\nexcept OSError as err:\n    out['write'] = err.errno\n"
        "print(json.dumps(out))"
    )
    got = probe(code)
    host = sum(len(files) for _, _, files in os.walk("/proc/sys"))
    assert got.pop("write") == errno.EROFS and host > 100, host
    assert {k: got[k] for k in ("kernel/hostname", "kernel/domainname")} == {
        "kernel/hostname": "sandbox\n",
        "kernel/domainname": "(none)\n",
    }
    for name in ("kernel/ngroups_max", "kernel/cap_last_cap", "vm/overcommit_memory"):  # copied, as programs read them
        assert got[name] == open("/proc/sys/" + name).read(), name
    for name in ("kernel/threads-max", "fs/file-max", "vm/min_free_kbytes", "kernel/random/entropy_avail", "net"):
        assert not any(k.startswith(name) for k in got), name  # the host's memory, entropy, network settings
    assert len(got) <= 24 and all(v == "" for k, v in got.items() if k.endswith(("-nr", "-state", "/nr"))), got


SYSINFO = (
    "import ctypes, json, os, threading\nclass Info(ctypes.Structure):\n    _fields_ = [('uptime', ctypes.c_long), "
    "('loads', ctypes.c_ulong * 3), ('totalram', ctypes.c_ulong), ('freeram', ctypes.c_ulong), "
    "('sharedram', ctypes.c_ulong), ('bufferram', ctypes.c_ulong), ('totalswap', ctypes.c_ulong), "
    "('freeswap', ctypes.c_ulong), ('procs', ctypes.c_ushort), ('totalhigh', ctypes.c_ulong), "
    "('freehigh', ctypes.c_ulong), ('mem_unit', ctypes.c_uint)]\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def call():\n    info = Info()\n    assert libc.sysinfo(ctypes.byref(info)) == 0\n"
    "    return {'uptime': info.uptime, 'loads': list(info.loads), 'total': info.totalram * info.mem_unit,"
    " 'free': info.freeram * info.mem_unit, 'swap': info.totalswap, 'procs': info.procs}\n"
    "out = call()\nthreads = []\nworkers = [threading.Thread(target=lambda: threads.append(call())) for _ in range(4)]\n"
    "[w.start() for w in workers]\n[w.join() for w in workers]\n"
    "out['threads'] = threads\nout['phys'] = os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')\n"
    "out['avphys'] = os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')\n"
    "out['bad'] = [libc.sysinfo(ctypes.c_void_p(8)), ctypes.get_errno()]\n"
    "ro = ctypes.CDLL(None).mmap\nro.restype = ctypes.c_void_p\n"
    "ro.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
    "page = ro(None, 4096, 1, 0x22, -1, 0)\n"  # PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS
    "out['read_only'] = [libc.sysinfo(ctypes.c_void_p(page)), ctypes.get_errno()]\n"
    "print(json.dumps(out))"
)


@pytest.mark.skipif(not isolation().sysinfo, reason="needs seccomp user notification (libseccomp API >= 5)")
def test_sysinfo_tells_the_sandboxs_memory_and_tasks_not_the_hosts():
    """``sysinfo(2)`` has no namespace (its memory, load and task count are the host's; only its uptime
    follows the time namespace): the filter sends it to the init, which answers with the sandbox's
    figures (``sandbox_sysinfo``). glibc's ``sysconf`` reads it: ``_SC_PHYS_PAGES`` is ``memory_mb`` too.
    Four threads at once each get an answer; a buffer the code cannot write gets EFAULT, as from the
    kernel."""
    # not the default's 512 MiB; unprivileged it is an address-space limit, which each thread's stack and
    # malloc arena (64 MiB reserved) must fit in
    limits = SandboxLimits(wall_seconds=10, memory_mb=1024)
    got = probe(SYSINFO, limits)
    memory = 1024 << 20
    host_total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert host_total != memory and got["total"] == got["free"] == got["phys"] == got["avphys"] == memory, got
    assert got["loads"] == [0, 0, 0] and got["swap"] == 0 and 1 <= got["procs"] <= 4, got  # init, code (threads)
    assert got["uptime"] <= limits.wall_seconds + 1 < time.clock_gettime(time.CLOCK_BOOTTIME), got
    assert len(got["threads"]) == 4 and all(t["total"] == memory for t in got["threads"]), got
    assert got["bad"] == got["read_only"] == [-1, errno.EFAULT], got


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64's cpuid instruction")
def test_the_cpuid_instruction_names_the_hosts_cpu_vendor():
    """Not hidden: ``cpuid`` is an instruction, not a system call, and the kernel lets every
    process run it (CPUID faulting, where the hardware has it, would break the libraries that
    pick their code paths by it). The sandbox's ``/proc/cpuinfo`` names a "sandbox CPU"; the
    instruction still names the host's vendor."""
    code = (
        "import ctypes, json, mmap\nm = mmap.mmap(-1, 4096, prot=7)\n"
        "m.write(bytes.fromhex('5331c00fa289d85bc3'))\n"  # push rbx; cpuid(0); mov eax, ebx; pop rbx; ret
        "run = ctypes.CFUNCTYPE(ctypes.c_uint32)(ctypes.addressof(ctypes.c_char.from_buffer(m)))\n"
        "print(json.dumps({'cpuid': run().to_bytes(4, 'little').decode(), 'cpuinfo': open('/proc/cpuinfo').read()}))"
    )
    got = probe(code)
    host_vendor = next(line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id"))
    assert got["cpuid"] == host_vendor[:4] and host_vendor not in got["cpuinfo"], got


@pytest.mark.skipif(not ROOT, reason="run as an unprivileged user, every test here is the rootless path")
def test_every_fingerprint_and_attack_test_holds_for_an_unprivileged_caller():
    """This file and ``test_sandbox_attacks`` again, with the caller as host ``nobody`` (the
    runner maps the caller's own user; the overlays as well, the host's devtmpfs nodes for
    ``/dev``, the address-space limit for memory)."""
    from . import test_sandbox_attacks
    from .rootless import run_pytest_as_nobody

    out = run_pytest_as_nobody(__file__, test_sandbox_attacks.__file__)
    summary = out.stdout.strip().splitlines()[-1]
    expected = len([name for name in [*globals(), *vars(test_sandbox_attacks)] if name.startswith("test_")]) - 1
    assert out.returncode == 0 and f"{expected} passed, 1 skipped" in summary, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_probe_names_interpreter_directories_that_are_binds_not_overlays():
    dirs = sandbox.root_layout()[0]
    res = run_python(sandbox._PROBE % (list(dirs),), SandboxLimits(wall_seconds=10))
    first, _, seen = res.stdout.partition("\n")
    assert res.ok and first.split()[0] == "ok", res  # then sysconf's physical memory: Isolation.sysinfo
    assert sandbox.not_overlaid(seen, dirs) == isolation().bound_dirs  # what the warning would name
    assert len(seen.splitlines()) == len(dirs)  # every directory is mounted, one line each
    # a kernel without overlays in user namespaces: the runner's read-only bind of the host's disk
    bind = f"48 45 8:1 {dirs[0]} {dirs[0]} ro,nosuid,nodev,relatime - ext4 /dev/sda1 rw"
    on_top = tuple(d for d in dirs if d == dirs[0] or d in isolation().bound_dirs)
    assert sandbox.not_overlaid(seen + bind, dirs) == on_top  # the mount on top counts
    assert sandbox.not_overlaid("", dirs) == dirs  # not mounted at all
