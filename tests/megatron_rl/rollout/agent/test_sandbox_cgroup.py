"""An unprivileged trainer with a delegated cgroup subtree (issue 27): the sandbox bounds each run
as a whole there too, as it does for root.

A delegated subtree is a cgroup directory the trainer's user owns (with its ``cgroup.procs``), the
trainer running inside it: it may make a child per run, write the child's limits and move its
own runner there. This machine has cgroup v1 hierarchies for memory, pids and cpu (its v2
hierarchy holds only hugetlb), so the delegation tested is v1's; v2's (``Delegate=yes`` under
systemd) cannot be made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from megatron_rl.rollout.tools import sandbox
from megatron_rl.rollout.tools.sandbox import isolation

from .rootless import ROOTLESS_CALLER

_NOBODY = 65534
_CHILD = """
import glob, json, os, sys
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation, run_python
def run(code, **limits):
    r = run_python(code, SandboxLimits(**limits), python_guards=False)
    return [r.status, r.stdout, r.stderr[-300:]]
threads = ("import threading, time\\nstarted = 0\\ntry:\\n    while True:\\n"
           "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start(); started += 1\\n"
           "except RuntimeError:\\n    print(started)")
print(json.dumps({"uid": os.getuid(), "cgroup": sorted(isolation().cgroup),
    "memory": run("x = [bytearray(1 << 24) for _ in range(100)]", memory_mb=128),
    "threads": run(threads, max_processes=8),
    "ok": run("print(6 * 7)"),
    "left": [p for d in sys.argv[1:] for p in glob.glob(os.path.join(d, "mrl-sandbox-*"))]}))
"""


def _delegate(name: str) -> list[str]:
    """As root: a directory per cgroup hierarchy of this process, owned by host nobody."""
    made = []
    for base, _ in dict.fromkeys(sandbox._cgroup_roots().values()):
        path = os.path.join(base, name)
        os.mkdir(path)
        made.append(path)
        for entry in (path, *(os.path.join(path, f) for f in ("cgroup.procs", "tasks", "cgroup.subtree_control"))):
            if os.path.exists(entry):
                os.chown(entry, _NOBODY, _NOBODY)
    return made


def _remove(paths: list[str]) -> None:
    for path in paths:
        deadline = time.monotonic() + 10
        while os.path.exists(path):
            try:
                os.rmdir(path)
            except OSError:  # the caller's last task still leaving
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@pytest.mark.skipif(
    os.geteuid() != 0
    or set(isolation().cgroup) != {"memory", "pids", "cpu"}
    or any(v2 for _, v2 in sandbox._cgroup_roots().values()),
    reason="needs root to delegate cgroup v1 hierarchies of memory, pids and cpu",
)
def test_a_delegated_cgroup_bounds_an_unprivileged_callers_runs_as_a_whole():
    import megatron_rl

    project = os.path.dirname(os.path.dirname(megatron_rl.__file__))
    delegated = _delegate(f"mrl-delegated-{os.getpid()}")
    home = tempfile.mkdtemp(prefix="mrl-nobody-")

    def join():  # in the child, still root: the trainer starts inside its delegated cgroups
        for path in delegated:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    try:
        os.chown(home, _NOBODY, _NOBODY)
        out = subprocess.run(
            [sys.executable, "-c", ROOTLESS_CALLER, project, home, "-c", _CHILD, *delegated],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=join,
        )
    finally:
        subprocess.run(["rm", "-rf", home], check=True)
        _remove(delegated)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["uid"] == _NOBODY and got["cgroup"] == ["cpu", "memory", "pids"], got
    assert got["memory"][0] == "memory_limit", got["memory"]  # the cgroup's OOM count, not a MemoryError
    assert got["threads"][:2] == ["ok", f"{8 - 3}\n"], got["threads"]  # the runner's three count too
    assert got["ok"][:2] == ["ok", "42\n"] and got["left"] == [], got  # every run's cgroup removed
