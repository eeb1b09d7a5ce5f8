"""Top-k log-probs over vocabulary-parallel logits equal the full-vocabulary computation.

Two gloo ranks each hold half of the logits' columns (a padded vocabulary: the last 6 of 96
columns are padding and must stay out of the softmax); results, ids and gradients must equal
``log_softmax`` over the 90 real columns of the whole tensor."""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed

SHAPE, VOCAB, PADDED, K, TEMPERATURE = (3, 5), 90, 96, 7, 0.7


def _full():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(*SHAPE, PADDED, generator=g)
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:K] for _ in range(SHAPE[0] * SHAPE[1])]).view(*SHAPE, K)
    weights = torch.randn(*SHAPE, K, generator=g)
    return logits, ids, weights


def _case(rank, world_size):
    import torch.distributed as dist

    from parallel.vocab_parallel_topk import vocab_parallel_gather_log_probs, vocab_parallel_topk_log_probs

    logits, ids, weights = _full()
    shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    group = dist.group.WORLD
    values, top_ids = vocab_parallel_topk_log_probs(shard, K, tp_group=group, temperature=TEMPERATURE, vocab_size=VOCAB)
    gathered = vocab_parallel_gather_log_probs(shard, ids, tp_group=group, temperature=TEMPERATURE, vocab_size=VOCAB)
    (gathered * weights).sum().backward()
    return values, top_ids, gathered.detach(), shard.grad


def _reference():
    """The full-vocabulary computation in float64: the exact answer the float32 ranks approximate."""
    logits, ids, weights = _full()
    logits = logits.double().requires_grad_(True)
    lp = (logits[..., :VOCAB] / TEMPERATURE).log_softmax(-1)
    top = lp.detach().topk(K, dim=-1)
    gathered = lp.gather(-1, ids)
    (gathered * weights.double()).sum().backward()
    return top.values, top.indices, gathered.detach(), logits.grad


def _fp32_bound(reference: torch.Tensor) -> float:
    """The forward-error bound of a float32 softmax reduction over VOCAB terms: eps * n * scale.

    A sum of n float32 terms errs by at most n * eps relative to the sum of the magnitudes
    (Higham, Accuracy and Stability of Numerical Algorithms, 4.2); log-softmax, its
    max/log-sum-exp and its gradient are such reductions over the VOCAB columns, scaled by the
    largest magnitude of the exact result. It holds whatever order a CPU's kernels sum in.
    """
    return torch.finfo(torch.float32).eps * VOCAB * float(reference.abs().max())


@pytest.mark.parametrize("world_size", [1, 2])
def test_topk_and_gather_equal_the_full_vocabulary(world_size):
    values, ids, gathered, grad = _reference()
    results = run_distributed(_case, world_size)
    for rank, (v, i, gat, g) in enumerate(results):
        assert torch.equal(i, ids)
        assert float((v.double() - values).abs().max()) < _fp32_bound(values)
        assert float((gat.double() - gathered).abs().max()) < _fp32_bound(gathered)
        g_ref = grad.chunk(world_size, dim=-1)[rank]
        assert float((g.double() - g_ref).abs().max()) < _fp32_bound(grad)
    assert float(grad[..., VOCAB:].abs().max()) == 0.0  # padded columns get no gradient


def test_bad_arguments():
    from parallel.vocab_parallel_topk import vocab_parallel_gather_log_probs, vocab_parallel_topk_log_probs

    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match=r"k=11 must lie in \[1, vocab_size=10\]"):
        vocab_parallel_topk_log_probs(logits, 11)
    with pytest.raises(ValueError, match=r"ids \[3, 2\] must be \[\.\.\., k\] over logits \[2, 10\]'s tokens"):
        vocab_parallel_gather_log_probs(logits, torch.zeros(3, 2, dtype=torch.long))
