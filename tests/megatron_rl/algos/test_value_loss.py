"""compute_value_loss (clipped critic loss) and compute_entropy_loss, by hand and by property."""

import math
import re

import pytest
import torch

from megatron_rl.algos.loss_agg import LOSS_AGG_MODES, global_batch_info
from megatron_rl.algos.value_loss import compute_entropy_loss, compute_value_loss
from tests.numerics import assert_close_within, rounding_bound


def test_value_loss_hand_case():
    # token 1: prediction moved 0.5 away from the old value 0.5 (clip range 0.2, clipped to 0.7);
    #          unclipped (1 - 0)^2 = 1 > clipped 0.7^2 = 0.49 -> 1, gradient flows.
    # token 2: moved from 1 to 2 = the return; unclipped 0, clipped (1.2 - 2)^2 = 0.64 wins, no gradient.
    vpreds = torch.tensor([[1.0, 2.0]], requires_grad=True)
    values = torch.tensor([[0.5, 1.0]])
    returns = torch.tensor([[0.0, 2.0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=0.2)
    vf_loss.backward()
    assert vf_loss.item() == pytest.approx(0.5 * (1.0 + 0.64) / 2, rel=1e-6)
    assert vf_clipfrac.item() == pytest.approx(0.5)
    # d/dv of 0.5 * (v - R)^2 / N = (v - R) / N
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.5, 0.0]]))


def test_value_loss_inside_clip_range_is_half_mse():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 5, generator=g)
    vpreds = values + 0.05 * torch.randn(4, 5, generator=g)
    returns = torch.randn(4, 5, generator=g)
    mask = torch.ones(4, 5)
    mask[2, 3:] = 0
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    mse = (((vpreds - returns) ** 2) * mask).sum() / mask.sum()
    assert vf_loss.item() == pytest.approx(0.5 * mse.item(), rel=1e-6)
    assert vf_clipfrac.item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_microbatch_split_equals_whole(mode):
    g = torch.Generator().manual_seed(1)
    values, returns = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    vpreds = values + 0.4 * torch.randn(6, 4, generator=g)
    mask = (torch.rand(6, 4, generator=g) > 0.3).float()
    mask[2] = 0
    whole, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, mode)
    info = global_batch_info(mask)
    parts = sum(
        compute_value_loss(vpreds[s], returns[s], values[s], mask[s], 0.2, mode, **info)[0]
        for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.isfinite(whole)


def test_value_loss_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=re.escape("vpreds[2, 3], returns[2, 2]")):
        compute_value_loss(x, x[:, :2], x, x, 0.2)
    with pytest.raises(ValueError, match=re.escape("cliprange_value=-0.1 must be >= 0")):
        compute_value_loss(x, x, x, x, -0.1)
    with pytest.raises(ValueError, match="choose one of"):
        compute_value_loss(x, x, x, x, 0.2, "mean")


def test_entropy_loss_hand_case():
    # row 1: uniform over 4 -> ln 4; row 2: two equally likely tokens -> ln 2; row 3: masked
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0]], [[3.0, 3.0, -1e4, -1e4]], [[5.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[1.0], [1.0], [0.0]])
    assert compute_entropy_loss(logits, mask).item() == pytest.approx((math.log(4) + math.log(2)) / 2, rel=1e-6)
    assert compute_entropy_loss(logits, mask, "token-sum").item() == pytest.approx(math.log(8), rel=1e-6)


def test_entropy_loss_gradient_matches_definition():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 7, generator=g, requires_grad=True)
    ref_logits = logits.detach().clone().requires_grad_(True)
    mask = torch.ones(3, 4)
    mask[1, 2:] = 0
    loss = compute_entropy_loss(logits, mask, "seq-mean-token-mean")
    p = torch.softmax(ref_logits, -1)
    ent = -(p * torch.log_softmax(ref_logits, -1)).sum(-1)
    ref = ((ent * mask).sum(-1) / mask.sum(-1)).mean()
    loss.backward()
    ref.backward()
    # Two float32 paths to the entropy over 7 logits: log p errs by eps * (7 + 2) * max(1, |log p|), H by
    # 7 times that again; then the token and sequence means (4 + 3 terms). The gradient
    # -p (log p + H) / (tokens * bs) carries the same error times p / (tokens * bs).
    num_terms, log_scale = 2 * (7 + 2) + 4 + 3, max(1.0, float(p.detach().log().abs().max()))
    assert loss.item() == pytest.approx(ref.item(), abs=2 * rounding_bound(num_terms, log_scale))
    grad_scale = float((p.detach() / (mask.sum(-1) * mask.shape[0])[:, None, None]).max()) * log_scale
    assert_close_within(logits.grad, ref_logits.grad, 2 * rounding_bound(num_terms, grad_scale), "entropy grad")


def test_entropy_loss_shape_error():
    with pytest.raises(ValueError, match=re.escape("logits[2, 3, 5] must be response_mask[2, 4] + [vocab]")):
        compute_entropy_loss(torch.zeros(2, 3, 5), torch.ones(2, 4))
