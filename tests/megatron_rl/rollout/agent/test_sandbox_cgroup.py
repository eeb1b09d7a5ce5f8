"""An unprivileged trainer with a delegated cgroup subtree (issue 27): the sandbox bounds each run
as a whole there too, as it does for root.

A delegated subtree is a cgroup directory the trainer's user owns (with its ``cgroup.procs``), the
trainer running inside it: it may make a child per run, write the child's limits and move its
own runner there. This machine has cgroup v1 hierarchies for memory, pids and cpu (its v2
hierarchy holds only hugetlb), so the delegation run for real is v1's; for v2 (``Delegate=yes`` under
systemd, SLURM's cgroup/v2) the choice of where each run's cgroup goes (``sandbox.v2_run_parent``) is
tested on directory trees laid out as the kernel's, and the kernel's own part is not exercised.
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


# cgroup v2 (this machine's v2 hierarchy holds only hugetlb): where each run's cgroup goes, read off a
# directory tree laid out as the kernel's cgroup files are. The kernel's own part (mkdir, moving the
# runner into a sibling, the limits) is not exercised here.
def _v2_tree(root, dirs: dict) -> None:
    for rel, files in dirs.items():
        path = root / rel
        path.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (path / name).write_text(text)


_SLURM = {  # cgroup/v2: the step's user cgroup enables the controllers for its task_<n> leaves
    "": {"cgroup.subtree_control": "cpu memory pids", "cgroup.procs": ""},
    "job_7/step_0/user": {"cgroup.subtree_control": "cpu memory pids", "cgroup.procs": ""},
    "job_7/step_0/user/task_0": {
        "cgroup.subtree_control": "",
        "cgroup.procs": "123\n",
        "memory.max": "max\n",
        "memory.high": "max\n",
        "pids.max": "max\n",
        "cpu.max": "max 100000\n",
    },
}


def test_v2_a_leaf_with_no_limits_of_its_own_puts_the_runs_beside_it(tmp_path):
    _v2_tree(tmp_path, _SLURM)
    own = str(tmp_path / "job_7/step_0/user/task_0")
    assert sandbox.v2_run_parent(own, str(tmp_path)) == (str(tmp_path / "job_7/step_0/user"), ["memory", "pids", "cpu"])


def test_v2_a_cgroup_that_enables_controllers_takes_the_runs_itself(tmp_path):
    _v2_tree(tmp_path, _SLURM)  # the hierarchy's root: it may hold processes and enable controllers
    assert sandbox.v2_run_parent(str(tmp_path), str(tmp_path)) == (str(tmp_path), ["memory", "pids", "cpu"])


@pytest.mark.parametrize("limit", ["memory.max", "memory.high", "pids.max", "cpu.max"])
def test_v2_no_run_goes_beside_a_cgroup_with_a_limit_of_its_own(tmp_path, limit):
    # a systemd service's MemoryMax= on its own cgroup: runs beside it would escape it
    _v2_tree(
        tmp_path, {**_SLURM, "job_7/step_0/user/task_0": {**_SLURM["job_7/step_0/user/task_0"], limit: "1000 100000"}}
    )
    assert sandbox.v2_run_parent(str(tmp_path / "job_7/step_0/user/task_0"), str(tmp_path)) is None


def test_v2_no_run_goes_where_the_parent_enables_nothing_or_cannot_be_written(tmp_path):
    tree = {**_SLURM, "job_7/step_0/user": {"cgroup.subtree_control": "", "cgroup.procs": ""}}
    _v2_tree(tmp_path, tree)
    own = str(tmp_path / "job_7/step_0/user/task_0")
    assert sandbox.v2_run_parent(own, str(tmp_path)) is None  # nothing enabled for children
    (tmp_path / "job_7/step_0/user/cgroup.subtree_control").write_text("memory pids")
    (tmp_path / "job_7/step_0/user/cgroup.procs").unlink()  # no cgroup.procs this process may write
    assert sandbox.v2_run_parent(own, str(tmp_path)) is None
    bare = tmp_path / "container"  # a container's own root (cgroupns), its processes in it: nothing above
    _v2_tree(bare, {"": {"cgroup.subtree_control": "", "cgroup.procs": "1\n"}})
    assert sandbox.v2_run_parent(str(bare), str(bare)) is None
