"""Context-parallel layout helpers on real gloo ranks (attention itself needs TE: GPU only)."""

import pytest
import torch

from parallel.context_parallel import gather_from_context_parallel, pad_length_for_context_parallel, zigzag_index
from parallel.testing import run_distributed


def test_zigzag_index_layout():
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_index(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    every = torch.cat([zigzag_index(24, 3, r) for r in range(3)]).sort().values
    assert every.tolist() == list(range(24))


def test_zigzag_index_errors():
    with pytest.raises(ValueError, match=r"seq_len=6 must be divisible by 2 \* context_parallel_size = 4"):
        zigzag_index(6, 2, 0)
    with pytest.raises(ValueError, match=r"cp_rank=2 must be in \[0, 2\)"):
        zigzag_index(8, 2, 2)


def test_pad_length():
    assert pad_length_for_context_parallel(9, 2) == 12
    assert pad_length_for_context_parallel(9, 2, multiple=2) == 16
    assert pad_length_for_context_parallel(9, 1, multiple=4) == 12


def _gather_case(rank, world_size):
    import torch.distributed as dist

    seq = 8
    full = torch.arange(2 * seq, dtype=torch.float64).view(2, seq) * 1.5
    local = full[:, zigzag_index(seq, world_size, rank)].clone().requires_grad_(True)
    gathered = gather_from_context_parallel(local, dist.group.WORLD, seq)
    weights = torch.arange(seq, dtype=torch.float64) + 1.0
    (gathered * weights).sum().backward()
    return torch.equal(gathered.detach(), full), local.grad, weights[zigzag_index(seq, world_size, rank)]


def test_gather_from_context_parallel_values_and_grads():
    for same, grad, expected in run_distributed(_gather_case, 2):
        assert same
        # Each rank receives exactly the gradient of its own positions (not summed over ranks).
        assert torch.equal(grad, expected.expand_as(grad))
