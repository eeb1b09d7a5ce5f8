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
