"""agg_loss: every mode by hand, empty rows, and micro-batch / data-parallel invariance."""

import re

import pytest
import torch
import torch.distributed as dist

from megatron_rl.algos.loss_agg import LOSS_AGG_MODES, agg_loss, global_batch_info
from parallel.testing import run_distributed
from tests.numerics import assert_close_within, rounding_bound

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])

# Row sums 3 and 4, row token counts 2 and 1, 3 valid tokens, T = 3.
HAND = {
    "token-mean": 7 / 3,
    "token-sum": 7.0,
    "seq-mean-token-sum": (3 + 4) / 2,
    "seq-mean-token-mean": (3 / 2 + 4 / 1) / 2,
    "seq-mean-token-sum-norm": (3 + 4) / 2 / 3,
}
# Integer losses and counts: every sum is exact in float32, only the (at most 4) divisions and scalings round.
HAND_REL = rounding_bound(4, 1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_each_mode_by_hand(mode):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(HAND[mode], rel=HAND_REL)


def test_seq_mean_token_sum_norm_uses_loss_scale_factor():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_batch_numbers_and_dp_size(mode):
    # 10 tokens / 4 sequences in the global batch, 2 DP ranks: the local sum is rescaled.
    loss = agg_loss(LOSS, MASK, mode, dp_size=2, batch_num_tokens=10, global_batch_size=4, loss_scale_factor=5)
    expected = {
        "token-mean": 7 / 10 * 2,
        "token-sum": 7 * 2,
        "seq-mean-token-sum": 7 / 4 * 2,
        "seq-mean-token-mean": 5.5 / 4 * 2,
        "seq-mean-token-sum-norm": 7 / 4 * 2 / 5,
    }[mode]
    assert loss.item() == pytest.approx(expected, rel=HAND_REL)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_rows_contribute_zero_not_nan(mode):
    # The extra row holds inf/NaN in its (masked) entries: they must not leak in.
    loss_mat = torch.cat([LOSS, torch.tensor([[float("nan"), float("inf"), -float("inf")]])])
    mask = torch.cat([MASK, torch.zeros(1, 3)])
    assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(HAND[mode], rel=HAND_REL)
    # A batch with no valid token at all gives 0.
    empty = agg_loss(torch.randn(2, 3), torch.zeros(2, 3), mode)
    assert empty.item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_bool_mask_equals_float_mask(mode):
    assert agg_loss(LOSS, MASK.bool(), mode).item() == pytest.approx(HAND[mode], rel=HAND_REL)


def _batch(seed=0, bs=8, T=6):
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(bs, T, generator=g)
    lengths = torch.randint(1, T + 1, (bs,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    mask[3] = 0  # one sequence with no valid token (e.g. fully rejected)
    return loss_mat, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("scale_factor", [None, 11])
def test_microbatch_and_dp_split_equals_whole_batch(mode, scale_factor):
    """2 DP ranks x 2 micro-batches (uneven): sum micro losses per rank, average ranks -> whole loss."""
    loss_mat, mask = _batch()
    whole_input = loss_mat.clone().requires_grad_(True)
    whole = agg_loss(whole_input, mask, mode, loss_scale_factor=scale_factor)
    whole.backward()

    split_input = loss_mat.clone().requires_grad_(True)
    row_slices = [[slice(0, 1), slice(1, 4)], [slice(4, 6), slice(6, 8)]]  # [rank][micro]
    info = global_batch_info([mask[s] for rank in row_slices for s in rank], dp_size=2, loss_scale_factor=scale_factor)
    assert info["batch_num_tokens"] == int(mask.sum()) and info["global_batch_size"] == 7
    rank_losses = [sum(agg_loss(split_input[s], mask[s], mode, **info) for s in rank) for rank in row_slices]
    total = sum(rank_losses) / 2  # DP gradient reduction averages over ranks
    total.backward()

    # Two float32 orders of one masked sum over the 48 tokens, then a few divisions and the micro/rank sums:
    # each errs by eps * (48 + 4) * the same aggregate of |loss|; a gradient is a mask over a product of
    # a few scalars (no reduction), a few roundings of its own size.
    magnitude = float(agg_loss(loss_mat.abs(), mask, mode, loss_scale_factor=scale_factor))
    assert total.dtype == whole.dtype
    assert_close_within(total, whole, 2 * rounding_bound(loss_mat.numel() + 4, magnitude), f"{mode} loss")
    assert_close_within(
        split_input.grad, whole_input.grad, 2 * rounding_bound(4, float(whole_input.grad.abs().max())), f"{mode} grad"
    )


def _dp_rank_grads(rank, world_size):
    """One DP rank: its shard in two micro-batches, a shared weight, gradients averaged over ranks."""
    loss_mat, mask = _batch(seed=3, bs=6)
    shard = slice(rank * 3, rank * 3 + 3)
    micro = [slice(shard.start, shard.start + 1), slice(shard.start + 1, shard.stop)]
    info = global_batch_info(mask, dp_size=world_size)  # computed from the global mask
    out = {}
    for mode in LOSS_AGG_MODES:
        weight = torch.linspace(0.5, 1.5, loss_mat.shape[1]).requires_grad_(True)
        loss = sum(agg_loss(loss_mat[m] * weight, mask[m], mode, **info) for m in micro)
        loss.backward()
        dist.all_reduce(weight.grad)
        value = loss.detach().clone()
        dist.all_reduce(value)
        out[mode] = ((value / world_size).item(), (weight.grad / world_size).tolist())
    return out


def test_gloo_data_parallel_gradient_equals_single_rank():
    """Real gloo ranks: all-reduced (averaged) gradients equal the single-process whole-batch ones."""
    loss_mat, mask = _batch(seed=3, bs=6)
    results = run_distributed(_dp_rank_grads, 2)
    for mode in LOSS_AGG_MODES:
        weight = torch.linspace(0.5, 1.5, loss_mat.shape[1]).requires_grad_(True)
        whole = agg_loss(loss_mat * weight, mask, mode)
        whole.backward()
        # The same reductions as |loss|'s: eps * (terms + 4) * its aggregate, for the loss over the 36 tokens,
        # for a weight's gradient over the 6 rows of its column (+ the all-reduce); two paths: twice that.
        abs_weight = weight.detach().clone().requires_grad_(True)
        magnitude = agg_loss(loss_mat.abs() * abs_weight, mask, mode)
        magnitude.backward()
        value_bound = 2 * rounding_bound(loss_mat.numel() + 4, magnitude.item())
        grad_bound = 2 * rounding_bound(loss_mat.shape[0] + 4, float(abs_weight.grad.abs().max()))
        for per_rank in results:
            value, grad = per_rank[mode]
            assert value == pytest.approx(whole.item(), abs=value_bound), mode
            assert_close_within(torch.tensor(grad), weight.grad, grad_bound, f"{mode} weight grad")


def test_global_batch_info_counts():
    info = global_batch_info([MASK, torch.zeros(1, 3)], dp_size=4, loss_scale_factor=9)
    assert info == {"dp_size": 4, "batch_num_tokens": 3, "global_batch_size": 2, "loss_scale_factor": 9}


def test_unknown_mode_lists_the_allowed_modes():
    with pytest.raises(ValueError) as err:
        agg_loss(LOSS, MASK, "token-avg")
    assert "'token-avg'" in str(err.value)
    for mode in LOSS_AGG_MODES:
        assert mode in str(err.value)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=re.escape("loss_mat[2, 3], loss_mask[2, 2]")):
        agg_loss(LOSS, MASK[:, :2], "token-mean")


@pytest.mark.parametrize(
    "mode,missing", [("token-mean", "batch_num_tokens"), ("seq-mean-token-sum", "global_batch_size")]
)
def test_dp_without_global_numbers_is_an_error(mode, missing):
    with pytest.raises(ValueError, match=missing):
        agg_loss(LOSS, MASK, mode, dp_size=2)


def test_token_mean_tensor_batch_num_tokens():
    # batch_num_tokens may arrive as a tensor (e.g. after an all-reduce).
    loss = agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=torch.tensor(14))
    assert loss.item() == pytest.approx(7 / 14)
