"""The sandboxed code tool: every limit holds, and nothing escapes or stays behind.

Where this machine lets ``unshare`` create namespaces, each check also runs with the in-process
audit hook off (``python_guards=False``): the kernel-side isolation (network, PID and read-only
mount namespaces) holds on its own.
"""

from __future__ import annotations

import glob
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from megatron_rl.rollout.tools.code_tool import CodeInterpreterTool
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation, run_python

GUARDS = [True, False] if isolation().network_namespace else [True]


def test_infinite_loop_is_killed_at_the_wall_limit():
    res = run_python("import time\nwhile True: time.sleep(0.01)", SandboxLimits(wall_seconds=1.0, cpu_seconds=30))
    assert res.status == "timeout" and res.exit_code is None
    assert 1.0 <= res.seconds < 4.0
    assert res.observation(SandboxLimits(wall_seconds=1.0)).endswith("[killed: wall-time limit of 1 s exceeded]")


def test_busy_loop_is_killed_at_the_cpu_limit():
    res = run_python("while True: pass", SandboxLimits(wall_seconds=20, cpu_seconds=1))
    assert res.status == "cpu_limit", res


CGROUP_MEMORY = "memory" in isolation().cgroup


@pytest.mark.skipif(not CGROUP_MEMORY, reason="memory_limit is read from a cgroup's OOM count")
def test_memory_bomb_is_stopped_at_the_memory_limit():
    limits = SandboxLimits(memory_mb=128)
    res = run_python("blocks = []\nwhile True: blocks.append(bytearray(16 << 20))", limits)
    assert (res.status, res.exit_code) == ("memory_limit", -9), res
    assert res.observation(limits).endswith("[killed: memory limit of 128 MiB exceeded]")
    assert run_python("x = bytearray(64 << 20); print(len(x))", SandboxLimits(memory_mb=256)).stdout == f"{64 << 20}\n"


def test_a_memory_error_or_exit_86_the_code_chose_is_no_memory_limit():
    # Issue 27: os._exit(86) was reported as memory_limit. Only the cgroup's OOM count says so now.
    assert run_python("import os\nos._exit(86)").status == "error"
    res = run_python("raise MemoryError")
    assert res.status == "error" and "MemoryError" in res.stderr


@pytest.mark.skipif(CGROUP_MEMORY, reason="without a cgroup the address-space limit raises MemoryError")
def test_without_a_cgroup_a_memory_bomb_is_an_error_with_a_memory_error():
    res = run_python("blocks = []\nwhile True: blocks.append(bytearray(16 << 20))", SandboxLimits(memory_mb=128))
    assert res.status == "error" and "MemoryError" in res.stderr


def test_output_is_truncated_and_bounded():
    res = run_python("print('y' * 100000)", SandboxLimits(max_output_bytes=1000))
    assert res.ok and res.truncated and res.stdout == "y" * 1000
    res = run_python("import sys\nwhile True: sys.stdout.write('z' * 65536)", SandboxLimits(max_file_bytes=1 << 20))
    assert res.status == "output_limit"


@pytest.mark.parametrize("guards", GUARDS)
def test_writes_outside_the_working_dir_fail(guards, tmp_path):
    target = tmp_path / "escape.txt"
    code = (
        f"open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())\n"
        f"open({str(target)!r}, 'w').write('escaped')"
    )
    res = run_python(code, python_guards=guards)
    assert res.status == "error" and res.stdout == "ok\n"
    # Without the hook: the host's directory is not in the sandbox's root at all.
    assert any(
        m in res.stderr for m in (("PermissionError: sandbox: writing",) if guards else ("No such file or directory",))
    )
    assert not target.exists()
    for path in ("/tmp/mrl_escape.txt", "/dev/shm/mrl_escape.txt"):
        assert run_python(f"open({path!r}, 'w').write('x')", python_guards=guards).status == "error"
        assert not glob.glob(path)


@pytest.mark.parametrize("guards", GUARDS)
def test_socket_connect_fails(guards):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = (
            f"import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
        )
        res = run_python(code, python_guards=guards)
        assert res.status == "error" and "connected" not in res.stdout
        if isolation().network_namespace:  # seccomp refuses AF_INET; else no interface is up in the namespace
            assert any(
                m in res.stderr
                for m in ("Operation not permitted", "Network is unreachable", "network access is not allowed")
            )
    finally:
        server.close()
    res = run_python("import socket\nsocket.socket(socket.AF_UNIX).connect('/tmp/ray/session_latest/sockets/raylet')")
    assert "PermissionError: sandbox: network access is not allowed" in res.stderr


def test_processes_cannot_be_started_and_none_stay_behind():
    res = run_python("import os\nos.fork()")
    assert "PermissionError: sandbox: os.fork is not allowed" in res.stderr
    res = run_python("import subprocess\nsubprocess.run(['sleep', '60'])")
    assert "PermissionError: sandbox: subprocess.Popen is not allowed" in res.stderr


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_hundred_concurrent_calls_leave_no_process_or_directory():
    codes = ["import time\ntime.sleep(60)", "while True: pass", "print(sum(range(10**5)))", "x = bytearray(1 << 31)"]
    limits = SandboxLimits(wall_seconds=20, cpu_seconds=2, memory_mb=128)  # 100 interpreters start on 2 cores
    before = set(glob.glob("/tmp/mrl-sandbox-*"))
    earlier = {c.pid for c in psutil.Process().children(recursive=True)}  # e.g. an engine other tests keep
    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(lambda i: run_python(codes[i % 4], limits), range(100)))
    statuses = [r.status for r in results]
    assert statuses[2::4] == ["ok"] * 25 and all(r.stdout == f"{sum(range(10**5))}\n" for r in results[2::4])
    assert set(statuses[0::4]) == {"timeout"} and set(statuses[3::4]) == {"memory_limit"}
    assert set(statuses[1::4]) <= {"timeout", "cpu_limit"}
    # The kernel tears a PID namespace down asynchronously once its init is killed: allow it 5 s.
    deadline = time.monotonic() + 5
    while True:
        left = [
            (p.pid, p.info["cmdline"])
            for p in psutil.process_iter(["cmdline"])
            if any("sandbox_runner" in c for c in p.info["cmdline"] or [])
        ]
        left += [
            (c.pid, c.name()) for c in psutil.Process().children(recursive=True) if c.pid not in earlier and _alive(c)
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == []
    assert set(glob.glob("/tmp/mrl-sandbox-*")) <= before  # <=: a concurrent run elsewhere may end meanwhile
    assert threading.active_count() < 10


def test_code_tool_observation():
    tool = CodeInterpreterTool({"type": "native", "wall_seconds": 5, "memory_mb": 256})
    out = tool.execute("id", {"code": "print(48213 * 9174)"})
    assert (out.text, out.error) == (f"{48213 * 9174}\n", False)
    out = tool.execute("id", {"code": "1/0"})
    assert out.error and "ZeroDivisionError: division by zero" in out.text and out.text.endswith("[exit code 1]")
    with pytest.raises(ValueError, match=r"code tool config has unknown key\(s\) \['wall'\]"):
        CodeInterpreterTool({"wall": 1})


# Attacks from issue 27 that the pipes close: the caller reads no file the code can replace.
@pytest.mark.parametrize("guards", GUARDS)
def test_stdout_replaced_by_a_symlink_to_environ_leaks_nothing(guards, monkeypatch):
    monkeypatch.setenv("MRL_TEST_SECRET", "s3cr3t-token-27")
    code = (
        "import os\nfor n in ('.stdout', '.stderr'):\n"
        "    try: os.remove(n)\n    except OSError: pass\n"
        "    os.symlink('/proc/self/environ', n)\nprint('done')"
    )
    res = run_python(code, python_guards=guards)
    assert "s3cr3t-token-27" not in res.stdout + res.stderr


@pytest.mark.parametrize("guards", GUARDS)
def test_stdout_replaced_by_a_fifo_does_not_hang_the_caller(guards):
    code = (
        "import os\nfor n in ('.stdout', '.stderr'):\n"
        "    try: os.remove(n)\n    except OSError: pass\n"
        "    os.mkfifo(n)\nprint('done')"
    )
    start = time.monotonic()
    res = run_python(code, SandboxLimits(wall_seconds=5), python_guards=guards)
    assert time.monotonic() - start < 5 + 2
    assert res.status in ("ok", "error")


def test_output_printed_before_os_exit_is_returned_and_the_exit_code_is_not_a_limit():
    res = run_python("import os\nprint('before exit')\nos._exit(3)")
    assert res.stdout == "before exit\n"
    assert (res.status, res.exit_code) == ("error", 3)


def test_a_child_holding_the_pipes_cannot_outlive_the_wall_limit():
    limits = SandboxLimits(wall_seconds=3)
    start = time.monotonic()
    res = run_python("import time\nprint('x', flush=True)\ntime.sleep(60)", limits)
    assert time.monotonic() - start < 3 + 2
    assert (res.status, res.stdout) == ("timeout", "x\n")


@pytest.mark.skipif(not isolation().network_namespace, reason="needs namespaces from unshare")
def test_after_umount_proc_the_callers_environ_and_memory_stay_closed(monkeypatch):
    # Issue 27: the code unmounts its own /proc to see the host's, then goes for the caller.
    monkeypatch.setenv("MRL_TEST_SECRET", "s3cr3t-token-27")
    code = (
        f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint('umount', libc.umount2(b'/proc', 2))\n"
        f"for name in ('environ', 'mem'):\n"
        f"    try:\n        print(name, open('/proc/{os.getpid()}/' + name, 'rb').read(4096))\n"
        f"    except OSError as err:\n        print(name, 'refused', err.errno)\n"
        f"print('remount', libc.mount(None, b'/', None, 32, None))"
    )  # MS_REMOUNT, read-write
    res = run_python(code, python_guards=False)
    assert "s3cr3t-token-27" not in res.stdout + res.stderr
    # No capability is left to umount (-1); /proc is the sandbox's own, where the caller's pid is
    # absent (ENOENT), and with the old, capable, root it was closed by the user namespace (EACCES).
    assert "umount -1" in res.stdout and "remount -1" in res.stdout
    assert all(any(f"{name} refused {errno}" in res.stdout for errno in (2, 13)) for name in ("environ", "mem"))


@pytest.mark.skipif(not isolation().network_namespace, reason="needs namespaces from unshare")
def test_a_block_device_node_cannot_be_made():
    code = (
        "import os, stat\ntry:\n    os.mknod('loop', stat.S_IFBLK | 0o600, os.makedev(7, 0))\n    print('made')\n"
        "except OSError as err:\n    print('refused', err.errno)"
    )
    res = run_python(code, python_guards=False)
    assert res.stdout == "refused 1\n"  # EPERM: no CAP_MKNOD over the host in a user namespace


NAMESPACED = pytest.mark.skipif(not isolation().network_namespace, reason="needs user namespaces")


@NAMESPACED
def test_no_capability_and_no_new_privileges_inside():
    res = run_python(
        "print(''.join(l for l in open('/proc/self/status') if l.startswith(('Cap', 'NoNewPrivs'))))",
        python_guards=False,
    )
    fields = dict(line.split(":\t") for line in res.stdout.split("\n") if ":\t" in line)
    assert {k: fields[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == dict.fromkeys(
        ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), "0000000000000000"
    )
    assert fields["NoNewPrivs"] == "1"


@NAMESPACED
@pytest.mark.skipif(os.geteuid() != 0, reason="the mapping to nobody is made by a root caller")
def test_a_host_file_is_out_of_reach_and_root_inside_is_host_nobody(tmp_path):
    # Root inside is host nobody, and a host file, even one anybody may write, is not in its root.
    victim = tmp_path / "victim"
    victim.write_text("root's")
    victim.chmod(0o644)
    tmp_path.chmod(0o777)
    code = (
        f"import os\nprint(os.getuid(), open('/proc/self/uid_map').read().split())\n"
        f"try:\n    open({str(victim)!r}, 'a').write('pwned')\nexcept OSError as err:\n    print('refused', err.errno)\n"
        f"try:\n    os.setresuid(1, 1, 1)\nexcept OSError as err:\n    print('setuid refused', err.errno)"
    )
    res = run_python(code, python_guards=False)
    assert res.stdout.splitlines()[0] == "0 ['0', '65534', '1']"  # root inside is host nobody
    assert "refused 2" in res.stdout  # ENOENT: the host's /tmp is not the sandbox's
    assert "setuid refused" in res.stdout and victim.read_text() == "root's"


@NAMESPACED
@pytest.mark.skipif(os.geteuid() != 0, reason="/root is hidden by a root caller's sandbox")
def test_root_home_is_hidden_but_the_interpreter_works():
    res = run_python("import os, json\nprint(sorted(os.listdir('/root')))", python_guards=False)
    import sys

    expected = [sys.base_prefix.split("/")[2]] if sys.base_prefix.startswith("/root/") else []
    assert (res.status, res.stdout) == ("ok", f"{expected}\n"), res


@pytest.mark.skipif(not isolation().seccomp, reason="needs libseccomp")
def test_seccomp_refuses_processes_sockets_and_kernel_interfaces_but_not_threads():
    # Each attempt straight at the kernel (no audit hook): EPERM (1) from the filter.
    code = (
        "import ctypes, os, socket, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "t = threading.Thread(target=print, args=('thread ok',)); t.start(); t.join()\n"
        "def sys_(name, *args):\n    n = {'ptrace': 101, 'unshare': 272, 'io_uring_setup': 425, 'userfaultfd': 323,"
        " 'setns': 308, 'bpf': 321, 'keyctl': 250}[name]\n"
        "    return libc.syscall(n, *args), ctypes.get_errno()\n"
        "for name in ('ptrace', 'unshare', 'io_uring_setup', 'userfaultfd', 'setns', 'bpf', 'keyctl'):\n"
        "    print(name, *sys_(name, 0, 0))\n"
        "for name, call in (('fork', os.fork), ('inet', socket.socket), ('exec', lambda: os.execv('/bin/true', ['true']))):\n"
        "    try:\n        call(); print(name, 'allowed')\n    except OSError as err:\n        print(name, 'refused', err.errno)\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')][0])"
    )
    res = run_python(code, python_guards=False)
    lines = res.stdout.splitlines()
    assert lines[0] == "thread ok", res
    assert lines[1:8] == [
        f"{n} -1 1" for n in ("ptrace", "unshare", "io_uring_setup", "userfaultfd", "setns", "bpf", "keyctl")
    ]
    assert lines[8:] == ["fork refused 1", "inet refused 1", "exec refused 1", "2"]


def test_a_sigkill_is_cpu_limit_only_when_the_cpu_seconds_were_used():
    # Issue 27: any SIGKILL was reported as cpu_limit. Now decided from the tree's CPU seconds.
    res = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", python_guards=False)
    assert res.status == "killed" and "[killed by a signal the sandbox did not send]" in res.observation(
        SandboxLimits()
    )
    res = run_python(
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass",
        SandboxLimits(wall_seconds=20, cpu_seconds=1),
        python_guards=False,
    )
    assert res.status == "cpu_limit"  # SIGXCPU ignored: the hard limit's SIGKILL at 2 s of CPU


def test_code_tool_refuses_an_unisolated_sandbox_unless_allowed(monkeypatch):
    from megatron_rl.rollout.tools import code_tool
    from megatron_rl.rollout.tools.sandbox import Isolation

    monkeypatch.setattr(code_tool, "isolation", lambda: Isolation(False, False, False, None))
    with pytest.raises(RuntimeError, match="no user namespace and no seccomp filter.*allow_unisolated: true"):
        CodeInterpreterTool({})
    with pytest.warns(RuntimeWarning, match="allow_unisolated is set"):
        tool = CodeInterpreterTool({"allow_unisolated": True})
    assert tool.limits == SandboxLimits()


@NAMESPACED
def test_the_working_dir_is_a_tmpfs_with_a_byte_and_a_file_quota():
    # Issue 27: 2 GB in files just under the per-file limit, or 150,000 files, had no total bound.
    limits = SandboxLimits(max_disk_bytes=4 << 20, max_files=64, max_file_bytes=1 << 20)
    code = (
        "import os\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'x' * 500_000); n += 1\n"
        "except OSError as err:\n    print('bytes stopped', n, err.errno)\nfor f in os.listdir('.'): os.remove(f)\n"
        "m = 0\ntry:\n    while True:\n        open(f'e{m}', 'w').close(); m += 1\nexcept OSError as err:\n"
        "    print('files stopped', m, err.errno)"
    )
    res = run_python(code, limits, python_guards=False)
    lines = res.stdout.splitlines()
    assert lines[0].startswith("bytes stopped") and int(lines[0].split()[2]) <= 8 and lines[0].endswith(" 28"), res
    assert lines[1].startswith("files stopped") and int(lines[1].split()[2]) < 64 and lines[1].endswith(" 28")
    # The init (not the code) found the tmpfs full when the code ended: disk_limit, whatever the exit code.
    assert res.status == "disk_limit" and res.observation(limits).endswith(
        f"[disk quota of the working directory ({4 << 20} bytes, 64 files) filled]"
    )
    assert run_python("open('a', 'wb').write(b'x' * 1000); print('fine')", limits, python_guards=False).ok


def test_the_probe_finds_the_isolation_this_machine_offers():
    """Where ``unshare`` makes the namespaces and libseccomp is here, ``isolation()`` must find
    the full sandbox: a runner that breaks would otherwise fall back to a process group and the
    escape tests (which need the full sandbox) would skip instead of failing."""
    import shutil
    import subprocess
    from ctypes.util import find_library

    unshare = shutil.which("unshare")
    if (
        unshare is None
        or find_library("seccomp") is None
        or subprocess.run(
            [unshare, "--user", "--map-root-user", "--net", "--pid", "--mount", "--fork", "true"]
        ).returncode
    ):
        pytest.skip("this machine offers no user namespaces or no libseccomp")
    iso = isolation()
    assert iso.minimal_root and iso.pid_namespace and iso.network_namespace and iso.seccomp, iso
