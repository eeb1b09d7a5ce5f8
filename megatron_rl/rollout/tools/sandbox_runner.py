"""Runs inside the sandbox process: limits, privileges and guards first, then the model's code.

Started by ``megatron_rl.rollout.tools.sandbox.run_python`` as ``python -I sandbox_runner.py
SPEC`` (SPEC: JSON). Imports only the standard library, so it starts fast. When it is the init
process of a fresh PID namespace (``spec["init"]``) it forks once and only reaps: the code then
runs as an ordinary process (signals such as SIGXCPU act on it), and when the init ends the
kernel kills everything left in the namespace.

Order: when the caller maps our user namespace (``spec["await_map"]``: it writes uid_map /
gid_map, then one byte on stdin) become its root, which is host ``nobody``, with no supplementary
groups; in a private mount namespace (``spec["readonly_mounts"]``) every mount becomes read-only
except a bind mount of the working directory; then privileges go for good, before the fork
(init and code alike): the capability bounding set emptied, root dropped to ``nobody``
(``spec["drop_uid"]``, only without namespaces), every capability cleared, ``no_new_privs``.
In the code's process: resource limits (CPU seconds, address space, file size, open files, no
core files); enter the private working directory;
install an audit hook (it cannot be removed from Python) that refuses process creation, signals,
ctypes, writes outside the working directory, Unix sockets and -- when no network namespace
isolates the process -- every socket; then ``exec`` the code as ``__main__``.
"""

import json
import os
import resource
import signal
import sys
import traceback

EXIT_MEMORY = 86
"""Exit status of code that ran out of its address-space limit (MemoryError)."""
_BLOCKED = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
    "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.call_function", "os.setuid", "os.setgid", "sys.setprofile"})
# event -> positions of the path arguments that a write touches
_PATH_EVENTS = {"os.remove": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.rmdir": (0,), "os.symlink": (1,),
                "os.link": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
                "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "os.mkfifo": (0,),
                "os.mknod": (0,)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_WRITABLE_DEVICES = ("/dev/null",)


def _unix_socket(event: str, args: tuple) -> bool:
    if event == "socket.__new__":
        return len(args) > 1 and args[1] == getattr(__import__("socket"), "AF_UNIX", 1)
    return event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg") and len(args) > 1 \
        and isinstance(args[1], (str, bytes))


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
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            paths = (path,) if writing else ()
        elif event in _PATH_EVENTS:
            paths = tuple(args[i] for i in _PATH_EVENTS[event] if i < len(args))
        if not paths:
            return
        busy.append(1)
        try:
            for path in paths:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: writing {os.fsdecode(path)!r} outside the working directory "
                                          "is not allowed")
        finally:
            busy.pop()

    sys.addaudithook(hook)


_MS_RDONLY, _MS_REMOUNT, _MS_BIND = 1, 32, 4096
_MOUNT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21,
                "strictatime": 1 << 24}  # per-mount flags a remount must keep (a user namespace locks them)


def _readonly_mounts(workdir: str, disk_bytes: int = 0, max_files: int = 0) -> None:
    """Every mount of this (private) mount namespace read-only, the working directory writable: a
    tmpfs of ``disk_bytes`` and ``max_files`` inodes (nodev, nosuid) when given, else a bind mount."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target: str, flags: int) -> None:
        if libc.mount(source, target.encode(), None, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target}: {os.strerror(err)}")

    if disk_bytes:
        options = f"size={disk_bytes},nr_inodes={max_files},mode=0755".encode()
        if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", 2 | 4, options) != 0:  # nosuid, nodev
            err = ctypes.get_errno()
            raise OSError(err, f"mount tmpfs {workdir}: {os.strerror(err)}")
    else:
        mount(workdir.encode(), workdir, _MS_BIND)  # its own mount, left writable below
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        target = row[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        if target == workdir:
            continue
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY
        for option in row[5].split(","):
            flags |= _MOUNT_FLAGS.get(option, 0)
        try:
            mount(None, target, flags)
        except OSError:
            if target == "/":
                raise
            # a mount hidden under another one (stacked on the same point) cannot be reached


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
_MS_REC, _MS_PRIVATE, _PR_SET_PDEATHSIG = 16384, 1 << 18, 1


def _enter_namespaces() -> None:
    """New user, mount, network and PID namespaces; wait for the caller's uid/gid map (its byte on
    stdin), take the namespace's root (host ``nobody``: until now this process kept host root's uid
    and groups, only unmapped), then fork the PID namespace's init with a fresh ``/proc``. This
    process only waits for the init and exits as it does (as ``unshare --fork`` would)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    # The interpreter may live under a directory only host root can enter (/root/.pyenv). Our files
    # still carry host root's uid until we take the mapped one: keep a handle on the prefixes (in the
    # new mount namespace), to bind them into an empty /root once we are nobody.
    prefixes = sorted({p for p in (sys.base_prefix, sys.prefix) if p.startswith(_HIDDEN_HOME + os.sep)})
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in prefixes}
    os.read(0, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    init = os.fork()
    if init:
        _drop_privileges(None)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        _, status = os.waitpid(init, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for source, target, fstype, flags in ((None, b"/", None, _MS_REC | _MS_PRIVATE),
                                          (b"proc", b"/proc", b"proc", 2 | 4 | 8)):  # nosuid, nodev, noexec
        if libc.mount(source, target, fstype, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target.decode()}: {os.strerror(err)}")
    _hide_home(libc, handles)


_HIDDEN_HOME = "/root"


def _hide_home(libc, handles: dict) -> None:
    """An empty tmpfs over /root (the code sees nothing of it) holding only the interpreter's prefixes."""
    import ctypes

    def mount(source, target: str, fstype, flags: int, data) -> None:
        if libc.mount(source, target.encode(), fstype, flags, data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target}: {os.strerror(err)}")

    if not os.path.isdir(_HIDDEN_HOME):
        return
    mount(b"tmpfs", _HIDDEN_HOME, b"tmpfs", 2 | 4, b"size=1m,mode=0755")  # nosuid, nodev
    for path, fd in handles.items():
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}".encode(), path, None, _MS_BIND | _MS_REC, None)
        os.close(fd)


_DENIED_SYSCALLS = (
    "ptrace", "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "process_vm_readv",
    "process_vm_writev", "mknod", "mknodat", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "personality",
    "open_by_handle_at", "name_to_handle_at", "io_uring_setup", "userfaultfd", "swapon", "swapoff", "reboot",
    "acct", "quotactl", "fsopen", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "fork", "vfork", "execve", "execveat")
_SCMP_ACT_ALLOW, _SCMP_ACT_ERRNO_EPERM, _SCMP_ACT_ERRNO_ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
_SCMP_CMP_NE, _SCMP_CMP_EQ, _SCMP_CMP_MASKED_EQ = 1, 4, 7
_AF_UNIX, _CLONE_THREAD, _FS_IOC_SETFLAGS = 1, 0x10000, 0x40086602


def _seccomp(library: str) -> None:
    """A seccomp filter (libseccomp through ctypes) refusing with EPERM: the syscalls of
    ``_DENIED_SYSCALLS``, sockets other than AF_UNIX, ``clone`` without CLONE_THREAD (threads stay
    possible, processes do not), and the ioctl that sets inode flags (immutable files). ``clone3``
    answers ENOSYS, so that the C library falls back to ``clone``, whose flags the filter can read."""
    import ctypes

    class ArgCmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                    ("datum_b", ctypes.c_uint64)]

    lib = ctypes.CDLL(library, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
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
    rc = lib.seccomp_load(ctx)
    if rc != 0:
        raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")


def _limit(spec: dict) -> None:
    cpu = int(spec["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["max_open_files"], spec["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the output limit must end the run


def _run(spec: dict) -> None:
    if "code" in spec:
        code = spec["code"]
    else:
        with open(spec["code_path"]) as f:
            code = f.read()
    _limit(spec)
    os.chdir(spec["workdir"])
    if spec.get("seccomp"):
        _seccomp(spec["seccomp"])
    if spec["python_guards"]:
        _install_guard(spec["workdir"], spec["refuse_sockets"])
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except MemoryError:
        sys.stdout.flush()
        sys.stderr.write(f"MemoryError: the sandbox's memory limit ({spec['memory_bytes'] >> 20} MiB) was exceeded\n")
        sys.stderr.flush()
        os._exit(EXIT_MEMORY)
    except SystemExit:
        raise
    except BaseException as exc:  # the model's own error: its traceback, without this runner's frame
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        traceback.print_exception(type(exc), exc, tb, limit=8)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


def main() -> None:
    """Entry point (see the module docstring)."""
    spec = json.loads(sys.argv[1])
    sys.path[:1] = []  # not this directory: the model's imports must not find our modules
    if spec.get("unshare"):
        _enter_namespaces()
    if spec.get("readonly_mounts"):
        with open(spec["code_path"]) as f:
            spec["code"] = f.read()  # the tmpfs hides the file
        _readonly_mounts(spec["workdir"], spec.get("disk_bytes", 0), spec.get("max_files", 0))
    _drop_privileges(spec.get("drop_uid"))
    if spec.get("init"):
        child = os.fork()
        if child:
            import ctypes

            ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # the code cannot ptrace its init
            code = 1
            while True:  # reap every orphan re-parented to us until our own child ends
                try:
                    pid, status = os.wait()
                except ChildProcessError:
                    break
                if pid == child:
                    code = os.waitstatus_to_exitcode(status)
                    break
            os._exit(code if code >= 0 else 128 - code)
    _run(spec)


if __name__ == "__main__":
    main()
