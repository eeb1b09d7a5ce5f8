"""Attacks through ``CodeInterpreterTool.execute`` with the default limits (issue 27), as the model
would send them: the audit hook is on, so each attack first gets past it (a sub-interpreter has
no audit hook; or the hook's closure found through ``gc``), then tries the kernel. Each is judged
from the host side: the call's time, the observation, a host listener, a host secret.

Two of them succeeded before the fix they test: signals to the PID namespace's init (Python
handles SIGINT, so ``kill(1, SIGINT)`` ended it before its report: ``sandbox_error``), and the
init's limits (the init has the code's uid, so ``prlimit(1, RLIMIT_NOFILE, 0)`` left it no
descriptor to check the files by: a file over the size limit read ``killed``, not ``output_limit``).
"""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest

from megatron_rl.rollout.tools.code_tool import CodeInterpreterTool
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation

pytestmark = pytest.mark.skipif(
    not (isolation().minimal_root and isolation().seccomp), reason="needs user namespaces and libseccomp"
)
SECRET = "s3cr3t-token-27-attacks"
_PRELUDE = "import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def execute(payload: str, bypass: bool = True):
    """``payload`` through the code tool with the default limits, in a sub-interpreter (past the
    audit hook) unless ``bypass`` is off; the observation's text and error flag."""
    tool = CodeInterpreterTool()
    code = f"import _xxsubinterpreters as si\nsi.run_string(si.create(), {_PRELUDE + payload!r})" if bypass else payload
    start = time.monotonic()
    response = tool.execute("attack", {"code": code})
    assert time.monotonic() - start < tool.limits.wall_seconds + 2, response
    assert SECRET not in response.text, response
    return response.text, response.error


def lines(text: str) -> dict:
    return dict(line.split(" ", 1) for line in text.splitlines() if " " in line and not line.startswith("["))


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("MRL_TEST_SECRET", SECRET)


def test_signals_to_the_init_do_not_end_it_before_its_report():
    text, error = execute(
        "import signal, time\nfor s in ('SIGINT', 'SIGTERM', 'SIGHUP', 'SIGUSR1', 'SIGALRM', "
        "'SIGQUIT', 'SIGCHLD'):\n    print(s, libc.kill(1, getattr(signal, s)))\n"
        "pidfd = libc.syscall(434, 1, 0)\n"  # pidfd_send_signal: the same rule
        "print('pidfd', libc.syscall(424, pidfd, signal.SIGINT, None, 0))\n"
        "time.sleep(0.3)\nprint('after', 'sent')"
    )
    assert not error and lines(text)["after"] == "sent", text  # the init reported: status ok
    assert "sandbox failed" not in text and "KeyboardInterrupt" not in text, text


def test_the_inits_limits_priority_and_scheduling_are_out_of_reach():
    code = (
        "class Limit(ctypes.Structure):\n    _fields_ = [('cur', ctypes.c_uint64), ('max', ctypes.c_uint64)]\n"
        "print('prlimit', libc.prlimit(1, 7, ctypes.byref(Limit(0, 0)), None), ctypes.get_errno())\n"
        "print('setpriority', libc.setpriority(0, 1, 19), ctypes.get_errno())\n"
        "print('setpriority_uid', libc.setpriority(2, 0, 19), ctypes.get_errno())\n"
        "print('ioprio', libc.syscall(251, 1, 1, 3 << 13), ctypes.get_errno())\n"
        "print('sched', libc.sched_setscheduler(1, 5, ctypes.byref(ctypes.c_int(0))), ctypes.get_errno())\n"
        "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\nos.nice(1)\n"
        "print('own', resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.getpriority(os.PRIO_PROCESS, 0))\n"
        "open('big', 'wb').write(b'x' * (2 << 20))"
    )  # past max_file_bytes: SIGXFSZ
    text, error = execute(code)
    got = lines(text)
    assert {k: got[k] for k in ("prlimit", "setpriority", "setpriority_uid", "ioprio", "sched")} == dict.fromkeys(
        ("prlimit", "setpriority", "setpriority_uid", "ioprio", "sched"), f"-1 {errno.EPERM}"
    ), text
    assert got["own"] == "32 1", text  # its own limits and priority: the code's to lower
    assert error and "[killed: output limit of 1048576 bytes exceeded]" in text, text  # the init checked the file


def test_syscalls_of_other_abis_are_killed_not_run():
    # int 0x80 (i386) and x32 numbers reach the kernel under another audit arch, where a filter
    # written for x86_64 would not look: libseccomp kills the process for a foreign arch.
    i386 = (
        "import mmap\nm = mmap.mmap(-1, 4096, prot=7)\nm.write(bytes.fromhex('b836010000bb00000010cd80c3'))\n"
        "run = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))\n"
        "print('unshare', run(), flush=True)\nprint(open('/proc/self/uid_map').read())"
    )  # unshare(CLONE_NEWUSER)
    x32 = "print('unshare', libc.syscall(0x40000000 + 272, 0x10000000), ctypes.get_errno(), flush=True)"
    for payload in (i386, x32):
        text, error = execute(payload)
        assert error and text == "[killed by a signal the sandbox did not send]", text


def test_the_inits_descriptors_cannot_be_taken():
    code = (
        "pidfd = libc.syscall(434, 1, 0)\nprint('pidfd_open', pidfd >= 0)\n"
        "print('getfd', sorted({libc.syscall(438, pidfd, fd, 0) + ctypes.get_errno() * 1000 for fd in range(3, 16)}))\n"
        "for fd in (3, 4, 5):\n    try:\n        open(f'/proc/1/fd/{fd}', 'wb')\n        print('opened', fd)\n"
        "    except OSError as err:\n        print(f'fd{fd}', err.errno)"
    )
    got = lines(execute(code)[0])
    assert got == {
        "pidfd_open": "True",
        "getfd": f"[{errno.EPERM * 1000 - 1}]",  # pidfd_getfd: EPERM for each
        **{f"fd{fd}": f"{errno.EACCES}" for fd in (3, 4, 5)},
    }, got  # the init is not dumpable


def test_real_time_scheduling_and_a_higher_priority_are_refused():
    code = (
        "try:\n    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))\n    print('fifo', 'set')\n"
        "except OSError as err:\n    print('fifo', err.errno)\n"
        "try:\n    os.nice(-5)\n    print('nice', 'raised')\nexcept OSError as err:\n    print('nice', err.errno)\n"
        "print('ioprio_rt', libc.syscall(251, 1, 0, 1 << 13), ctypes.get_errno())\n"
        "attr = (ctypes.c_uint32 * 12)(48, 6)\nattr[6], attr[8], attr[10] = 10 ** 6, 10 ** 7, 10 ** 8\n"
        "print('deadline', libc.syscall(314, 0, attr, 0), ctypes.get_errno())\n"  # sched_setattr(SCHED_DEADLINE)
        "print('mlockall', libc.mlockall(3), ctypes.get_errno())"
    )
    got = lines(execute(code)[0])
    assert got["fifo"] == got["nice"] == f"{errno.EPERM}", got
    assert got["ioprio_rt"] == got["deadline"] == f"-1 {errno.EPERM}", got
    assert got["mlockall"] in (f"-1 {errno.ENOMEM}", f"-1 {errno.EPERM}"), got  # RLIMIT_MEMLOCK: no pinned memory


def test_memfd_and_locked_memory_stop_at_the_sandboxs_memory():
    # memfd pages are shared memory, mapped after their descriptor is closed (so RLIMIT_NOFILE
    # does not stop them): the cgroup counts them, or the address-space limit refuses the maps.
    code = (
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
        "for held in range(3000):\n    fd = os.memfd_create('x')\n    os.ftruncate(fd, 1 << 20)\n"
        "    addr = libc.mmap(None, 1 << 20, 3, 1, fd, 0)\n    os.close(fd)\n"
        "    if addr in (None, ctypes.c_void_p(-1).value):\n        print('refused', held, flush=True)\n        break\n"
        "    ctypes.memset(addr, 1, 1 << 20)\nprint('held', held)"
    )
    text, error = execute(code)
    limits = SandboxLimits()
    if isolation().cgroup:
        assert error and text.endswith(f"[killed: memory limit of {limits.memory_mb} MiB exceeded]"), text
    else:
        assert int(lines(text)["refused"]) < limits.memory_mb, text


def test_descriptors_in_flight_on_a_unix_socket_are_bounded():
    code = (
        "import array, socket\na, b = socket.socketpair()\nsent = 0\ntry:\n    while sent < 100000:\n"
        "        a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [a.fileno()] * 200))])\n"
        "        sent += 1\nexcept OSError as err:\n    print('stopped', sent, err.errno)"
    )
    sent, err = lines(execute(code)[0])["stopped"].split()
    assert int(sent) < 64 and int(err) in (errno.ETOOMANYREFS, errno.EAGAIN), (sent, err)


def test_netlink_vsock_packet_and_inet_sockets_are_refused():
    # AF_VSOCK would reach the hypervisor's host of a VM like this one, AF_NETLINK the kernel's
    # routing and audit interfaces, AF_PACKET raw frames: the filter leaves AF_UNIX alone.
    code = (
        "import socket\nfor family, kind in ((40, socket.SOCK_STREAM), (16, socket.SOCK_RAW), (17, socket.SOCK_RAW),"
        " (2, socket.SOCK_DGRAM), (10, socket.SOCK_STREAM)):\n    try:\n        socket.socket(family, kind)\n"
        "        print(family, 'opened')\n    except OSError as err:\n        print(family, err.errno)"
    )
    assert lines(execute(code)[0]) == dict.fromkeys(("40", "16", "17", "2", "10"), f"{errno.EPERM}")


def test_extended_attributes_count_against_the_working_directorys_quota():
    code = (
        "total = 0\nfor i in range(1000):\n    open(f'f{i}', 'w').close()\n    try:\n        for j in range(1000):\n"
        "            os.setxattr(f'f{i}', f'user.k{j}', b'x' * 4000)\n            total += 4000\n"
        "    except OSError as err:\n        if j == 0:\n            print('stopped', total, err.errno)\n"
        "            break"
    )
    text, _ = execute(code)
    total, err = map(int, lines(text)["stopped"].split())
    assert total < SandboxLimits().max_disk_bytes and err == errno.ENOSPC, text  # kernel memory, bounded


def test_an_abstract_unix_socket_of_the_host_is_unreachable():
    name = f"\0mrl-attack-{os.getpid()}".encode()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen()
        listener.settimeout(0.2)
        text, _ = execute(
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({name!r})\n"
            "    print('connected', 'yes')\nexcept OSError as err:\n    print('refused', err.errno)"
        )
        assert lines(text) == {"refused": f"{errno.ECONNREFUSED}"}, text  # the sandbox's network namespace's own
        with pytest.raises(socket.timeout):
            listener.accept()


def test_the_inits_root_cwd_environment_and_memory_are_closed():
    code = (
        "for path in ('/proc/1/root/proc/1/root', '/proc/1/cwd', '/proc/1/environ', '/proc/1/mem', "
        "'/proc/1/map_files', '/proc/1/fd'):\n    try:\n        os.listdir(path) if os.path.isdir(path) else "
        "open(path, 'rb').read(1)\n        print(path, 'read')\n    except OSError as err:\n        print(path, err.errno)"
    )
    got = lines(execute(code)[0])
    assert len(got) == 6 and set(got.values()) == {f"{errno.EACCES}"}, got


def test_raw_clone_into_new_namespaces_is_refused():
    code = (
        "print('clone_newuser', libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"
        "print('clone_newns_vm', libc.syscall(56, 0x20000 | 0x100 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"
        "print('thread_newpid', libc.syscall(56, 0x10000 | 0x800 | 0x100 | 0x20000000, 0, 0, 0, 0), ctypes.get_errno())"
    )
    got = lines(execute(code)[0])
    assert got == {
        "clone_newuser": f"-1 {errno.EPERM}",
        "clone_newns_vm": f"-1 {errno.EPERM}",
        "thread_newpid": f"-1 {errno.EINVAL}",
    }, got  # a thread cannot take a new namespace


def test_the_audit_hook_found_through_gc_falls_but_the_walls_hold(tmp_path):
    # The hook skips its checks while its closure's ``busy`` list is not empty: filling it turns
    # the hook off without a sub-interpreter. ctypes then loads; the kernel still refuses.
    host_file = tmp_path / "host-secret"
    host_file.write_text(SECRET)
    code = (
        "import gc\nfor f in gc.get_objects():\n    if getattr(f, '__name__', '') == 'hook' and f.__closure__:\n"
        "        for cell in f.__closure__:\n            if isinstance(cell.cell_contents, list):\n"
        "                cell.cell_contents.append(1)\n"
        "import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\nprint('ctypes', 'loaded')\n"
        f"try:\n    print('read', open({str(host_file)!r}).read())\nexcept OSError as err:\n    print('read', err.errno)\n"
        "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\nexcept OSError as err:\n"
        "    print('connect', err.errno)\ntry:\n    os.fork()\nexcept OSError as err:\n    print('fork', err.errno)"
    )
    got = lines(execute(code, bypass=False)[0])
    assert got == {
        "ctypes": "loaded",
        "read": f"{errno.ENOENT}",
        "connect": f"{errno.EPERM}",
        "fork": f"{errno.EPERM}",
    }, got
