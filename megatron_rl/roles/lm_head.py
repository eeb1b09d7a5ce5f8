"""Heads over an LM engine's output: vocab-parallel log-probs, entropy and top-k of the responses.

Everything here works on a ``ModelOutput`` of an ``lm`` engine -- final hidden states and this TP
rank's shard of the output weight -- and never gathers the full vocabulary
(``parallel.vocab_parallel`` / ``parallel.vocab_parallel_topk``). Padded embedding rows past the
real vocabulary stay out of every softmax.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algos.distillation_loss import TopKDistillation, topk_distillation_from_log_probs
from megatron_rl.engine import ModelOutput

__all__ = ["response_log_probs", "response_logits", "topk_log_probs", "topk_distillation_terms"]


def response_log_probs(
    out: ModelOutput,
    responses: torch.Tensor,
    *,
    temperature: float,
    entropy: bool,
    chunk_size: int,
    sum_pi_squared: bool = False,
) -> tuple[Optional[torch.Tensor], ...]:
    """Log-probs ``[b, r]`` of ``responses`` (and their entropy, or None) at ``temperature``.

    Straight from the final hidden states and the vocab-sharded output weight: only the
    positions that predict response tokens are projected, ``chunk_size`` tokens at a time, so
    full logits are never materialised. Under CP every local position is scored, then gathered.
    With ``sum_pi_squared`` a third value, ``sum_v pi_v^2 [b, r]``, comes from the same fused pass.
    """
    from parallel.vocab_parallel import fused_linear_log_probs_and_entropy

    hidden, labels = out.scored_tokens(responses)  # [b, n, h], [b, n]
    log_probs, ent, *spsq = fused_linear_log_probs_and_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        out.output_weight,
        labels.reshape(-1),
        tp_group=out.tp_group,
        temperature=temperature,
        chunk_size=chunk_size,
        compute_entropy=entropy,
        vocab_size=out.vocab_size,  # padded embedding rows stay out of the softmax
        return_sum_pi_squared=sum_pi_squared,
    )
    log_probs = out.to_responses(log_probs.view(labels.shape))
    ent = out.to_responses(ent.view(labels.shape)) if ent is not None else None
    if sum_pi_squared:
        return log_probs, ent, out.to_responses(spsq[0].view(labels.shape))
    return log_probs, ent


def response_logits(out: ModelOutput) -> torch.Tensor:
    """``[., n, vocab/tp]`` logits of the response positions (padded rows ``[b, r, .]``, packed
    ``[1, n, .]``; ``out.to_responses`` maps results to ``[b, r, ...]``). Top-k needs them; not under CP yet."""
    if out.layout.cp_size > 1:
        raise ValueError("top-k distillation (forward_kl_topk) does not support context parallelism yet")
    return out.response_logits()


def topk_log_probs(out: ModelOutput, k: int, *, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probs of every response position and their ids: ``[b, r, k]`` each."""
    from parallel.vocab_parallel_topk import vocab_parallel_topk_log_probs

    values, ids = vocab_parallel_topk_log_probs(
        response_logits(out), k, tp_group=out.tp_group, temperature=temperature, vocab_size=out.vocab_size
    )
    return out.to_responses(values), out.to_responses(ids)


def topk_distillation_terms(
    out: ModelOutput,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    *,
    temperature: float,
    log_prob_min_clamp: Optional[float],
) -> TopKDistillation:
    """``forward_kl_topk`` terms of one micro-batch from vocab-parallel logits: the student's
    log-probs at the teacher's top-k ids (differentiable) and the student's own top-k ids."""
    from parallel.vocab_parallel_topk import vocab_parallel_gather_log_probs, vocab_parallel_topk_log_probs

    logits = response_logits(out)
    ids = teacher_topk_ids.long()
    kw = dict(tp_group=out.tp_group, temperature=temperature, vocab_size=out.vocab_size)
    student_at_teacher = out.to_responses(vocab_parallel_gather_log_probs(logits, out.from_responses(ids), **kw))
    _, student_ids = vocab_parallel_topk_log_probs(logits.detach(), ids.shape[-1], **kw)
    return topk_distillation_from_log_probs(
        student_at_teacher, out.to_responses(student_ids), teacher_topk_log_probs.float(), ids, log_prob_min_clamp
    )
