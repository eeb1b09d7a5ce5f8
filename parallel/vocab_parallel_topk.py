"""Top-k log-probs over vocabulary-parallel logits (for top-k forward-KL distillation).

Each TP rank holds the logits of its vocabulary slice ``[r * V/tp, (r + 1) * V/tp)``. Two
operations, neither gathering the vocabulary:

* :func:`vocab_parallel_topk_log_probs` -- the ``k`` largest log-probs and their global ids
  (no gradient): each rank takes its local top-k, the ``k * tp`` candidates per token are
  all-gathered and reduced to the global top-k; ``logsumexp`` comes from per-token partial
  statistics (one MAX, one SUM all-reduce).
* :func:`vocab_parallel_gather_log_probs` -- ``log_softmax(logits)`` at given global ids,
  differentiable: the normaliser's partial sums and the owned logits are all-reduced forward
  with an identity backward (the result is replicated over TP), so the gradient reaches exactly
  the rank that owns each logit.

With ``tp_group=None`` (or size 1) both are the single-rank computation. Logits of padded
vocabulary rows (ids ``>= vocab_size``) are left out. Math in float32 (float64 stays float64).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_topk_log_probs", "vocab_parallel_gather_log_probs"]


def _shard(logits: torch.Tensor, tp_group, vocab_size: Optional[int]) -> tuple[torch.Tensor, int, int]:
    """``(x, vocab_start, valid)``: float logits with padded rows at -inf, this shard's first id
    and how many of its columns are real."""
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    local = logits.shape[-1]
    start = rank * local
    valid = local if vocab_size is None else max(0, min(local, vocab_size - start))
    x = logits.float() if logits.dtype != torch.float64 else logits
    if valid < local:
        x = torch.cat([x[..., :valid], x.new_full((*x.shape[:-1], local - valid), float("-inf"))], dim=-1)
    return x, start, valid


def _log_normaliser(x: torch.Tensor, tp_group, differentiable: bool) -> torch.Tensor:
    """Global ``logsumexp`` over the vocabulary, ``[...]``."""
    m = x.detach().amax(dim=-1)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    s = (x - m.unsqueeze(-1)).exp().sum(dim=-1)
    s = _sum_over_tp(s, tp_group, differentiable)
    return m + s.log()


def _sum_over_tp(t: torch.Tensor, tp_group, differentiable: bool) -> torch.Tensor:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return t
    if differentiable:
        return _AllReduceIdentityBackward.apply(t, tp_group)
    t = t.clone()
    dist.all_reduce(t, group=tp_group)
    return t


class _AllReduceIdentityBackward(torch.autograd.Function):
    """Sum over ``group`` forward; the gradient of a replicated result passes through unchanged."""

    @staticmethod
    def forward(ctx, t, group):
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@torch.no_grad()
def vocab_parallel_topk_log_probs(
    logits: torch.Tensor, k: int, *, tp_group=None, temperature: float = 1.0, vocab_size: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``log_softmax(logits / temperature)`` values and their global ids.

    Args:
        logits: ``[..., vocab/tp]`` this rank's shard.
        k: how many (``1 <= k <= vocab``).
    Returns:
        ``(log_probs [..., k], ids [..., k] long)``, sorted descending, identical on every TP rank.
    """
    x, start, valid = _shard(logits, tp_group, vocab_size)
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    total = vocab_size if vocab_size is not None else logits.shape[-1] * size
    if not 1 <= k <= total:
        raise ValueError(f"k={k} must lie in [1, vocab_size={total}]")
    x = x / temperature
    log_z = _log_normaliser(x, tp_group, differentiable=False)
    local_k = min(k, x.shape[-1])
    values, index = x.topk(local_k, dim=-1)
    ids = index + start
    if size > 1:
        gathered_v = [torch.empty_like(values) for _ in range(size)]
        gathered_i = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(gathered_v, values.contiguous(), group=tp_group)
        dist.all_gather(gathered_i, ids.contiguous(), group=tp_group)
        values, ids = torch.cat(gathered_v, dim=-1), torch.cat(gathered_i, dim=-1)
        values, pick = values.topk(k, dim=-1)
        ids = ids.gather(-1, pick)
    return values - log_z.unsqueeze(-1), ids


def vocab_parallel_gather_log_probs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at global ``ids [..., k]``; differentiable w.r.t. ``logits``.

    Returns ``[..., k]`` float32 (float64 for float64 logits), identical on every TP rank.
    """
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"ids {list(ids.shape)} must be [..., k] over logits {list(logits.shape)}'s tokens")
    x, start, valid = _shard(logits, tp_group, vocab_size)
    x = x / temperature
    log_z = _log_normaliser(x, tp_group, differentiable=True)
    local = ids - start
    owned = (local >= 0) & (local < valid)
    picked = x.gather(-1, torch.where(owned, local, torch.zeros_like(local)))
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    return _sum_over_tp(picked, tp_group, differentiable=True) - log_z.unsqueeze(-1)
