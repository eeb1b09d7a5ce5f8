"""Context parallelism: which sequence positions each CP rank holds, and putting them back.

Megatron-Core (with TransformerEngine attention) splits the sequence into ``2 * cp`` chunks
and gives CP rank ``r`` chunks ``r`` and ``2 * cp - 1 - r`` (the "zigzag" layout that
balances causal-attention work); RoPE is applied per rank for exactly those positions.
``zigzag_index`` names the positions a rank holds; ``gather_from_context_parallel``
reassembles a per-position tensor over the CP group. Its backward hands each rank the
gradient of its own positions only: every CP rank computes the same loss from the
gathered tensor, and Megatron's schedule (which scales the loss by the CP size) and
gradient all-reduce over DP x CP complete the sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["zigzag_index", "gather_from_context_parallel", "pad_length_for_context_parallel"]


def pad_length_for_context_parallel(seq_len: int, cp_size: int, multiple: int = 1) -> int:
    """Smallest length >= ``seq_len`` divisible by ``2 * cp_size * multiple``."""
    step = 2 * cp_size * multiple if cp_size > 1 else multiple
    return -(-seq_len // step) * step


def zigzag_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions ``[seq_len / cp]`` held by ``cp_rank``: chunks ``r`` and ``2cp-1-r`` of ``2cp``."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 * context_parallel_size = {2 * cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, {cp_size})")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


class _GatherFromContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, cp_group, seq_len):
        cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local.contiguous(), group=cp_group)
        full = local.new_empty(local.shape[0], seq_len, *local.shape[2:])
        for rank, part in enumerate(parts):
            full[:, zigzag_index(seq_len, cp_size, rank, local.device)] = part
        ctx.own = zigzag_index(seq_len, cp_size, cp_rank, local.device)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        return grad_full[:, ctx.own], None, None


def gather_from_context_parallel(local: torch.Tensor, cp_group, seq_len: int) -> torch.Tensor:
    """``[b, seq_len / cp, ...]`` zigzag-local values -> ``[b, seq_len, ...]`` on every CP rank.

    Differentiable: the gradient returned to each rank is that of its own positions.
    Without a group (or a group of one) the input is returned unchanged.
    """
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return local
    return _GatherFromContextParallel.apply(local, cp_group, seq_len)
