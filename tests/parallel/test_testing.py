"""parallel.testing.run_distributed: results by rank, failures and hangs surface as DistributedTestError."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from parallel.testing import DistributedTestError, run_distributed


# Rank functions live at module level: ranks are started with ``spawn`` and import them.
def _sum_ranks(rank: int, world_size: int, offset: float) -> tuple:
    x = torch.tensor([float(rank) + offset])
    dist.all_reduce(x)  # a real gloo collective across the spawned ranks
    return rank, world_size, dist.get_backend(), x.item()


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"bad input on rank {rank}")
    return rank


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


def _exit_silently_on_rank_1(rank: int, world_size: int, code: int) -> int:
    if rank == 1:
        os._exit(code)  # dies without reporting, like a segfaulting extension or a stray exit()
    return rank


def test_returns_results_in_rank_order_after_a_collective():
    results = run_distributed(_sum_ranks, 2, 0.5)
    # all_reduce of (0 + 0.5) + (1 + 0.5) = 2.0 on both ranks
    assert results == [(0, 2, "gloo", 2.0), (1, 2, "gloo", 2.0)]


def test_raising_rank_surfaces_with_rank_number_and_traceback():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, 2, timeout_s=120)
    message = str(info.value)
    assert message.startswith("_raise_on_rank_1 failed on rank 1 of 2:\nTraceback")
    assert "ValueError: bad input on rank 1" in message
    assert "in _raise_on_rank_1" in message  # the rank's own traceback, not the parent's


def test_hanging_rank_times_out_within_the_limit():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_1, 2, timeout_s=4)
    elapsed = time.monotonic() - start
    # Rank 0 may or may not have finished within 4 s on a loaded machine; rank 1 never does.
    pattern = r"_hang_on_rank_1 timed out after 4 s on 2 ranks; ranks that finished: \[(0)?\]"
    assert re.fullmatch(pattern, str(info.value))
    # 4 s limit + process start/kill; far below the 120 s the rank would sleep.
    assert elapsed < 4 + 30, elapsed


@pytest.mark.parametrize("code", [3, 0])
def test_rank_that_dies_without_report_is_named_with_exit_code(code):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_silently_on_rank_1, 2, code, timeout_s=60)
    assert str(info.value) == f"_exit_silently_on_rank_1: ranks died without a report, exit codes {{1: {code}}}"
    assert time.monotonic() - start < 40  # detected from the exit code, not by waiting for the timeout


def test_rejects_bad_arguments_before_spawning():
    with pytest.raises(ValueError, match=r"^world_size=0 must be >= 1$"):
        run_distributed(_sum_ranks, 0, 0.0)
    with pytest.raises(ValueError, match=r"^backend='mpi' is not allowed; choose 'gloo' or 'nccl'$"):
        run_distributed(_sum_ranks, 2, 0.0, backend="mpi")


def _start_grandchild_then_fail(rank: int, world_size: int, pid_file: str) -> int:
    import subprocess

    child = subprocess.Popen(["sleep", "300"])  # something the rank started, e.g. a server
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    raise RuntimeError("rank fails with a child still running")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped by its parent
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_dead(pids, within_s: float = 15.0) -> list[int]:
    end = time.monotonic() + within_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_a_failing_one_rank_run_leaves_no_rank_and_no_child_of_a_rank(tmp_path):
    pid_file = tmp_path / "pids"
    with pytest.raises(DistributedTestError, match="rank fails with a child still running"):
        run_distributed(_start_grandchild_then_fail, 1, str(pid_file), timeout_s=120)
    rank_pid, child_pid = map(int, pid_file.read_text().split())
    assert _wait_dead([rank_pid, child_pid]) == []


def _write_pid_then_hang_on_rank_1(rank: int, world_size: int, pid_file: str) -> int:
    with open(f"{pid_file}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(300)
    return rank


def test_a_timed_out_run_leaves_no_rank(tmp_path):
    """The timeout path reaps too: the hung rank does not sleep on after the caller gave up."""
    run_distributed(_sum_ranks, 1, 0.0)  # the rank fork server is up: the ranks below start at once
    pid_file = tmp_path / "pids"
    with pytest.raises(DistributedTestError, match=r"^_write_pid_then_hang_on_rank_1 timed out after 5 s"):
        run_distributed(
            _write_pid_then_hang_on_rank_1, 2, str(pid_file), timeout_s=5
        )  # forked ranks write their pid in ms
    ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("pids.*"))]
    assert len(ranks) == 2  # both ranks ran: the hung one is among those checked
    assert _wait_dead(ranks) == []


def test_ranks_die_with_a_parent_killed_by_sigkill(tmp_path):
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "pids"
    script = (
        "import sys; sys.path[:0] = [{root!r}, {here!r}]\n"
        "from parallel.testing import run_distributed\n"
        "from test_testing import _hang_writing_pid\n"
        "run_distributed(_hang_writing_pid, 2, {pid_file!r}, timeout_s=300)\n"
    ).format(root=os.getcwd(), here=os.path.dirname(__file__), pid_file=str(pid_file))
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and len(list(tmp_path.glob("pids.*"))) < 2:
            assert parent.poll() is None, "the parent exited before its ranks started"
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in tmp_path.glob("pids.*")]
        assert len(ranks) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _wait_dead(ranks) == []


def _hang_writing_pid(rank: int, world_size: int, pid_file: str) -> int:
    with open(f"{pid_file}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
    return rank


def test_ranks_are_spawned_for_nccl_and_on_cuda_machines_else_forked():
    """A CUDA context does not survive a fork (the first H200 run's forked gloo ranks failed with
    "Cannot re-initialize CUDA in forked subprocess"): with CUDA every rank is a fresh interpreter."""
    from parallel.testing import spawn_ranks

    assert spawn_ranks("nccl", cuda=False) and spawn_ranks("nccl", cuda=True) and spawn_ranks("gloo", cuda=True)
    assert not spawn_ranks("gloo", cuda=False)
    assert spawn_ranks("gloo") == torch.cuda.is_available()
