"""The sandbox's own ``sysinfo(2)``: a seccomp user-notification supervisor in the PID namespace's init.

``sysinfo(2)`` has no namespace: it returns the host's memory, load average and task count (only its
uptime follows the time namespace), and glibc's ``sysconf(_SC_PHYS_PAGES)`` / ``_SC_AVPHYS_PAGES`` read it
without checking for a failure, so a filter that refused it would hand libraries garbage. Instead the
code's seccomp filter sends every ``sysinfo`` to the init (``SCMP_ACT_NOTIFY``: the calling thread waits),
and the init answers it with the sandbox's figures -- ``memory_bytes`` of memory, all free, no swap, no
load, the sandbox's own tasks, the seconds since it started -- written into the caller's buffer, as
``/proc/meminfo``, ``/proc/loadavg`` and ``/proc/uptime`` read there. The host's figures are never
computed for it: the real syscall does not run.

The init writes the answer with ``process_vm_writev``, which the kernel allows it for a process of its
own uid without capabilities only when that process is dumpable: the code's process is made dumpable
(``prctl`` is the code's own to call anyway), and its core dumps stay impossible through
``RLIMIT_CORE`` = 1 (below a page: no core file; and the kernel's mark that aborts a piped dump, so a
``|helper`` core_pattern never runs a host helper on the code's memory). A buffer the code cannot write
gets ``EFAULT``, as from the kernel; a thread that ends while it waits is skipped
(``SECCOMP_IOCTL_NOTIF_ID_VALID`` after the write, before the answer). Standard library only: the runner
loads this file by path before its ``sys.path`` is cut and the host's root detached.

Where libseccomp or the kernel cannot notify (libseccomp's API level below 5, or no ``pidfd_open`` for
the init's wait) the filter leaves ``sysinfo`` alone and the host's figures show, as the module
``megatron_rl.rollout.tools.sandbox`` says.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import socket
import time

__all__ = ["notify_supported", "send_fd", "receive_fd", "SysinfoServer", "sysinfo_bytes"]

_API_NOTIFY = 5
"""``seccomp_api_get()`` level from which the kernel and libseccomp support user notification."""
# <linux/seccomp.h>: _IOWR('!', 0, struct seccomp_notif), _IOWR('!', 1, struct seccomp_notif_resp),
# _IOW('!', 2, __u64)
_NOTIF_RECV, _NOTIF_SEND, _NOTIF_ID_VALID = 0xC0502100, 0xC0182101, 0x40082102


class _Data(ctypes.Structure):
    _fields_ = [
        ("nr", ctypes.c_int),
        ("arch", ctypes.c_uint32),
        ("instruction_pointer", ctypes.c_uint64),
        ("args", ctypes.c_uint64 * 6),
    ]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("data", _Data)]


class _Resp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class _Sysinfo(ctypes.Structure):
    """``struct sysinfo`` (<linux/sysinfo.h>) on a 64-bit kernel: 112 bytes on x86_64 and aarch64."""

    _fields_ = [
        ("uptime", ctypes.c_long),
        ("loads", ctypes.c_ulong * 3),
        ("totalram", ctypes.c_ulong),
        ("freeram", ctypes.c_ulong),
        ("sharedram", ctypes.c_ulong),
        ("bufferram", ctypes.c_ulong),
        ("totalswap", ctypes.c_ulong),
        ("freeswap", ctypes.c_ulong),
        ("procs", ctypes.c_ushort),
        ("totalhigh", ctypes.c_ulong),
        ("freehigh", ctypes.c_ulong),
        ("mem_unit", ctypes.c_uint),
    ]


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def notify_supported(lib) -> bool:
    """Whether ``lib`` (libseccomp, through ctypes) and the kernel can notify, and this process can wait
    for a child with a pidfd beside the notifications (``os.pidfd_open``)."""
    try:
        if int(lib.seccomp_api_get()) < _API_NOTIFY or not hasattr(lib, "seccomp_notify_fd"):
            return False
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return ctypes.sizeof(_Sysinfo) == 112  # the 64-bit layout this file writes


def send_fd(sock: socket.socket, fd: int) -> None:
    """Hand the filter's listener ``fd`` to the init (then the code's process closes its copy)."""
    socket.send_fds(sock, [b"n"], [fd])


def receive_fd(sock: socket.socket):
    """The listener the code's process sent, or None when it ended before sending one."""
    try:
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    except OSError:
        return None
    return fds[0] if fds else None


def sysinfo_bytes(memory_bytes: int, uptime_s: float, tasks: int) -> bytes:
    """The sandbox's ``struct sysinfo``: ``memory_bytes`` of RAM, all of it free, no swap, no load,
    ``tasks`` tasks, ``uptime_s`` seconds up (rounded up, as the kernel rounds)."""
    info = _Sysinfo()
    info.uptime = math.ceil(uptime_s)
    info.totalram = info.freeram = int(memory_bytes)
    info.procs = max(1, min(int(tasks), 0xFFFF))
    info.mem_unit = 1
    return ctypes.string_at(ctypes.byref(info), ctypes.sizeof(info))


def _tasks() -> int:
    """Tasks (threads included) of this PID namespace, read from its own ``/proc``."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return count


class SysinfoServer:
    """Answers the code's ``sysinfo`` calls on the filter's listener ``fd`` (``serve_one`` when it polls
    readable). ``started`` is ``time.monotonic()`` at the sandbox's start."""

    def __init__(self, fd: int, memory_bytes: int, started: float, nr_sysinfo: int):
        self.fd, self.memory_bytes, self.started, self.nr = fd, memory_bytes, started, nr_sysinfo
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.process_vm_writev.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        self._libc.process_vm_writev.restype = ctypes.c_ssize_t
        self._libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]

    def _write(self, pid: int, address: int) -> int:
        """0, or the errno the call answers: the sandbox's figures into ``address`` of task ``pid``."""
        data = sysinfo_bytes(self.memory_bytes, time.monotonic() - self.started, _tasks())
        buffer = ctypes.create_string_buffer(data, len(data))
        local = _IOVec(ctypes.cast(buffer, ctypes.c_void_p), len(data))
        remote = _IOVec(ctypes.c_void_p(address), len(data))
        done = self._libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if done == len(data):
            return 0
        return errno.EFAULT if done >= 0 or ctypes.get_errno() == errno.EFAULT else errno.ENOSYS

    def serve_one(self) -> bool:
        """Answer one waiting call; False when no process holds the filter any more."""
        request = _Notif()  # zeroed, as the kernel requires
        if self._libc.ioctl(self.fd, _NOTIF_RECV, ctypes.byref(request)) != 0:
            return ctypes.get_errno() in (errno.EINTR, errno.ENOENT)  # ENOENT: that call is gone already
        error = self._write(request.pid, request.data.args[0]) if request.data.nr == self.nr else errno.ENOSYS
        ident = ctypes.c_uint64(request.id)
        if self._libc.ioctl(self.fd, _NOTIF_ID_VALID, ctypes.byref(ident)) != 0:
            return True  # the caller died meanwhile (its pid cannot be reused: the code makes no process)
        response = _Resp(request.id, 0, -error, 0)
        self._libc.ioctl(self.fd, _NOTIF_SEND, ctypes.byref(response))
        return True
