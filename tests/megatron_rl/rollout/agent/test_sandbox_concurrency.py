"""A hundred concurrent malicious calls of the code sandbox (issue 27), judged from the host side: the
caller and its other children stay alive, its memory holds only the output caps, every call ends with
the status its attack earns, and nothing is left running, mounted or on disk."""

from __future__ import annotations

import glob
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from megatron_rl.rollout.tools import sandbox
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation, run_python

pytestmark = pytest.mark.skipif(
    not (isolation().minimal_root and isolation().seccomp), reason="needs user namespaces and libseccomp"
)


def test_a_hundred_concurrent_malicious_calls_leave_the_caller_alone(tmp_path):
    codes = [
        "import os\nwhile True: os.fork()",
        "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    os.kill(os.getpid(), 9)",
        "import os\nwhile True: os.write(1, b'x' * 65536)",
        "x = [bytearray(1 << 24) for _ in range(1000)]",
        "n = 0\nwhile True:\n    open(f'f{n}', 'wb').write(b'x' * 100_000); n += 1",
        f"open({str(tmp_path / 'm')!r}, 'w')",
        "import time\ntime.sleep(60)",
        "print(6 * 7)",
    ]
    limits = SandboxLimits(wall_seconds=20, cpu_seconds=2, memory_mb=128, max_disk_bytes=1 << 20)
    before = set(glob.glob("/tmp/mrl-sandbox-*"))
    cgroups = {
        d for base, _ in sandbox._cgroup_roots().values() for d in glob.glob(os.path.join(base, "mrl-sandbox-*"))
    }
    earlier = {c.pid for c in psutil.Process().children(recursive=True)}
    victim = subprocess.Popen(["sleep", "120"])  # a host process of the caller's that kill(-1) would take
    rss, started = psutil.Process().memory_info().rss, time.time()
    try:
        with ThreadPoolExecutor(100) as pool:
            results = list(
                pool.map(lambda i: run_python(codes[i % len(codes)], limits, python_guards=False), range(100))
            )
        assert victim.poll() is None  # the caller's child lives on (and the caller runs this line)
    finally:
        victim.kill()
        victim.wait()
    assert psutil.Process().memory_info().rss - rss < 256 << 20  # 100 x 64 KiB output caps, not 100 bombs
    statuses = [r.status for r in results]
    expected = [
        "error",
        "killed",
        "output_limit",
        "memory_limit" if "memory" in isolation().cgroup else "error",
        "disk_limit",
        "error",
        "timeout",
        "ok",
    ]
    assert [set(statuses[i :: len(codes)]) for i in range(len(codes))] == [{s} for s in expected], statuses
    assert all(r.stdout == "42\n" for r in results[7 :: len(codes)])
    assert not (tmp_path / "m").exists()
    deadline = time.monotonic() + 5  # the kernel tears the PID namespaces down asynchronously
    while True:
        left = [
            c.pid
            for c in psutil.Process().children(recursive=True)
            if c.pid not in earlier and c.status() != psutil.STATUS_ZOMBIE
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == []
    # Nor anywhere else on the host (a process the caller lost would be re-parented away from it).
    strays = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        if (
            proc.info["create_time"]
            and proc.info["create_time"] >= started - 1
            and sandbox.RUNNER in (proc.info["cmdline"] or [])
        ):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    strays.append(proc.pid)
            except psutil.NoSuchProcess:
                pass
    assert strays == []
    assert set(glob.glob("/tmp/mrl-sandbox-*")) <= before  # no directory; no tmpfs on the caller's side:
    assert "mrl-sandbox-" not in open("/proc/self/mountinfo").read()
    assert {
        d for base, _ in sandbox._cgroup_roots().values() for d in glob.glob(os.path.join(base, "mrl-sandbox-*"))
    } == cgroups
