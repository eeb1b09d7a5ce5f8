"""Log-prob of the chosen token and entropy from vocabulary-parallel logits.

Under tensor parallelism the output layer (Megatron's ``ColumnParallelLinear`` /
``VocabParallelEmbedding`` with a tied weight) leaves each TP rank ``r`` with the logits of
the vocabulary slice ``[r * V/tp, (r + 1) * V/tp)``. This module computes, per token,

    log p(label) = x[label] - logsumexp(x)            x = logits / temperature
    H            = logsumexp(x) - sum_v p_v * x_v
    sum_v p_v^2  = sum_v exp(2 (x_v - M)) / S^2       (optional; M the max, S = sum_v exp(x_v - M))

without ever gathering the full vocabulary: every rank reduces its shard to per-token
partial statistics (max, sum of exp, sum of exp * logit, the label's logit if it owns it),
and only those ``[tokens]``-sized vectors are all-reduced (one MAX, one packed SUM).

Backward is written by hand (softmax is recomputed from the saved logits, chunk by chunk)::

    d log p(label) / d x = onehot(label) - p
    d H / d x            = -p * (x - sum_v p_v x_v) = -p * (log p + H)

and ``d/d logits = d/d x / temperature``. Gradients need no communication: the per-token
statistics already carry the global normalisation.

Two entry points:
- :func:`vocab_parallel_log_probs_and_entropy` from logits ``[..., vocab/tp]``; with
  ``chunk_size`` the float32 working set is ``chunk_size x vocab/tp`` instead of the
  whole sequence.
- :func:`fused_linear_log_probs_and_entropy` from the last hidden state and the
  vocab-sharded output weight; logits exist only one chunk at a time, forward and backward.
  With ``return_sum_pi_squared`` it also returns ``sum_v p_v^2`` per token (the optimal token
  baseline's path variance), from the same chunks and the same all-reduce (no gradient).

Math runs in float32 (float64 when the inputs are float64, which ``gradcheck`` needs);
the input tensors are never modified. With ``tp_group=None`` (or a group of size 1) the
functions act as a single rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["vocab_parallel_log_probs_and_entropy", "fused_linear_log_probs_and_entropy"]

DEFAULT_LINEAR_CHUNK_SIZE = 512


# --------------------------------------------------------------------------- helpers


def _group_size_rank(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(num_tokens: int, chunk_size: Optional[int]):
    if num_tokens == 0:  # one empty chunk keeps the per-token vectors well-formed
        yield 0, 0
        return
    step = num_tokens if chunk_size is None else chunk_size
    for start in range(0, num_tokens, step):
        yield start, min(start + step, num_tokens)


def _check_args(
    labels: torch.Tensor, token_shape: torch.Size, vocab_size: int, temperature, chunk_size, what: str
) -> None:
    """Raise ``ValueError`` naming the offending argument; ``what`` names the tensor labels match."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor of token ids, got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(token_shape):
        raise ValueError(f"labels shape {list(labels.shape)} must equal {what} {list(token_shape)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be a number > 0")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r} must be None or an int >= 1")
    if labels.numel():
        low, high = torch.aminmax(labels)
        low, high = int(low), int(high)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"labels must lie in [0, {vocab_size}) (vocab/tp x tp); got min {low}, max {high}")


def _local_index(labels: torch.Tensor, vocab_start: int, vocab_local: int):
    """Labels -> (column in this shard, owned-by-this-shard mask); unowned rows point at column 0."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return torch.where(owned, local, torch.zeros_like(local)), owned


def _sum_of_squares(e: torch.Tensor) -> torch.Tensor:
    """``sum_v e_v^2`` per row of ``e: [n, v]`` without an ``[n, v]`` temporary."""
    return torch.linalg.vector_norm(e, ord=2, dim=-1).square()


def _shard_stats(
    x: torch.Tensor, index: torch.Tensor, owned: torch.Tensor, compute_entropy: bool, compute_sum_sq: bool = False
):
    """Per-token partial statistics of one shard's scaled logits ``x: [n, v]`` (consumed in place).

    Returns ``(m, s, a, t, q)``: local max, ``sum exp(x - m)``, ``sum exp(x - m) * (x - m)``
    (``None`` without entropy), the label's logit (0 where this shard does not own it) and
    ``sum exp(2 (x - m))`` (``None`` unless ``compute_sum_sq``).
    """
    m = x.amax(dim=-1)  # [n]
    t = x.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    x.sub_(m.unsqueeze(-1))  # z = x - m
    if not compute_entropy:
        e = x.exp_()
        return m, e.sum(dim=-1), None, t, _sum_of_squares(e) if compute_sum_sq else None
    e = torch.exp(x)
    s = e.sum(dim=-1)
    q = _sum_of_squares(e) if compute_sum_sq else None
    # In place into e: no third [n, v] buffer. (A batched dot, bmm, would avoid it too but
    # accumulates 1e5 terms sequentially on CPU: 20x the rounding error of sum's tree.)
    a = e.mul_(x).sum(dim=-1)
    return m, s, a, t, q


def _combine_stats(m, s, a, t, tp_group, tp_size, q=None):
    """All-reduce per-token partial statistics over the TP group -> (log_probs, entropy, logz, sum_pi_sq).

    Partial sums taken relative to each rank's own max are rescaled to the global max ``M``
    (``w = exp(m - M)``; squares by ``w^2``), the same merge as online softmax; entropy is formed
    as ``log S - sum p (x - M)`` so no term of size ``M`` cancels, and ``sum p^2 = Q / S^2``.
    """
    if tp_size > 1:
        big_m = m.clone()
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
        w = torch.exp(m - big_m)
        parts = [w * s, t] + ([] if a is None else [w * (a + (m - big_m) * s)]) + ([] if q is None else [w * w * q])
        packed = torch.stack(parts)  # [2..4, n]: one SUM for all of them
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
        s, t = packed[0], packed[1]
        a = None if a is None else packed[2]
        q = None if q is None else packed[-1]
        m = big_m
    log_s = torch.log(s)
    logz = m + log_s
    log_probs = t - logz
    entropy = None if a is None else log_s - a / s
    sum_pi_sq = None if q is None else q / (s * s)
    return log_probs, entropy, logz, sum_pi_sq


def _grad_from_log_probs(x, entropy, grad_lp, grad_h, index, owned, temperature):
    """Gradient w.r.t. raw logits of one chunk, written into ``x`` (which holds ``log p``).

    ``grad = (g_lp * (onehot - p) - g_h * p * (log p + H)) / temperature``.
    """
    p = torch.exp(x)
    if grad_h is not None:
        x.add_(entropy.unsqueeze(-1)).mul_(grad_h.neg().unsqueeze(-1))  # -g_h * (log p + H)
        if grad_lp is not None:
            x.sub_(grad_lp.unsqueeze(-1))
        x.mul_(p)
    else:
        torch.mul(p, grad_lp.neg().unsqueeze(-1), out=x)
    del p
    if grad_lp is not None:
        x.scatter_add_(-1, index.unsqueeze(-1), (grad_lp * owned).unsqueeze(-1))
    if temperature != 1.0:
        x.div_(temperature)
    return x


def _log_probs_of(src, logz, dtype, temperature, out=None):
    """``src / temperature - logz`` in ``dtype`` as a fresh buffer (or ``out``); never aliases ``src``."""
    if out is None:
        out = torch.empty(src.shape, dtype=dtype, device=src.device)
    if temperature == 1.0:
        return torch.sub(src, logz.unsqueeze(-1), out=out)  # one pass: copy + subtract
    out.copy_(src)
    return out.div_(temperature).sub_(logz.unsqueeze(-1))  # same division as forward


def _scaled_copy(src: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """``src / temperature`` in ``dtype`` as a fresh buffer (never aliases ``src``)."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    out.copy_(src)
    if temperature != 1.0:
        out.div_(temperature)  # same op order as vLLM
    return out


def _mm_math(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with a ``dtype`` (float32/64) result; low-precision inputs accumulate in float32.

    CUDA offers ``torch.mm(..., out_dtype=float32)`` for bf16/fp16 operands; elsewhere the
    operands are upcast (the caller passes chunks, so the copies stay small).
    """
    if a.dtype == dtype:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=dtype)
        except (RuntimeError, TypeError):
            pass
    return a.to(dtype) @ b.to(dtype)


# --------------------------------------------------------------------------- from logits


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """logits ``[n, vocab/tp]`` -> log_probs ``[n]`` (+ entropy ``[n]``); see the module docstring."""

    @staticmethod
    def forward(ctx, logits, labels, tp_group, temperature, compute_entropy, chunk_size):
        tp_size, tp_rank = _group_size_rank(tp_group)
        num_tokens, vocab_local = logits.shape
        dtype = _math_dtype(logits.dtype)
        index, owned = _local_index(labels, tp_rank * vocab_local, vocab_local)

        stats = [[], [], [], [], []]
        for lo, hi in _chunks(num_tokens, chunk_size):
            x = _scaled_copy(logits[lo:hi], dtype, temperature)  # [c, vocab/tp] working copy
            for acc, val in zip(stats, _shard_stats(x, index[lo:hi], owned[lo:hi], compute_entropy)):
                acc.append(val)
            del x
        m, s, t = (torch.cat(v) for v in (stats[0], stats[1], stats[3]))
        a = torch.cat(stats[2]) if compute_entropy else None
        log_probs, entropy, logz, _ = _combine_stats(m, s, a, t, tp_group, tp_size)

        # Only the logits reference and [n]-sized vectors are kept; softmax is recomputed.
        ctx.save_for_backward(logits, index, owned, logz, entropy if compute_entropy else None)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        if compute_entropy:
            return log_probs, entropy
        return log_probs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp, grad_h=None):
        logits, index, owned, logz, entropy = ctx.saved_tensors
        if grad_lp is None and grad_h is None:
            return None, None, None, None, None, None
        temperature, dtype = ctx.temperature, _math_dtype(logits.dtype)
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        in_place = grad_logits.dtype == dtype  # work directly in the output rows: no extra buffer
        for lo, hi in _chunks(logits.shape[0], ctx.chunk_size):
            out = grad_logits[lo:hi] if in_place else None
            x = _log_probs_of(logits[lo:hi], logz[lo:hi], dtype, temperature, out=out)
            x = _grad_from_log_probs(
                x,
                None if entropy is None else entropy[lo:hi],
                None if grad_lp is None else grad_lp[lo:hi],
                None if grad_h is None else grad_h[lo:hi],
                index[lo:hi],
                owned[lo:hi],
                temperature,
            )
            if not in_place:
                grad_logits[lo:hi].copy_(x)
            del x
        return grad_logits, None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of ``labels`` and entropy from vocabulary-sharded logits.

    Args:
        logits: ``[..., vocab/tp]`` this rank's vocabulary shard (rank ``r`` holds token ids
            ``[r * vocab/tp, (r + 1) * vocab/tp)``), any floating dtype. Not modified.
        labels: ``[...]`` global token ids in ``[0, vocab)``.
        tp_group: the tensor-parallel process group; ``None`` means a single rank.
        temperature: logits are divided by it before the softmax, as the rollout does.
        compute_entropy: also return the entropy (else ``None``).
        chunk_size: process this many tokens at a time (forward and backward) so the
            float32 working set is ``chunk_size x vocab/tp``; ``None`` = all tokens at once.

    Returns:
        ``(log_probs [...], entropy [...] or None)`` in float32 (float64 for float64 logits),
        identical on every rank of ``tp_group``; differentiable w.r.t. ``logits``.
    """
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or logits.dim() < 1:
        raise ValueError(
            "logits must be a floating tensor [..., vocab/tp], got "
            f"{getattr(logits, 'dtype', type(logits))} {list(getattr(logits, 'shape', []))}"
        )
    tp_size, _ = _group_size_rank(tp_group)
    vocab_local = logits.shape[-1]
    _check_args(labels, logits.shape[:-1], vocab_local * tp_size, temperature, chunk_size, "logits.shape[:-1]")
    token_shape = labels.shape
    flat_logits = logits.reshape(-1, vocab_local)  # [n, vocab/tp]
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
    out = _VocabParallelLogProbEntropy.apply(
        flat_logits, flat_labels, tp_group, float(temperature), bool(compute_entropy), chunk_size
    )
    if compute_entropy:
        log_probs, entropy = out
        return log_probs.view(token_shape), entropy.view(token_shape)
    return out.view(token_shape), None


# --------------------------------------------------------------------------- from hidden states


class _FusedLinearLogProbEntropy(torch.autograd.Function):
    """hidden ``[n, h]`` x weight ``[vocab/tp, h]`` -> log_probs ``[n]`` (+ entropy), logits by chunk."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        tp_group,
        temperature,
        compute_entropy,
        chunk_size,
        vocab_start,
        compute_sum_sq=False,
    ):
        tp_size, tp_rank = _group_size_rank(tp_group)
        num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        dtype = _math_dtype(hidden.dtype)
        index, owned = _local_index(labels, vocab_start, vocab_local)

        # Without a float32-output matmul for low-precision operands (CPU), upcast the
        # weight once rather than per chunk.
        weight_t = weight.t()
        if weight.dtype != dtype and not weight.is_cuda:
            weight_t = weight_t.to(dtype)
        stats = [[], [], [], [], []]
        for lo, hi in _chunks(num_tokens, chunk_size):
            x = _mm_math(hidden[lo:hi], weight_t, dtype)  # [c, vocab/tp] float32 logits
            if temperature != 1.0:
                x.div_(temperature)
            for acc, val in zip(stats, _shard_stats(x, index[lo:hi], owned[lo:hi], compute_entropy, compute_sum_sq)):
                acc.append(val)
            del x
        del weight_t
        m, s, t = (torch.cat(v) for v in (stats[0], stats[1], stats[3]))
        a = torch.cat(stats[2]) if compute_entropy else None
        q = torch.cat(stats[4]) if compute_sum_sq else None
        log_probs, entropy, logz, sum_pi_sq = _combine_stats(m, s, a, t, tp_group, tp_size, q)

        ctx.save_for_backward(hidden, weight, labels, logz, entropy if compute_entropy else None)
        ctx.tp_group, ctx.tp_rank, ctx.tp_size = tp_group, tp_rank, tp_size
        ctx.temperature, ctx.chunk_size, ctx.vocab_start = temperature, chunk_size, vocab_start
        ctx.compute_entropy = compute_entropy
        ctx.set_materialize_grads(False)
        outputs = (log_probs,) + ((entropy,) if compute_entropy else ())
        if compute_sum_sq:
            ctx.mark_non_differentiable(sum_pi_sq)  # a baseline statistic: no gradient flows through it
            outputs += (sum_pi_sq,)
        return outputs if len(outputs) > 1 else log_probs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp, *grads):
        grad_h = grads[0] if ctx.compute_entropy and grads else None
        hidden, weight, labels, logz, entropy = ctx.saved_tensors
        nones = (None,) * 7
        if grad_lp is None and grad_h is None:
            return (None, None) + nones
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        dtype, temperature = _math_dtype(hidden.dtype), ctx.temperature

        # Backward walks the vocabulary in slices over all tokens (same element budget as
        # a forward chunk). Each slice's weight grad is then one matmul over every token,
        # accumulated inside the GEMM in float32 and rounded once - no float32 [vocab/tp, h]
        # accumulator is needed even for bf16 weights.
        budget = (ctx.chunk_size or num_tokens) * vocab_local
        vocab_step = max(1, min(vocab_local, budget // num_tokens)) if num_tokens else vocab_local
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else None
        grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden else None
        vocab_start = ctx.vocab_start
        for lo in range(0, vocab_local, vocab_step):
            hi = min(lo + vocab_step, vocab_local)
            w_slice = weight[lo:hi]  # [v, h]
            x = _mm_math(hidden, w_slice.t(), dtype)  # [n, v] recomputed logits
            if temperature != 1.0:
                x.div_(temperature)
            x.sub_(logz.unsqueeze(-1))  # log p
            index, owned = _local_index(labels, vocab_start + lo, hi - lo)
            g = _grad_from_log_probs(x, entropy, grad_lp, grad_h, index, owned, temperature)
            del x
            g_in = g if g.dtype == weight.dtype else g.to(weight.dtype)  # [n, v] d loss / d logits
            if need_weight:
                torch.mm(g_in.t(), hidden, out=grad_weight[lo:hi])
            if need_hidden:
                if g_in.dtype == dtype:
                    grad_hidden.addmm_(g_in, w_slice)
                else:
                    grad_hidden += _mm_math(g_in, w_slice, dtype)
            del g, g_in
        if need_hidden:
            # The hidden state fed every vocabulary shard (ColumnParallelLinear's input with
            # sequence parallelism off), so its gradient is the sum of all shards' parts.
            if ctx.tp_size > 1:
                dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.tp_group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        return (grad_hidden, grad_weight) + nones


def fused_linear_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = DEFAULT_LINEAR_CHUNK_SIZE,
    compute_entropy: bool = True,
    vocab_size: Optional[int] = None,
    return_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-prob of ``labels`` and entropy straight from the last hidden state.

    ``logits = hidden @ weight.T / temperature`` is formed ``chunk_size`` tokens at a time
    (in float32, from bf16 operands too) and reduced to per-token statistics at once, so
    the full ``[tokens, vocab/tp]`` logits never exist; backward recomputes them slice by
    slice. Gradients flow to ``hidden`` (summed over the TP group, as the input grad of
    Megatron's ``ColumnParallelLinear`` is, sequence parallelism off) and to ``weight``
    (this rank's shard).

    Args:
        hidden: ``[..., h]`` the final hidden states, the same on every TP rank.
        weight: ``[vocab/tp, h]`` this rank's rows of the output layer (rank ``r`` holds
            token ids ``[r * vocab/tp, (r + 1) * vocab/tp)``), same dtype as ``hidden``.
        labels: ``[...]`` global token ids in ``[0, vocab)``.
        tp_group, temperature, compute_entropy: as in :func:`vocab_parallel_log_probs_and_entropy`.
        chunk_size: tokens per forward chunk; backward uses vocabulary slices holding the
            same number of logits. ``None`` = all at once.
        vocab_size: the real vocabulary when the weight's rows are padded (Megatron pads the
            embedding to a multiple of TP); rows with ids ``>= vocab_size`` are left out of the
            softmax entirely (and get zero gradient). ``None`` = every row is real.
        return_sum_pi_squared: also return ``sum_v p_v^2 [...]`` (same chunks, same all-reduce;
            not differentiable).

    Returns:
        ``(log_probs [...], entropy [...] or None)`` in float32 (float64 for float64 inputs), and
        ``sum_pi_squared [...]`` third with ``return_sum_pi_squared``.
    """
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden {list(hidden.shape)} must be [..., h] and weight {list(weight.shape)} "
            "[vocab/tp, h] with the same h"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    tp_size, tp_rank = _group_size_rank(tp_group)
    padded_local = weight.shape[0]
    vocab_start = tp_rank * padded_local
    if vocab_size is None:
        vocab_size = padded_local * tp_size
    elif not 0 < vocab_size <= padded_local * tp_size:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {padded_local * tp_size}] (weight rows x tp)")
    valid_local = min(max(vocab_size - vocab_start, 0), padded_local)
    if valid_local == 0:
        raise ValueError(
            f"TP rank {tp_rank} holds only padding rows (vocab_size={vocab_size}, {padded_local} rows per rank); "
            "use a smaller tensor_model_parallel_size or less vocabulary padding"
        )
    _check_args(labels, hidden.shape[:-1], vocab_size, temperature, chunk_size, "hidden.shape[:-1]")
    token_shape = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [n, h]
    flat_labels = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    out = _FusedLinearLogProbEntropy.apply(
        flat_hidden,
        weight[:valid_local] if valid_local < padded_local else weight,
        flat_labels,
        tp_group,
        float(temperature),
        bool(compute_entropy),
        chunk_size,
        vocab_start,
        bool(return_sum_pi_squared),
    )
    out = out if isinstance(out, tuple) else (out,)
    log_probs = out[0].view(token_shape)
    entropy = out[1].view(token_shape) if compute_entropy else None
    if return_sum_pi_squared:
        return log_probs, entropy, out[-1].view(token_shape)
    return log_probs, entropy
