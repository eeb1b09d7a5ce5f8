"""Vocab-parallel log-prob + entropy equal the unsharded computation.

Every case is compared, values and gradients, with ``log_softmax(-1)`` + gather and the full
entropy on the whole vocabulary, computed in float64. TP>1 runs on real gloo ranks: each rank
slices its vocabulary shard out of the same seeded full tensors. The float32 results are held
to the rounding bound of the reductions they come from, eps * terms * scale (tests/numerics.py):
VOCAB terms from logits, HIDDEN + 2 * VOCAB from hidden states (the logits' matmul, the softmax,
the backward's matmul over the vocabulary). A wrong shard, a missing all-reduce or a misplaced
temperature moves them by ~1e-1.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from parallel.testing import run_distributed
from parallel.vocab_parallel import fused_linear_log_probs_and_entropy, vocab_parallel_log_probs_and_entropy
from tests.numerics import assert_within, max_abs_diff, rounding_bound

VOCAB, HIDDEN, TOKEN_SHAPE = 96, 16, (3, 7)
LOGITS_TERMS = VOCAB  # reductions from logits: max / log-sum-exp / softmax over the vocabulary
LINEAR_TERMS = HIDDEN + 2 * VOCAB  # from hidden states: + the logits' matmul and the backward's over the vocabulary
# (temperature, chunk_size, compute_entropy) run at every TP size.
CASES = [(1.0, None, True), (0.7, 5, True), (1.3, 4, False)]


def _full_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "logits": torch.randn(*TOKEN_SHAPE, VOCAB, generator=gen) * 3.0,
        "labels": torch.randint(0, VOCAB, TOKEN_SHAPE, generator=gen),
        "hidden": torch.randn(*TOKEN_SHAPE, HIDDEN, generator=gen),
        "weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5,
        "g_lp": torch.randn(TOKEN_SHAPE, generator=gen),  # upstream grads of log_probs / entropy
        "g_h": torch.randn(TOKEN_SHAPE, generator=gen),
    }


def _loss(lp, ent, inp):
    loss = (lp * inp["g_lp"]).sum()
    return loss if ent is None else loss + (ent * inp["g_h"]).sum()


def _reference(logits, labels, temperature):
    """The unsharded computation the vocab-parallel path must equal, in the logits' dtype (at least float32)."""
    x = logits.float() / temperature if logits.dtype != torch.float64 else logits / temperature
    log_probs = x.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(x, -1) - (x.softmax(-1) * x).sum(-1)
    return log_probs, entropy


def _reference_grads(inp, temperature, compute_entropy):
    """Values and gradients of the unsharded computation in float64: the exact answer float32 approximates."""
    inp = {k: v.double() if v.is_floating_point() else v for k, v in inp.items()}
    logits = inp["logits"].clone().requires_grad_(True)
    lp, ent = _reference(logits, inp["labels"], temperature)
    ent = ent if compute_entropy else None
    _loss(lp, ent, inp).backward()
    hidden = inp["hidden"].clone().requires_grad_(True)
    weight = inp["weight"].clone().requires_grad_(True)
    llp, lent = _reference(hidden @ weight.t(), inp["labels"], temperature)
    _loss(llp, lent if compute_entropy else None, inp).backward()
    return {
        "lp": lp.detach(),
        "ent": None if ent is None else ent.detach(),
        "grad_logits": logits.grad,
        "lin_lp": llp.detach(),
        "lin_ent": lent.detach() if compute_entropy else None,
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
    }


def _run_cases(tp_group, tp_size: int, tp_rank: int, seed: int) -> list[dict]:
    """Every CASE on this rank's shard of the seeded full inputs; returns outputs and grads."""
    inp = _full_inputs(seed)
    vocab_local = VOCAB // tp_size
    shard = slice(tp_rank * vocab_local, (tp_rank + 1) * vocab_local)
    results = []
    for temperature, chunk_size, compute_entropy in CASES:
        logits = inp["logits"][..., shard].clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(
            logits,
            inp["labels"],
            tp_group=tp_group,
            temperature=temperature,
            compute_entropy=compute_entropy,
            chunk_size=chunk_size,
        )
        _loss(lp, ent, inp).backward()
        hidden = inp["hidden"].clone().requires_grad_(True)
        weight = inp["weight"][shard].clone().requires_grad_(True)
        llp, lent = fused_linear_log_probs_and_entropy(
            hidden,
            weight,
            inp["labels"],
            tp_group=tp_group,
            temperature=temperature,
            compute_entropy=compute_entropy,
            chunk_size=chunk_size,
        )
        _loss(llp, lent, inp).backward()
        results.append(
            {
                "lp": lp.detach(),
                "ent": None if ent is None else ent.detach(),
                "grad_logits": logits.grad,
                "lin_lp": llp.detach(),
                "lin_ent": None if lent is None else lent.detach(),
                "grad_hidden": hidden.grad,
                "grad_weight": weight.grad,
            }
        )
    try:  # a label id >= vocab/tp x tp is rejected on every rank
        vocab_parallel_log_probs_and_entropy(
            inp["logits"][..., shard], torch.full(TOKEN_SHAPE, VOCAB), tp_group=tp_group
        )
        results.append({"error": None})
    except ValueError as exc:
        results.append({"error": str(exc)})
    return results


def _tp_worker(rank: int, world_size: int, tp_sizes: tuple[int, ...]) -> dict[int, list[dict]]:
    """For each TP size: split the world into TP groups (consecutive ranks) and run every case.

    Each data-parallel replica (``rank // tp``) uses its own seed, so a wrong group would mix data.
    """
    out = {}
    for tp_size in tp_sizes:
        my_group = None
        for start in range(0, world_size, tp_size):
            group = dist.new_group(list(range(start, start + tp_size)))
            if start <= rank < start + tp_size:
                my_group = group
        out[tp_size] = _run_cases(my_group, tp_size, rank % tp_size, seed=100 + rank // tp_size)
    return out


def _assert_fp32_close(got: torch.Tensor, exact: torch.Tensor, num_terms: int, scale: float, what: str) -> None:
    """``got`` (float32) is within the rounding bound of ``num_terms``-term reductions of ``exact`` (float64)."""
    assert_within(max_abs_diff(got, exact), rounding_bound(num_terms, scale), what)


def _scale(t: torch.Tensor) -> float:
    return max(1.0, float(t.abs().max()))


def _check_rank(results: list[dict], tp_size: int, tp_rank: int, seed: int) -> None:
    inp = _full_inputs(seed)
    vocab_local = VOCAB // tp_size
    shard = slice(tp_rank * vocab_local, (tp_rank + 1) * vocab_local)
    for (temperature, _, compute_entropy), got in zip(CASES, results):
        ref = _reference_grads(inp, temperature, compute_entropy)
        # log-prob and entropy are differences of terms as large as the logits (x_label - lse, lse - E[x]).
        x_scale = _scale(inp["logits"] / temperature)
        lin_x_scale = _scale(inp["hidden"].abs() @ inp["weight"].abs().t() / temperature)
        tag = f"vocab_parallel tp={tp_size} T={temperature}"
        _assert_fp32_close(got["lp"], ref["lp"], LOGITS_TERMS, x_scale, f"{tag} lp")
        _assert_fp32_close(got["lin_lp"], ref["lin_lp"], LINEAR_TERMS, lin_x_scale, f"{tag} lin_lp")
        if compute_entropy:
            _assert_fp32_close(got["ent"], ref["ent"], LOGITS_TERMS, x_scale, f"{tag} ent")
            _assert_fp32_close(got["lin_ent"], ref["lin_ent"], LINEAR_TERMS, lin_x_scale, f"{tag} lin_ent")
        else:
            assert got["ent"] is None and got["lin_ent"] is None
        # Gradients: (onehot - p) and p * (log p + H) times the upstream grads, scaled like the logits.
        g_scale = (_scale(inp["g_lp"]) + _scale(inp["g_h"]) * x_scale) / temperature
        lin_g_scale = (
            (_scale(inp["g_lp"]) + _scale(inp["g_h"]) * lin_x_scale)
            / temperature
            * _scale(torch.cat([inp["hidden"].flatten(), inp["weight"].flatten()]))
        )
        _assert_fp32_close(
            got["grad_logits"], ref["grad_logits"][..., shard], LOGITS_TERMS, g_scale, f"{tag} grad_logits"
        )
        _assert_fp32_close(got["grad_hidden"], ref["grad_hidden"], LINEAR_TERMS, lin_g_scale, f"{tag} grad_hidden")
        _assert_fp32_close(
            got["grad_weight"], ref["grad_weight"][shard], LINEAR_TERMS, lin_g_scale, f"{tag} grad_weight"
        )
    assert results[-1]["error"] == f"labels must lie in [0, {VOCAB}) (vocab/tp x tp); got min {VOCAB}, max {VOCAB}"


def test_single_rank_equals_unsharded_reference():
    _check_rank(_run_cases(None, 1, 0, seed=7), tp_size=1, tp_rank=0, seed=7)


def test_tp2_equals_unsharded_reference():
    results = run_distributed(_tp_worker, 2, (2,))
    for rank, res in enumerate(results):
        _check_rank(res[2], tp_size=2, tp_rank=rank, seed=100)


def test_tp4_and_two_tp2_groups_equal_unsharded_reference():
    results = run_distributed(_tp_worker, 4, (4, 2))
    for rank, res in enumerate(results):
        _check_rank(res[4], tp_size=4, tp_rank=rank, seed=100)
        _check_rank(res[2], tp_size=2, tp_rank=rank % 2, seed=100 + rank // 2)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_gradcheck_float64_logits(chunk_size):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 11, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    labels = torch.randint(0, 11, (5,), generator=gen)

    def both(x):
        return vocab_parallel_log_probs_and_entropy(x, labels, temperature=0.8, chunk_size=chunk_size)

    def log_prob_only(x):
        return vocab_parallel_log_probs_and_entropy(x, labels, compute_entropy=False, chunk_size=chunk_size)[0]

    def entropy_only(x):  # the log-prob output unused: its grad arrives as None
        return both(x)[1]

    assert both(logits)[0].dtype == torch.float64
    for fn in (both, log_prob_only, entropy_only):  # float64: a 1e-6 step's difference quotient errs ~1e-10
        assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-8)


def test_gradcheck_float64_fused_linear():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(9, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, 9, (2, 3), generator=gen)

    def fn(h, w):
        return fused_linear_log_probs_and_entropy(h, w, labels, temperature=1.5, chunk_size=4)

    # float64: a 1e-6 step's difference quotient errs ~1e-10 (rounding 1e-16 / 1e-6, truncation 1e-12).
    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-6, atol=1e-8)


def test_temperature_divides_logits_before_softmax():
    inp = _full_inputs(11)
    logits = inp["logits"].clone().requires_grad_(True)
    pre_divided = (inp["logits"] / 0.6).requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, inp["labels"], temperature=0.6)
    lp_ref, ent_ref = vocab_parallel_log_probs_and_entropy(pre_divided, inp["labels"])
    # Two float32 paths, each within the VOCAB-term rounding bound of the exact value: twice it apart.
    x_scale = _scale(pre_divided)
    assert_within(max_abs_diff(lp, lp_ref), 2 * rounding_bound(LOGITS_TERMS, x_scale), "temperature lp")
    assert_within(max_abs_diff(ent, ent_ref), 2 * rounding_bound(LOGITS_TERMS, x_scale), "temperature ent")
    _loss(lp, ent, inp).backward()
    _loss(lp_ref, ent_ref, inp).backward()
    # d/d logits = d/d (logits / T) / T
    g_scale = (_scale(inp["g_lp"]) + _scale(inp["g_h"]) * x_scale) / 0.6
    assert_within(
        max_abs_diff(logits.grad, pre_divided.grad / 0.6), 2 * rounding_bound(LOGITS_TERMS, g_scale), "temperature grad"
    )
    assert (lp - _reference(inp["logits"], inp["labels"], 1.0)[0]).abs().max() > 0.1  # T ignored: ~1


@pytest.mark.parametrize("chunk_size", [1, 4, 21, 1000])
def test_chunked_equals_unchunked(chunk_size):
    inp = _full_inputs(12)
    outs = []
    for cs in (None, chunk_size):
        logits = inp["logits"].clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(logits, inp["labels"], temperature=0.9, chunk_size=cs)
        hidden = inp["hidden"].clone().requires_grad_(True)
        weight = inp["weight"].clone().requires_grad_(True)
        llp, lent = fused_linear_log_probs_and_entropy(hidden, weight, inp["labels"], chunk_size=cs)
        (_loss(lp, ent, inp) + _loss(llp, lent, inp)).backward()
        outs.append([lp, ent, logits.grad, llp, lent, hidden.grad, weight.grad])
    # From logits, chunking only splits rows: bit-identical. From hidden states, the backward's
    # vocabulary slices change the matmuls' summation order: float32 rounding only, two paths each
    # within the LINEAR_TERMS bound of the exact value (values scaled like the logits, grads like
    # the upstream grads times the logits and the weights).
    lin_x_scale = _scale(inp["hidden"].abs() @ inp["weight"].abs().t())
    lin_g_scale = (_scale(inp["g_lp"]) + _scale(inp["g_h"]) * lin_x_scale) * _scale(
        torch.cat([inp["hidden"].flatten(), inp["weight"].flatten()])
    )
    for i, (unchunked, chunked) in enumerate(zip(*outs)):
        if i < 3:
            torch.testing.assert_close(chunked, unchunked, atol=0, rtol=0)
        else:
            scale = lin_x_scale if i < 5 else lin_g_scale
            assert_within(
                max_abs_diff(chunked, unchunked),
                2 * rounding_bound(LINEAR_TERMS, scale),
                f"chunk_size={chunk_size} output {i}",
            )


def test_chunked_saves_only_logits_and_per_token_stats():
    inp = _full_inputs(13)
    logits = inp["logits"].clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_log_probs_and_entropy(logits, inp["labels"], chunk_size=4)
    num_tokens = logits.numel() // VOCAB
    big = [t for t in saved if t.numel() > num_tokens]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()  # the input itself, no copy
    assert all(t.numel() == num_tokens for t in saved if t is not big[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_not_modified(dtype):
    inp = _full_inputs(14)
    logits = inp["logits"].to(dtype).requires_grad_(True)
    hidden = inp["hidden"].to(dtype).requires_grad_(True)
    weight = inp["weight"].to(dtype).requires_grad_(True)
    before = [t.detach().clone() for t in (logits, hidden, weight)]
    for cs in (None, 4):
        lp, ent = vocab_parallel_log_probs_and_entropy(logits, inp["labels"], temperature=0.5, chunk_size=cs)
        llp, lent = fused_linear_log_probs_and_entropy(hidden, weight, inp["labels"], temperature=0.5, chunk_size=cs)
        (_loss(lp, ent, inp) + _loss(llp, lent, inp)).backward()
    for tensor, copy in zip((logits, hidden, weight), before):
        assert torch.equal(tensor.detach(), copy)
        assert tensor.grad.dtype == dtype and tensor.grad.data_ptr() != tensor.data_ptr()


def test_bf16_inputs_use_float32_math():
    inp = _full_inputs(15)
    logits = inp["logits"].to(torch.bfloat16)
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, inp["labels"], chunk_size=5)
    lp_ref, ent_ref = _reference(logits.double(), inp["labels"], 1.0)
    assert lp.dtype == ent.dtype == torch.float32
    # The float32 bound on the bf16 values (exact in float64); bf16 math would err ~2^-8 * |x| ~ 5e-2.
    x_scale = _scale(logits.double())
    _assert_fp32_close(lp, lp_ref, LOGITS_TERMS, x_scale, "bf16 lp")
    _assert_fp32_close(ent, ent_ref, LOGITS_TERMS, x_scale, "bf16 ent")
    # From bf16 hidden/weight the logits are formed in float32, unlike a bf16 matmul.
    hidden, weight = inp["hidden"].to(torch.bfloat16), inp["weight"].to(torch.bfloat16)
    llp, lent = fused_linear_log_probs_and_entropy(hidden, weight, inp["labels"], chunk_size=5)
    ref_lp, ref_ent = _reference(hidden.double() @ weight.double().t(), inp["labels"], 1.0)
    lin_x_scale = _scale(hidden.double().abs() @ weight.double().abs().t())
    _assert_fp32_close(llp, ref_lp, LINEAR_TERMS, lin_x_scale, "bf16 lin_lp")
    _assert_fp32_close(lent, ref_ent, LINEAR_TERMS, lin_x_scale, "bf16 lin_ent")


def test_only_one_output_used():
    inp = _full_inputs(16)
    g_scale = _scale(inp["g_lp"]) * _scale(inp["logits"])
    for use in ("lp", "ent"):
        logits = inp["logits"].clone().requires_grad_(True)
        ref_logits = inp["logits"].double().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(logits, inp["labels"], chunk_size=6)
        rlp, rent = _reference(ref_logits, inp["labels"], 1.0)
        ((lp if use == "lp" else ent) * inp["g_lp"]).sum().backward()
        ((rlp if use == "lp" else rent) * inp["g_lp"].double()).sum().backward()
        _assert_fp32_close(logits.grad, ref_logits.grad, LOGITS_TERMS, g_scale, f"only {use} grad")
    hidden = inp["hidden"].clone().requires_grad_(True)  # frozen output weight: hidden grad only
    llp, _ = fused_linear_log_probs_and_entropy(hidden, inp["weight"], inp["labels"], compute_entropy=False)
    (llp * inp["g_lp"]).sum().backward()
    ref_hidden = inp["hidden"].double().requires_grad_(True)
    rlp, _ = _reference(ref_hidden @ inp["weight"].double().t(), inp["labels"], 1.0)
    (rlp * inp["g_lp"].double()).sum().backward()
    _assert_fp32_close(
        hidden.grad, ref_hidden.grad, LINEAR_TERMS, _scale(inp["g_lp"]) * _scale(inp["weight"]), "only lp hidden grad"
    )


def test_bad_inputs_raise_clear_value_errors():
    logits, labels = torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3))
    f = vocab_parallel_log_probs_and_entropy
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 8\) \(vocab/tp x tp\); got min 0, max 8"):
        f(logits, torch.tensor([[0, 1, 8], [2, 3, 4]]))
    with pytest.raises(ValueError, match=r"got min -1, max 4"):
        f(logits, torch.tensor([[0, 1, -1], [2, 3, 4]]))
    with pytest.raises(ValueError, match=r"labels shape \[2, 4\] must equal logits.shape\[:-1\] \[2, 3\]"):
        f(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be an integer tensor of token ids, got dtype torch.float32"):
        f(logits, labels.float())
    with pytest.raises(ValueError, match=r"temperature=0.0 must be a number > 0"):
        f(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match=r"chunk_size=0 must be None or an int >= 1"):
        f(logits, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"logits must be a floating tensor"):
        f(labels, labels)
    hidden, weight = torch.randn(2, 3, 4), torch.randn(8, 4)
    g = fused_linear_log_probs_and_entropy
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 8\)"):
        g(hidden, weight, torch.full((2, 3), 9))
    with pytest.raises(ValueError, match=r"hidden \[2, 3, 4\] must be \[..., h\] and weight \[8, 5\]"):
        g(hidden, torch.randn(8, 5), labels)
    with pytest.raises(ValueError, match="weight dtype torch.bfloat16 must equal hidden dtype torch.float32"):
        g(hidden, weight.bfloat16(), labels)


def test_float32_error_against_float64_at_a_real_vocabulary_size():
    # Sums over 32k terms: the per-token reductions must be as accurate as the naive float32
    # path, whose reductions are cascade (pairwise) sums erring by eps * log2(n) * scale
    # (Higham 4.2), 1.8e-5 here; a sequential dot product errs 1.5e-4 on entropy, 40x the naive.
    gen = torch.Generator().manual_seed(17)
    logits, labels = torch.randn(32, 32000, generator=gen) * 2, torch.randint(0, 32000, (32,), generator=gen)
    x64 = logits.double()
    lp64 = x64.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent64 = torch.logsumexp(x64, -1) - (x64.softmax(-1) * x64).sum(-1)
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, chunk_size=8)
    naive_lp, naive_ent = _reference(logits, labels, 1.0)
    x_scale = _scale(logits)
    pairwise = rounding_bound(math.ceil(math.log2(logits.shape[-1])), x_scale)
    for what, got, naive, exact in (("lp", lp, naive_lp, lp64), ("ent", ent, naive_ent, ent64)):
        err, naive_err = max_abs_diff(got, exact), max_abs_diff(naive, exact)
        assert_within(err, pairwise, f"32k {what}")
        # ... and no worse than twice the naive path's error, plus one rounding of the largest logit.
        assert_within(err, 2 * naive_err + rounding_bound(1, x_scale), f"32k {what} vs naive")


def test_no_tokens_gives_empty_results_and_grads():
    logits = torch.randn(0, 4, 8, requires_grad=True)
    hidden, weight = torch.randn(0, 4, 3, requires_grad=True), torch.randn(8, 3, requires_grad=True)
    labels = torch.zeros(0, 4, dtype=torch.long)
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, chunk_size=2)
    llp, lent = fused_linear_log_probs_and_entropy(hidden, weight, labels, chunk_size=2)
    assert lp.shape == ent.shape == llp.shape == lent.shape == (0, 4)
    (lp.sum() + ent.sum() + llp.sum() + lent.sum()).backward()
    assert logits.grad.shape == (0, 4, 8) and hidden.grad.shape == (0, 4, 3)
    assert torch.equal(weight.grad, torch.zeros(8, 3))


def _padded_vocab_case(rank, world_size):
    """Weight rows padded past the real vocabulary: padded rows must not enter the softmax."""
    import torch.distributed as dist

    from parallel.vocab_parallel import fused_linear_log_probs_and_entropy

    g = torch.Generator().manual_seed(3)
    vocab, padded, hidden_size, n = 13, 16, 8, 10
    hidden = torch.randn(n, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, hidden_size, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,), generator=g)
    ref_logits = hidden @ weight[:vocab].t()
    ref_lp = ref_logits.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    ref_h = -(ref_logits.softmax(-1) * ref_logits.log_softmax(-1)).sum(-1)
    group = dist.group.WORLD if world_size > 1 else None
    rows = padded // world_size
    w_local = weight[rank * rows : (rank + 1) * rows].clone().requires_grad_(True)
    lp, h = fused_linear_log_probs_and_entropy(hidden, w_local, labels, tp_group=group, vocab_size=vocab, chunk_size=4)
    (lp.sum() + h.sum()).backward()
    return (
        float((lp - ref_lp).abs().max()),
        float((h - ref_h).abs().max()),
        w_local.grad[max(vocab - rank * rows, 0) :].abs().max().item() if vocab - rank * rows < rows else 0.0,
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_linear_excludes_padded_vocab_rows(world_size):
    for lp_diff, h_diff, pad_grad in run_distributed(_padded_vocab_case, world_size):
        assert lp_diff < 1e-10 and h_diff < 1e-10  # float64: ~1e-15 rounding; a padded row in the softmax: ~1e-1
        assert pad_grad == 0.0


def test_fused_linear_rejects_a_rank_holding_only_padding():
    hidden, weight = torch.randn(2, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"vocab_size=9 must be in \(0, 8\]"):
        fused_linear_log_probs_and_entropy(hidden, weight, torch.zeros(2, dtype=torch.long), vocab_size=9)


def _sum_pi_squared_case(rank, world_size):
    """``sum_v p_v^2`` from the fused pass (fp32, chunked, padded vocabulary, temperature) on this rank's
    vocabulary shard, against the full-vocabulary softmax in float64; log-probs / entropy unchanged by it."""
    import torch.distributed as dist

    from parallel.vocab_parallel import fused_linear_log_probs_and_entropy
    from tests.numerics import rounding_bound

    g = torch.Generator().manual_seed(11)
    vocab, padded, hidden_size, n, temperature = 61, 64, 16, 23, 0.8
    hidden = torch.randn(n, hidden_size, generator=g) * 2
    weight = torch.randn(padded, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    probs = ((hidden.double() @ weight[:vocab].double().t()) / temperature).softmax(-1)  # [n, vocab]
    # sum_v p_v^2 <= 1, but a logit's float32 error (its matmul's, scaled by sum |h| |w| / T) moves it too.
    x_scale = max(1.0, float((hidden.double().abs() @ weight.double().abs().t()).max()) / temperature)
    bound = rounding_bound(hidden_size + vocab, x_scale)
    group = dist.group.WORLD if world_size > 1 else None
    rows = padded // world_size
    w_local = weight[rank * rows : (rank + 1) * rows].clone()
    out = {}
    for entropy in (True, False):
        lp, ent, sq = fused_linear_log_probs_and_entropy(
            hidden,
            w_local,
            labels,
            tp_group=group,
            vocab_size=vocab,
            chunk_size=5,
            temperature=temperature,
            compute_entropy=entropy,
            return_sum_pi_squared=True,
        )
        lp0, ent0 = fused_linear_log_probs_and_entropy(
            hidden,
            w_local,
            labels,
            tp_group=group,
            vocab_size=vocab,
            chunk_size=5,
            temperature=temperature,
            compute_entropy=entropy,
        )
        same = torch.equal(lp, lp0) and (ent is None or torch.equal(ent, ent0))
        out[entropy] = (
            float((sq.double() - probs.square().sum(-1)).abs().max()),
            sq.dtype == torch.float32,
            same,
            sq.requires_grad,
            sq,
            bound,
        )
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_sum_pi_squared_equals_full_vocabulary_reference(world_size):
    single = _sum_pi_squared_case(0, 1)
    for result in run_distributed(_sum_pi_squared_case, world_size):
        for entropy, (err, fp32, same, grad, sq, bound) in result.items():
            # The padded rows in the softmax or the temperature left out move it by > 1e-2.
            assert_within(err, bound, f"sum_pi_squared tp={world_size} entropy={entropy}")
            assert fp32 and same and not grad, (world_size, entropy, err)
            # TP=2 equals TP=1: two float32 paths, each within the bound of the exact value.
            assert_within(max_abs_diff(sq, single[entropy][4]), 2 * bound, f"sum_pi_squared tp={world_size} vs tp=1")
