"""Runs inside the sandbox process: limits, privileges and guards first, then the model's code.

Started by ``megatron_rl.rollout.tools.sandbox.run_python`` as ``python -I sandbox_runner.py
SPEC`` (SPEC: JSON). Imports only the standard library, so it starts fast. When it is the init
process of a fresh PID namespace (``spec["init"]``) it forks once and only reaps: the code then
runs as an ordinary process (signals such as SIGXCPU act on it), and when the init ends the
kernel kills everything left in the namespace.

Order: the code read and libseccomp loaded while the host is still visible; with namespaces
(``spec["unshare"]``: this process unshares, then waits for the caller's uid/gid map, one byte on
stdin, or maps its own unprivileged user, ``spec["map_self"]``) it becomes the namespace's root,
which is host ``nobody`` (or the caller's own user), and forks the PID namespace's init; the init builds the minimal root (``_minimal_root``: ``pivot_root``, the host's root
detached), a time namespace for the code (``_new_time_namespace``) and a cgroup namespace
(``_new_cgroup_namespace``) and names the host ``sandbox`` (``_name_the_host``); a fresh session
keyring replaces the caller's (``_new_session_keyring``); privileges go for good (the capability bounding set emptied, root dropped to ``nobody`` --
``spec["drop_uid"]``, only without namespaces --, every capability cleared, ``no_new_privs``),
the init forks the code's process and only reaps and reports
(``_supervise``; with seccomp user notification it also answers the code's ``sysinfo`` calls with the
sandbox's figures, ``sandbox_sysinfo``). In the code's process: resource limits (CPU seconds, address space unless a
cgroup bounds memory, file size, open files, no core files, tasks in the sandbox's user
namespace; the CPU affinity of ``spec["cpu_ids"]``), the seccomp filter, an audit hook
(a convenience: it refuses process creation, signals, ctypes, writes outside the working
directory, Unix sockets and -- when no network namespace isolates the process -- every socket);
then ``exec`` the code as ``__main__``.
"""

import json
import os
import resource
import signal
import sys
import time
import traceback

_BLOCKED = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.cdata",
        "ctypes.cdata/buffer",
        "ctypes.call_function",
        "os.setuid",
        "os.setgid",
        "sys.setprofile",
    }
)
# event -> positions of the path arguments that a write touches
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rename": (0, 1),
    "os.mkdir": (0,),
    "os.rmdir": (0,),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.copytree": (1,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_WRITABLE_DEVICES = ("/dev/null",)


def _unix_socket(event: str, args: tuple) -> bool:
    if event == "socket.__new__":
        return len(args) > 1 and args[1] == getattr(__import__("socket"), "AF_UNIX", 1)
    return (
        event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
        and len(args) > 1
        and isinstance(args[1], (str, bytes))
    )


def _install_guard(workdir: str, refuse_sockets: bool) -> None:
    root = os.path.realpath(workdir)
    busy = []

    def inside(path) -> bool:
        if isinstance(path, int):  # an already open descriptor: its open was checked
            return True
        path = os.fsdecode(path)
        if path in _WRITABLE_DEVICES:
            return True
        real = os.path.realpath(os.path.join(root, path))
        return real == root or real.startswith(root + os.sep)

    def hook(event, args):
        if busy:  # our own realpath calls
            return
        if event in _BLOCKED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event.startswith("socket.") and (refuse_sockets or _unix_socket(event, args)):
            # A network namespace does not cover Unix sockets on the file system (e.g. Ray's).
            raise PermissionError("sandbox: network access is not allowed")
        paths = ()
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (isinstance(flags, int) and flags & _WRITE_FLAGS) or (
                isinstance(mode, str) and any(c in mode for c in "wax+")
            )
            paths = (path,) if writing else ()
        elif event in _PATH_EVENTS:
            paths = tuple(args[i] for i in _PATH_EVENTS[event] if i < len(args))
        if not paths:
            return
        busy.append(1)
        try:
            for path in paths:
                if path is not None and not inside(path):
                    raise PermissionError(
                        f"sandbox: writing {os.fsdecode(path)!r} outside the working directory is not allowed"
                    )
        finally:
            busy.pop()

    sys.addaudithook(hook)


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE, _MNT_DETACH = 16384, 1 << 18, 2
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
_AT_RECURSIVE, _SYS_MOUNT_SETATTR = 0x8000, 442
_ST_TO_MS = {2: _MS_NOSUID, 4: _MS_NODEV, 8: _MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # statvfs -> mount


def _open_binds(binds) -> dict:
    """O_PATH handles on the directories to bind into the new root, taken while this process can
    still enter them (the interpreter may live under /root, closed to host ``nobody``)."""
    return {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in binds}


# The UTS namespace's names (``_name_the_host``); (none): the kernel's own name for no domain.
_HOST_NAME_TEXT, _DOMAIN_NAME_TEXT = "sandbox\n", "(none)\n"
# /proc files about the host (its load, memory, CPUs, uptime, devices, interrupts), replaced by
# the sandbox's own: the code can neither fingerprint the host nor time the caller through them.
_PROC_EMPTY = (
    "vmstat",
    "zoneinfo",
    "buddyinfo",
    "pagetypeinfo",
    "slabinfo",
    "diskstats",
    "partitions",
    "swaps",
    "interrupts",
    "softirqs",
    "schedstat",
    "sched_debug",
    "timer_list",
    "keys",
    "key-users",
    "locks",
    "latency_stats",
    "pressure/cpu",
    "pressure/memory",
    "pressure/io",
    "sys/kernel/random/boot_id",
    # the host's boot line, kernel build and hardware; host-wide counts that move as the
    # caller works (its open files, inodes, cgroups: one per sandbox run)
    "cmdline",
    "config.gz",
    "kallsyms",
    "iomem",
    "ioports",
    "devices",
    "consoles",
    "misc",
    "mtrr",
    "vmallocinfo",
    "cgroups",
    "sys/fs/file-nr",
    "sys/fs/inode-nr",
    "sys/fs/inode-state",
    "sys/fs/dentry-state",
    "sys/fs/dentry-negative",
    "sys/fs/aio-nr",
    "sys/kernel/pty/nr",
)


# /proc/sys (some 800 of the host's settings and counters: its memory through threads-max and
# file-max, its load through aio-nr, pty/nr, dentry counts) is replaced by a read-only tree of
# the few settings programs read (glibc: ngroups_max; malloc: overcommit_memory), the names the
# UTS namespace gives, and the empty files of ``_PROC_EMPTY``.
_PROC_SYS_KEPT = (
    "kernel/ngroups_max",
    "kernel/pid_max",
    "kernel/cap_last_cap",
    "kernel/osrelease",
    "kernel/ostype",
    "kernel/version",
    "vm/overcommit_memory",
    "vm/max_map_count",
    "fs/nr_open",
    "fs/pipe-max-size",
)
_PROC_SYS_SET = {"kernel/hostname": _HOST_NAME_TEXT, "kernel/domainname": _DOMAIN_NAME_TEXT}


def _proc_masks(spec: dict) -> dict:
    """/proc path -> the text bound over it: figures of the sandbox (``memory_bytes`` of memory,
    as many CPUs as ``cpu_ids``, never used, never loaded, just booted; the kernel's version in
    uname's words), no figure of the host; empty files for the other host-wide counters and
    descriptions of the host (``_PROC_EMPTY``)."""
    kib, cpus = spec["memory_bytes"] >> 10, len(spec["cpu_ids"])
    zeros = " 0" * 10
    stat = "".join(
        [
            f"cpu {zeros}\n",
            *(f"cpu{i}{zeros}\n" for i in range(cpus)),
            "intr 0\nctxt 0\nbtime 0\nprocesses 0\nprocs_running 1\nprocs_blocked 0\nsoftirq 0\n",
        ]
    )
    meminfo = "".join(
        f"{name + ':':<16}{value:>8} kB\n"
        for name, value in (
            ("MemTotal", kib),
            ("MemFree", kib),
            ("MemAvailable", kib),
            ("Buffers", 0),
            ("Cached", 0),
            ("SwapCached", 0),
            ("SwapTotal", 0),
            ("SwapFree", 0),
            ("Shmem", 0),
        )
    )
    cpuinfo = "".join(
        f"processor\t: {i}\nvendor_id\t: sandbox\nmodel name\t: sandbox CPU\nphysical id\t: 0\n"
        f"core id\t\t: {i}\ncpu cores\t: {cpus}\n\n"
        for i in range(cpus)
    )
    uname = os.uname()  # the kernel's release and version are the host's for uname(2) too: no more than that
    masks = {
        "stat": stat,
        "meminfo": meminfo,
        "cpuinfo": cpuinfo,
        "loadavg": "0.00 0.00 0.00 1/2 2\n",
        "uptime": "0.00 0.00\n",
        "version": f"{uname.sysname} version {uname.release} {uname.version}\n",
    }
    masks.update(dict.fromkeys(_PROC_EMPTY, ""))
    return masks


def _minimal_root(spec: dict, handles: dict, devices: dict) -> None:
    """``pivot_root`` into a new root (a read-only tmpfs) holding only: the bound directories
    (the interpreter's prefix, the directories of its shared libraries: read-only, nosuid, nodev),
    the symlinks leading to them (``/lib -> usr/lib``), a fresh ``/proc`` of this PID namespace
    (its host-wide files covered by read-only binds of ``_proc_masks``), a
    ``/dev`` of null, zero and urandom (``devices``: handles on nodes of ``_device_nodes``, else
    the host's devtmpfs nodes, whose mount tells the host's memory size), and the working directory, a tmpfs of ``disk_bytes`` and
    ``max_files`` inodes mounted nodev, nosuid, noexec. The host's old root is detached: nothing
    else of the host (home, project, checkpoints, credentials, Ray's sockets) can be named."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target: str, fstype, flags: int, data=None) -> None:
        if libc.mount(source, target.encode(), fstype, flags, data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target}: {os.strerror(err)}")

    def readonly(
        target: str, recursive: bool, attrs: int = _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
    ) -> None:
        attr = (ctypes.c_uint64 * 4)(attrs, 0, 0, 0)  # struct mount_attr: attr_set, attr_clr, propagation, userns
        if libc.syscall(_SYS_MOUNT_SETATTR, -100, target.encode(), _AT_RECURSIVE if recursive else 0, attr, 32) == 0:
            return
        if ctypes.get_errno() != 38:  # ENOSYS (a kernel before 5.12): a remount keeping the locked flags
            raise OSError(ctypes.get_errno(), f"mount_setattr {target}")
        if not attrs & _MOUNT_ATTR_RDONLY:
            return  # a device's own mount flags: nothing a remount must add
        kept = sum(ms for st, ms in _ST_TO_MS.items() if os.statvfs(target).f_flag & st)
        mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | kept)

    root, workdir = spec["workdir"], spec["workdir"]  # the host directory is only a mount point
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount reaches the host's namespace
    mount(b"tmpfs", root, b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,nr_inodes=4096,mode=0755")
    for path, target in spec["root"]["links"]:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    os.chdir(root)
    for path, fd in handles.items():
        os.makedirs(root + path, exist_ok=True)
        # An overlay whose top layer is its own (empty) mount point on the root tmpfs: statvfs of
        # any file in it reads that tmpfs (overlayfs asks its top layer), not the host's disk, and
        # mountinfo names "overlay sandbox", not the host's device. Where the kernel refuses an
        # overlay here (none built in, or one before 5.11 in a user namespace): a read-only bind.
        options = f"lowerdir=.{path}:/proc/self/fd/{fd}".encode()
        try:
            mount(b"sandbox", root + path, b"overlay", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, options)
        except OSError:
            mount(f"/proc/self/fd/{fd}".encode(), root + path, None, _MS_BIND | _MS_REC)
            readonly(root + path, True)
        os.close(fd)
    os.makedirs(root + "/proc")
    mount(b"proc", root + "/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    staging = root + "/.proc-masks"  # a tmpfs of the sandbox's own /proc files, gone once bound
    os.makedirs(staging)
    mount(b"tmpfs", staging, b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"size=256k,nr_inodes=256,mode=0755")
    masks = {
        name: text for name, text in _proc_masks(spec).items() if os.path.exists(f"{root}/proc/{name}")
    }  # e.g. no /proc/pressure without PSI
    for name in _PROC_SYS_KEPT:  # the few settings programs read, copied; /proc/sys holds nothing else
        if os.path.exists(f"{root}/proc/sys/{name}"):
            with open(f"{root}/proc/sys/{name}") as f:
                masks["sys/" + name] = f.read()
    masks.update(("sys/" + name, text) for name, text in _PROC_SYS_SET.items())
    for name, text in masks.items():  # /proc/sys as one tree, the other files one by one
        path = f"{staging}/{name}" if name.startswith("sys/") else f"{staging}/{name.replace('/', '_')}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    readonly(staging, False, _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOEXEC)
    for name in masks:  # a bind takes its source mount's flags: read-only, one remount for all
        if not name.startswith("sys/"):
            mount(f"{staging}/{name.replace('/', '_')}".encode(), f"{root}/proc/{name}", None, _MS_BIND)
    mount(f"{staging}/sys".encode(), f"{root}/proc/sys", None, _MS_BIND)
    if libc.umount2(staging.encode(), _MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount2 of the /proc masks' staging tmpfs")
    os.rmdir(staging)
    os.makedirs(root + "/dev")
    mount(b"tmpfs", root + "/dev", b"tmpfs", _MS_NOSUID | _MS_NOEXEC, b"size=64k,nr_inodes=64,mode=0755")
    for name in _DEVICES:
        open(f"{root}/dev/{name}", "x").close()
        source = f"/proc/self/fd/{devices[name]}" if name in devices else f"/dev/{name}"
        mount(source.encode(), f"{root}/dev/{name}", None, _MS_BIND)
        readonly(f"{root}/dev/{name}", False, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NOEXEC)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    readonly(root + "/dev", False)  # no new node in /dev; null stays writable
    os.makedirs(root + workdir)
    options = f"size={spec['disk_bytes']},nr_inodes={spec['max_files']},mode=0755".encode()
    mount(b"tmpfs", root + workdir, b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options)
    os.chdir(root)
    if libc.syscall(155, b".", b".") != 0:  # pivot_root(".", "."): the old root is stacked under the new one
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", _MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount2 of the old root")
    os.chdir("/")
    readonly("/", False)
    os.chdir(workdir)


_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 38, 47, 4
_CAP_VERSION_3 = 0x20080522


def _drop_privileges(drop_uid) -> None:
    """No capability left in any set (also none an ``execve`` could bring back), ``no_new_privs``;
    ``drop_uid``: switch to that uid/gid in between (needs CAP_SETUID, lost right after)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):  # refused without CAP_SETPCAP: then no_new_privs alone keeps exec bare
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if drop_uid is not None:
        os.setgroups([])
        os.setresgid(drop_uid, drop_uid, drop_uid)
        os.setresuid(drop_uid, drop_uid, drop_uid)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")


_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_CLONE_NEWIPC, _CLONE_NEWUTS = 0x08000000, 0x04000000
_PR_SET_PDEATHSIG = 1


_DEVICES = {"null": (1, 3), "zero": (1, 5), "urandom": (1, 9)}


def _device_nodes(workdir: str) -> None:
    """The sandbox's device nodes on a tiny tmpfs of their own over ``workdir``, in a mount
    namespace of this process alone, made while this process is still host root (only host root
    may make device nodes: a user namespace's root may not). Bound from there, ``/dev/null`` tells
    statvfs and mountinfo that tmpfs's size, not the host's devtmpfs (half of the host's memory).
    The user namespace made next copies this mount, locked: the code cannot unmount it."""
    import ctypes
    import stat

    libc = ctypes.CDLL(None, use_errno=True)
    if (
        libc.unshare(_CLONE_NEWNS) != 0
        or libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0
        or libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", _MS_NOSUID | _MS_NOEXEC, b"size=4k,nr_inodes=8,mode=0755")
    ):
        raise OSError(ctypes.get_errno(), "a mount namespace and tmpfs for the device nodes")
    for name, (major, minor) in _DEVICES.items():
        os.mknod(f"{workdir}/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(f"{workdir}/{name}", 0o666)  # whatever the umask


def _enter_namespaces(spec: dict) -> tuple[dict, dict]:
    """New user, mount, network, PID, IPC (no System V object or POSIX queue of the host) and UTS
    namespaces; the uid/gid map: as host root, the caller's (its byte on stdin: the namespace's
    root is host ``nobody``; until then this process kept host root's uid and groups, only
    unmapped), else this process maps its own unprivileged user to the namespace's root. Then it
    takes that root and forks the PID namespace's init, which returns (with the handles of
    ``_open_binds`` and of ``_device_nodes``). This process only waits for the init and exits as
    it does (as ``unshare --fork`` would). Made here, not by ``unshare(1)``, in both cases: the
    init's memory then belongs to the host's user namespace, so once it is not dumpable its
    ``/proc/1`` files (``oom_score_adj``, ``sched``, ``comm``, ``fd`` ...) are host root's, not the
    code's to write."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    host_root, uid, gid = os.geteuid() == 0, os.geteuid(), os.getegid()
    if host_root:
        _device_nodes(spec["workdir"])
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    handles = _open_binds(spec["root"]["binds"])  # in the new mount namespace, still as the host's user
    devices = {name: os.open(f"{spec['workdir']}/{name}", os.O_PATH) for name in _DEVICES} if host_root else {}
    if spec["map_self"]:  # an unprivileged user may map itself alone, with setgroups refused for good
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1\n"), ("gid_map", f"0 {gid} 1\n")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if spec["wait_for_caller"]:  # the caller's map written (as root) and this process in the run's cgroup
        os.read(0, 1)
    if not spec["map_self"]:
        os.setgroups([])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    init = os.fork()
    if init:
        os.close(spec["status_fd"])  # the init's copy alone: the caller sees EOF when the init ends
        _drop_privileges(None)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        _, status = os.waitpid(init, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return handles, devices


_CLONE_NEWTIME, _EINVAL, _PR_GET_DUMPABLE = 0x80, 22, 3


def _new_time_namespace() -> None:
    """A time namespace for the processes this one forks (the code's): CLOCK_MONOTONIC and
    CLOCK_BOOTTIME start near 0 there, and so do the start times in ``/proc/<pid>/stat``; the
    host's uptime (when it booted, how long the caller has run) cannot be read off the clocks.
    Needs the user namespace's CAP_SYS_TIME, so it runs before the privileges go. A kernel
    without time namespaces (before 5.6, or CONFIG_TIME_NS off) refuses with EINVAL: the clocks
    then stay the host's."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWTIME) != 0:
        if ctypes.get_errno() == _EINVAL:
            return
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWTIME)")
    offsets = [
        f"{name} {1 - int(time.clock_gettime(clock))} 0"  # the kernel keeps the clocks >= 0
        for name, clock in (("monotonic", time.CLOCK_MONOTONIC), ("boottime", time.CLOCK_BOOTTIME))
    ]
    dumpable = libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0)  # 0 after a uid change: /proc/self is then host root's
    libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        with open("/proc/self/timens_offsets", "w") as f:
            f.write("\n".join(offsets) + "\n")
    finally:
        libc.prctl(_PR_SET_DUMPABLE, dumpable, 0, 0, 0)


_CLONE_NEWCGROUP = 0x02000000


def _new_cgroup_namespace() -> None:
    """A cgroup namespace rooted at this process's cgroups (the run's own, where the caller made
    one): ``/proc/<pid>/cgroup`` then reads ``/`` in every hierarchy, not the caller's placement
    (a container's or a job's cgroup, the run's cgroup named after the caller's pid). It applies
    to this process at once, so the code inherits it. Needs the user namespace's CAP_SYS_ADMIN,
    so it runs before the privileges go; a kernel without cgroup namespaces (before 4.6, or
    CONFIG_CGROUPS off) refuses with EINVAL: the paths then stay the host's."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWCGROUP) != 0 and ctypes.get_errno() != _EINVAL:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWCGROUP)")


_HOST_NAME, _DOMAIN_NAME = _HOST_NAME_TEXT.strip().encode(), _DOMAIN_NAME_TEXT.strip().encode()


def _name_the_host() -> None:
    """The UTS namespace's node and domain names: a fresh namespace starts with a copy of the
    host's, and the node name tells the code which machine of the cluster it runs on. Needs the
    user namespace's CAP_SYS_ADMIN, so it runs before the privileges go."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.sethostname(_HOST_NAME, len(_HOST_NAME)) != 0 or libc.setdomainname(_DOMAIN_NAME, len(_DOMAIN_NAME)):
        raise OSError(ctypes.get_errno(), "sethostname / setdomainname")


_KEYCTL_JOIN_SESSION_KEYRING, _SYS_KEYCTL, _ENOSYS, _EPERM = 1, 250, 38, 1


def _new_session_keyring() -> None:
    """A fresh, empty session keyring: the caller's is inherited across fork and exec whatever
    the uid, and a key there (a token, a Kerberos ticket) would be the code's to read where no
    seccomp filter refuses ``keyctl``. A kernel without keyrings (ENOSYS), or a machine that
    refuses ``keyctl`` to this process (EPERM, e.g. a container's filter, refusing the code too),
    has none to leak."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    refused = libc.syscall(_SYS_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0
    if refused and ctypes.get_errno() not in (_ENOSYS, _EPERM):
        raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")


_DENIED_SYSCALLS = (
    "ptrace",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "process_vm_readv",
    "process_vm_writev",
    "mknod",
    "mknodat",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "personality",
    "open_by_handle_at",
    "name_to_handle_at",
    "io_uring_setup",
    "userfaultfd",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "fsopen",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "fork",
    "vfork",
    "execve",
    "execveat",
    "sched_setaffinity",
)
_SCMP_ACT_ALLOW, _SCMP_ACT_ERRNO_EPERM, _SCMP_ACT_ERRNO_ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
_SCMP_ACT_NOTIFY = 0x7FC00000  # the init answers (sandbox_sysinfo)
_SCMP_CMP_NE, _SCMP_CMP_EQ, _SCMP_CMP_MASKED_EQ = 1, 4, 7
_AF_UNIX, _CLONE_THREAD, _FS_IOC_SETFLAGS = 1, 0x10000, 0x40086602
_PRIO_PROCESS, _IOPRIO_WHO_PROCESS = 0, 1


def _seccomp(lib, notify: bool = False):
    """A seccomp filter (libseccomp through ctypes) refusing with EPERM: the syscalls of
    ``_DENIED_SYSCALLS``, sockets other than AF_UNIX, ``clone`` without CLONE_THREAD (threads stay
    possible, processes do not), and the ioctl that sets inode flags (immutable files). ``clone3``
    answers ENOSYS, so that the C library falls back to ``clone``, whose flags the filter can read;
    limits, priorities and scheduling of any process but the caller's own (``prlimit64``,
    ``setpriority``, ``ioprio_set``, ``sched_set*`` with a pid), and any change of its own RLIMIT_CORE.
    ``notify``: ``sysinfo`` goes to the
    init's supervisor (``sandbox_sysinfo``); returns the filter's listener fd (else None)."""
    import ctypes

    class ArgCmp(ctypes.Structure):
        _fields_ = [
            ("arg", ctypes.c_uint),
            ("op", ctypes.c_int),
            ("datum_a", ctypes.c_uint64),
            ("datum_b", ctypes.c_uint64),
        ]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def deny(name: str, action: int = _SCMP_ACT_ERRNO_EPERM, *conditions) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a syscall on this architecture (e.g. an old one)
            return
        args = (ArgCmp * max(1, len(conditions)))(*conditions)
        rc = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), args)
        if rc != 0:
            raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

    for name in _DENIED_SYSCALLS:
        deny(name)
    deny("clone3", _SCMP_ACT_ERRNO_ENOSYS)
    deny("clone", _SCMP_ACT_ERRNO_EPERM, ArgCmp(0, _SCMP_CMP_MASKED_EQ, _CLONE_THREAD, 0))
    deny("socket", _SCMP_ACT_ERRNO_EPERM, ArgCmp(0, _SCMP_CMP_NE, _AF_UNIX, 0))
    deny("socketpair", _SCMP_ACT_ERRNO_EPERM, ArgCmp(0, _SCMP_CMP_NE, _AF_UNIX, 0))
    deny("ioctl", _SCMP_ACT_ERRNO_EPERM, ArgCmp(1, _SCMP_CMP_EQ, _FS_IOC_SETFLAGS, 0))
    # The init has the code's uid, so the kernel would let the code lower its limits (no file
    # descriptor left for the report's checks), its priority, its scheduling: only its own.
    for name in ("prlimit64", "sched_setscheduler", "sched_setparam", "sched_setattr"):
        deny(name, _SCMP_ACT_ERRNO_EPERM, ArgCmp(0, _SCMP_CMP_NE, 0, 0))  # pid 0: the calling thread
    # RLIMIT_CORE stays 1 (``_limit``): at 0 a dump of the code would reach a "|helper" core_pattern again
    deny(
        "prlimit64",
        _SCMP_ACT_ERRNO_EPERM,
        ArgCmp(1, _SCMP_CMP_EQ, resource.RLIMIT_CORE, 0),
        ArgCmp(2, _SCMP_CMP_NE, 0, 0),
    )
    deny("setrlimit", _SCMP_ACT_ERRNO_EPERM, ArgCmp(0, _SCMP_CMP_EQ, resource.RLIMIT_CORE, 0))
    for name, self_kind in (("setpriority", _PRIO_PROCESS), ("ioprio_set", _IOPRIO_WHO_PROCESS)):
        deny(name, _SCMP_ACT_ERRNO_EPERM, ArgCmp(0, _SCMP_CMP_NE, self_kind, 0))  # not a process: a group or a uid
        deny(name, _SCMP_ACT_ERRNO_EPERM, ArgCmp(1, _SCMP_CMP_NE, 0, 0))  # a process other than this one
    if notify:
        deny("sysinfo", _SCMP_ACT_NOTIFY)
    rc = lib.seccomp_load(ctx)
    if rc != 0:
        raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    if not notify:
        return None
    lib.seccomp_notify_fd.argtypes = [ctypes.c_void_p]
    fd = lib.seccomp_notify_fd(ctx)
    if fd < 0:
        raise OSError(-fd, f"seccomp_notify_fd: {os.strerror(-fd)}")
    return fd


def _limit(spec: dict) -> None:
    cpu = int(spec["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if not spec.get("cgroup_memory"):  # else the cgroup bounds the whole sandbox's memory (and counts it)
        resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["max_open_files"], spec["max_open_files"]))
    # 1, not 0: below a page no core file is written, and 1 is the kernel's mark that aborts a dump to a
    # "|helper" core_pattern (which ignores the limit otherwise and runs the host's helper on our memory)
    resource.setrlimit(resource.RLIMIT_CORE, (1, 1))
    os.sched_setaffinity(0, spec["cpu_ids"])  # the sandbox's CPUs alone; seccomp then keeps it there
    if spec.get("own_user_namespace"):  # there the kernel counts this uid's tasks (threads too) per namespace:
        # the sandbox's alone, the runner's three included -- the bound on tasks where no cgroup is
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_processes"], spec["max_processes"]))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the output limit must end the run


def _run(spec: dict, seccomp_lib, notify_sock=None) -> None:
    """The code's process: limits, filter, guards, then the code. Its exit status means nothing to
    the caller beyond ok / error: the init (or the caller) reports how it ended. With ``notify_sock``
    the filter sends ``sysinfo`` to the init (its listener handed over on that socket, then closed here),
    and the process is dumpable so that the init may write the answer (``sandbox_sysinfo``)."""
    code = spec.pop("code")
    try:  # under the cgroup's memory limit the OOM killer should take the code, not its init
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass  # the largest process is the code's anyway
    _limit(spec)
    if notify_sock is not None:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # RLIMIT_CORE = 1 keeps core dumps away
    if seccomp_lib is not None:
        listener = _seccomp(seccomp_lib, notify=notify_sock is not None)
        if listener is not None:
            _SYSINFO.send_fd(notify_sock, listener)
            os.close(listener)
            notify_sock.close()
    if spec["python_guards"]:
        _install_guard(spec["workdir"], spec["refuse_sockets"])
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:  # the model's own error (MemoryError too): its traceback, without our frame
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        traceback.print_exception(type(exc), exc, tb, limit=8)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


def _largest_file(top: str) -> int:
    """Size of the largest regular file under ``top`` (iterative: a 1,500-deep tree is fine)."""
    largest, stack = 0, [top]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            elif entry.is_file(follow_symlinks=False):
                largest = max(largest, entry.stat(follow_symlinks=False).st_size)
    return largest


def _deaf_to_signals() -> dict:
    """Every signal's action back to the default; the handlers it had, for the code's process.

    The kernel drops a signal sent to a PID namespace's init from inside the namespace unless the
    init handles it, and Python handles SIGINT: without this, the code (the same uid) could end
    its init with ``kill(1, SIGINT)`` before it reports, and the run would read ``sandbox_error``."""
    handlers = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handlers[sig] = signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # e.g. the real-time signals glibc keeps for itself
            pass
    return {sig: handler for sig, handler in handlers.items() if handler is not None}


def _serve_sysinfo(child: int, sock, spec: dict, nr_sysinfo: int, started: float) -> None:
    """Until the code's process ends: answer its ``sysinfo`` calls (``sandbox_sysinfo.SysinfoServer``) on
    the listener it sends on ``sock``; returns at once when it sent none (it failed before its filter)."""
    import select

    listener = _SYSINFO.receive_fd(sock)
    sock.close()
    if listener is None:
        return
    server = _SYSINFO.SysinfoServer(listener, spec["memory_bytes"], started, nr_sysinfo)
    ended = os.pidfd_open(child)
    poll = select.poll()
    poll.register(ended, select.POLLIN)
    poll.register(listener, select.POLLIN)
    while True:
        events = dict(poll.poll())
        if ended in events:
            break
        if listener in events:
            if not (events[listener] & select.POLLIN) or not server.serve_one():
                poll.unregister(listener)  # no process holds the filter any more


def _supervise(child: int, spec: dict, notify=None) -> None:
    """The PID namespace's init: reap every process until the code's own ends, then write on the
    status pipe (which the code never held) how it ended, as the kernel told us: its exit status
    or signal, its CPU seconds, and whether the working directory's tmpfs was full (``disk_full``)
    or a file reached the per-file limit (``file_limit``); then exit, taking the namespace along.
    ``notify`` (``(socket, sysinfo's number)``): until then it answers the code's ``sysinfo`` calls."""
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # the code cannot ptrace its init
    if notify is not None:
        _serve_sysinfo(child, notify[0], spec, notify[1], time.monotonic())
    report = {"exit": None, "cpu": 0.0}
    while True:  # reap every orphan re-parented to us until our own child ends
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            report = {"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
            break
    if spec.get("root"):
        disk = os.statvfs(spec["workdir"])
        report["disk_full"] = disk.f_bavail == 0 or disk.f_favail == 0
    if report["exit"] == -signal.SIGXFSZ:
        report["file_limit"] = _largest_file(spec["workdir"]) >= spec["file_bytes"]
    os.write(spec["status_fd"], json.dumps(report).encode())
    os._exit(0)


_SYSINFO = None
"""``sandbox_sysinfo``, loaded by ``_load_sysinfo`` (the init's ``sysinfo`` answers)."""


def _load_sysinfo():
    """``sandbox_sysinfo`` beside this file, loaded by path while the host's root is still visible (this
    process's ``sys.path`` holds neither this directory nor the package)."""
    global _SYSINFO
    if _SYSINFO is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_sysinfo.py")
        found = importlib.util.spec_from_file_location("sandbox_sysinfo", path)
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
        _SYSINFO = module
    return _SYSINFO


def main() -> None:
    """Entry point (see the module docstring)."""
    spec = json.loads(sys.argv[1])
    sys.path[:1] = []  # not this directory: the model's imports must not find our modules
    with open(spec["code_path"]) as f:
        spec["code"] = f.read()  # before the working directory becomes a fresh tmpfs
    seccomp_lib = None
    if spec.get("seccomp"):
        import ctypes

        seccomp_lib = ctypes.CDLL(spec["seccomp"], use_errno=True)  # loaded while the host's libraries are visible
    notify = seccomp_lib is not None and bool(spec.get("init")) and _load_sysinfo().notify_supported(seccomp_lib)
    if spec.get("unshare"):
        handles, devices = _enter_namespaces(spec)
    else:
        handles, devices = {}, {}  # no namespaces, so no minimal root either
    if spec.get("root"):
        _minimal_root(spec, handles, devices)
        _new_time_namespace()
        _new_cgroup_namespace()
        _name_the_host()
    else:
        os.chdir(spec["workdir"])
    _new_session_keyring()
    _drop_privileges(spec.get("drop_uid"))
    notify_sock = None
    if spec.get("init"):
        handlers = _deaf_to_signals()  # before the fork: the code cannot signal the init in between
        if notify:
            import socket

            init_sock, notify_sock = socket.socketpair()
        child = os.fork()
        if child:
            if notify:
                notify_sock.close()
                nr_sysinfo = seccomp_lib.seccomp_syscall_resolve_name(b"sysinfo")
            _supervise(child, spec, (init_sock, nr_sysinfo) if notify else None)
        if notify:
            init_sock.close()
        for sig, handler in handlers.items():  # the code gets Python's usual handlers back
            signal.signal(sig, handler)
        os.close(spec["status_fd"])  # the code cannot write its own report
    _run(spec, seccomp_lib, notify_sock)


if __name__ == "__main__":
    main()
