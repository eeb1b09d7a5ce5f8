"""Attention over packed rows (``megatron_rl.models.attention``): every implementation equals each
row attended alone, values and gradients; the module's choice and its refusals."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.models.attention import SDPAttention, check_packing_support, document_attention, packed_attention_impl
from tests.numerics import rounding_bound

LENGTHS = [7, 1, 12, 3, 1, 8]  # ragged rows, two of a single token
HEADS, KV_HEADS, DIM = 4, 2, 16


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    q = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(t, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(t, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    return q, k, v, bounds


def _float32_bound(q, k, v, scale) -> float:
    """One float32 attention against the exact: q.k over DIM, the softmax and p.v over at most max(LENGTHS)
    keys; the scores' error (at their largest |q.k| * scale, at least 1) moves p relatively, p.v carries it
    at |v|'s scale."""
    scores = torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(HEADS // KV_HEADS, dim=1))
    score = max(1.0, float(scores.abs().max()) * scale)
    return rounding_bound(DIM + 2 * max(LENGTHS) + 2, score * float(v.abs().max()))


def _rows_alone(q, k, v, bounds, scale):
    """Each row through a padded batch of one: causal SDPA over [1, heads, s, d]."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        ki, vi = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (ki, vi))
        out.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("impl", ["segments", "masked"])
def test_document_attention_equals_every_row_alone_with_gradients(impl):
    q, k, v, bounds = _inputs()
    scale = DIM**-0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = document_attention(*leaves, bounds, scale=scale, impl=impl)
    ref = _rows_alone(*ref_leaves, bounds, scale)
    assert out.shape == (sum(LENGTHS), HEADS, DIM)
    # float64 on both paths: eps64 * (DIM + 2 * 12 keys) * |scores| ~ 1e-14; a wrong mask moves them by ~1e-1
    assert float((out - ref).abs().max()) < 1e-12
    weight = torch.randn_like(ref)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for got, want in zip(leaves, ref_leaves):
        assert float((got.grad - want.grad).abs().max()) < 1e-12


def test_flex_attention_document_mask_equals_segments_forward():
    # CPU FlexAttention has no backward in torch 2.13 (the reason CPU packs with "segments").
    q, k, v, bounds = (x.float() if torch.is_tensor(x) else x for x in _inputs(1))
    with torch.no_grad():
        flex = document_attention(q, k, v, bounds, scale=0.25, impl="flex")
        seg = document_attention(q, k, v, bounds, scale=0.25, impl="segments")
    assert float((flex - seg).abs().max()) < 2 * _float32_bound(q, k, v, 0.25)  # two float32 paths


def test_impl_choice_and_bad_bounds():
    assert packed_attention_impl(torch.device("cpu")) == "segments"
    q, k, v, bounds = _inputs()
    with pytest.raises(
        ValueError, match=r"^impl='dense' is not allowed; choose one of \['segments', 'flex', 'masked'\]$"
    ):
        document_attention(q, k, v, bounds, scale=1.0, impl="dense")
    with pytest.raises(ValueError, match=r"^packed rows cover \[0, 31\) but the sequence has 32 tokens$"):
        document_attention(q, k, v, bounds[:-1] + [31], scale=1.0)


def test_sdpa_attention_module_takes_thd_packed_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v, bounds = (x.float() if torch.is_tensor(x) else x for x in _inputs(2))
    module = SDPAttention.__new__(SDPAttention)  # the forward only needs the shapes below
    torch.nn.Module.__init__(module)
    module.num_heads, module.num_groups, module.head_dim, module.softmax_scale = HEADS, KV_HEADS, DIM, 0.25
    module.dropout, module.impl = 0.0, None
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    out = module(q, k, v, None, packed_seq_params=params)
    assert out.shape == (sum(LENGTHS), HEADS * DIM)
    ref = _rows_alone(q.double(), k.double(), v.double(), bounds, 0.25).reshape(out.shape)
    assert float((out.double() - ref).abs().max()) < _float32_bound(q, k, v, 0.25)  # float32 against float64
    with pytest.raises(ValueError, match=r"^SDPAttention packs only qkv_format='thd', got 'sbhd'$"):
        module(q, k, v, None, packed_seq_params=types.SimpleNamespace(qkv_format="sbhd"))


def test_backends_that_cannot_pack_are_refused_by_name():
    check_packing_support("sdpa", context_parallel_size=1, te_importable=False)
    check_packing_support("te", context_parallel_size=2, te_importable=True)
    with pytest.raises(
        ValueError,
        match=r"^megatron.use_remove_padding=True packs rows into one THD sequence, "
        r"which model.attention_backend='local'",
    ):
        check_packing_support("local", context_parallel_size=1, te_importable=True)
    with pytest.raises(
        ValueError,
        match=r"^megatron.context_parallel_size=2 with megatron.use_remove_padding=True "
        r"needs TransformerEngine's THD attention",
    ):
        check_packing_support("auto", context_parallel_size=2, te_importable=False)


@pytest.mark.gpu
def test_flex_attention_on_cuda_equals_segments_with_gradients():
    q, k, v, bounds = (x.float().cuda() if torch.is_tensor(x) else x for x in _inputs(3))
    assert packed_attention_impl(q.device) == "flex"
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flex = document_attention(*leaves, bounds, scale=0.25, impl="flex")
    seg = document_attention(*ref_leaves, bounds, scale=0.25, impl="segments")
    assert float((flex - seg).abs().max()) < 1e-4
    flex.square().sum().backward()
    seg.square().sum().backward()
    for got, want in zip(leaves, ref_leaves):
        assert float((got.grad - want.grad).abs().max()) < 1e-3


def test_segments_run_the_fused_sdpa_kernel_not_the_math_fallback():
    # 3-D inputs would send SDPA to its math path, which stores every row's s x s weights.
    from torch.profiler import ProfilerActivity, profile

    q, k, v, bounds = (x.float() if torch.is_tensor(x) else x for x in _inputs(4))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        document_attention(q, k, v, bounds, scale=0.25, impl="segments")
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
