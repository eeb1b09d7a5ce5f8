"""DAPO overlong reward shaping and dynamic-sampling group filtering."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from megatron_rl.algos.dapo import apply_overlong_penalty, compute_filter_metric, filter_groups, overlong_penalty
from tests.numerics import rounding_bound


def test_overlong_penalty_hand_computed():
    # max 64, buffer 16: free up to 48 tokens, then -1/16 per token down to -1 at 64
    lengths = torch.tensor([10, 48, 49, 56, 64])
    out = overlong_penalty(lengths, max_resp_len=64, buffer_len=16, penalty_factor=1.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [0.0, 0.0, -1 / 16, -0.5, -1.0]
    half = overlong_penalty(lengths, max_resp_len=64, buffer_len=16, penalty_factor=0.5)
    assert half.tolist() == [0.0, 0.0, -1 / 32, -0.25, -0.5]
    # verl does not clamp past max_resp_len: 8 tokens over keeps the slope
    assert overlong_penalty(torch.tensor([72]), 64, 16, 1.0).tolist() == [-1.5]
    assert overlong_penalty(torch.tensor([3.0, 4.0]), 4, 4, 2.0).tolist() == [-1.5, -2.0]


@settings(max_examples=80, deadline=None, database=None)
@given(
    st.integers(1, 512),
    st.integers(1, 512),
    st.floats(0.0, 5.0),
    st.lists(st.integers(0, 1024), min_size=1, max_size=20),
)
def test_overlong_penalty_is_zero_then_linear(max_len, buffer, factor, lengths):
    if buffer > max_len:
        max_len, buffer = buffer, max_len
    out = overlong_penalty(torch.tensor(lengths), max_len, buffer, factor).tolist()
    start = max_len - buffer
    for length, value in zip(lengths, out):
        if length <= start:
            assert value == 0.0
        else:
            # float32 rounds the division, the factor and the product (relative); a factor below float32's
            # subnormal range leaves (length - start) / buffer <= 2^10 times 2^-149
            assert value == pytest.approx(
                -(length - start) / buffer * factor, rel=rounding_bound(3, 1.0), abs=2.0**-139
            )
    at_max = overlong_penalty(torch.tensor([max_len]), max_len, buffer, factor).item()
    # buffer / buffer = 1 exactly: only the factor's float32 rounding (or its underflow below 2^-149)
    assert at_max == pytest.approx(-factor, rel=rounding_bound(1, 1.0), abs=2.0**-149)


def test_overlong_penalty_rejects_bad_buffers():
    with pytest.raises(ValueError, match=r"overlong_buffer.len=0 must be > 0"):
        overlong_penalty(torch.tensor([1]), 64, 0, 1.0)
    with pytest.raises(ValueError, match=r"max_resp_len=8 must be >= overlong_buffer.len=16"):
        overlong_penalty(torch.tensor([1]), 8, 16, 1.0)
    with pytest.raises(ValueError, match="max_resp_len must be set"):
        apply_overlong_penalty(torch.zeros(1), torch.tensor([1]), None, {"enable": True, "len": 4})


@pytest.mark.parametrize(
    "cfg",
    [
        OmegaConf.create({"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}),
        {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True},
    ],
)
def test_apply_overlong_penalty_adds_to_scores(cfg):
    scores = torch.tensor([1.0, 1.0, 0.0, -1.0])
    rewards, extra = apply_overlong_penalty(scores, torch.tensor([4, 6, 7, 8]), 8, cfg)
    assert rewards.tolist() == [1.0, 0.5, -0.75, -2.0]
    assert extra["overlong_reward"].tolist() == [0.0, -0.5, -0.75, -1.0]
    assert extra["overlong"].tolist() == [False, True, True, True]


def test_apply_overlong_penalty_disabled_or_unlogged():
    scores = torch.tensor([1.0, 0.0])
    assert apply_overlong_penalty(scores, torch.tensor([100, 200]), 8, None) == (scores, {})
    assert apply_overlong_penalty(scores, torch.tensor([100, 200]), 8, {"enable": False, "len": 4})[0] is scores
    rewards, extra = apply_overlong_penalty(
        scores, torch.tensor([8, 2]), 8, {"enable": True, "len": 4, "penalty_factor": 0.5}
    )
    assert rewards.tolist() == [0.5, 0.0] and extra == {}


def test_filter_groups_hand_computed():
    values = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    uids = ["a", "a", "a", "b", "b", "b", "c", "c", "d"]
    keep, kept, metrics = filter_groups(values, uids)
    # a: all 1 -> dropped; b: varies -> kept; c: all 0 -> dropped; d: a single sample -> kept
    assert keep.tolist() == [False, False, False, True, True, True, False, False, True]
    assert kept.tolist() == [3, 4, 5, 8]
    assert metrics == {
        "filter_groups/num_groups": 4.0,
        "filter_groups/num_kept_groups": 2.0,
        "filter_groups/num_filtered_groups": 2.0,
        "filter_groups/num_kept_samples": 4.0,
        "filter_groups/kept_group_ratio": 0.5,
    }


def test_filter_groups_interleaved_and_tensor_labels():
    values = torch.tensor([0.5, 0.5, 0.5, 0.7])
    keep, kept, metrics = filter_groups(values, torch.tensor([7, 3, 7, 3]))
    assert keep.tolist() == [False, True, False, True] and kept.tolist() == [1, 3]
    assert metrics["filter_groups/num_kept_groups"] == 1.0
    keep, _, _ = filter_groups(np.array([2.0, 2.0]), np.array(["x", "x"], dtype=object))
    assert keep.tolist() == [False, False]
    with pytest.raises(ValueError, match="metric_values has 3 entries but index has 2"):
        filter_groups([1.0, 2.0, 3.0], ["a", "b"])


@settings(max_examples=80, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.0, 1.0, -1.0, 0.25])), min_size=1, max_size=40))
def test_filter_groups_drops_exactly_the_all_equal_groups(samples):
    uids = [f"u{g}" for g, _ in samples]
    values = [v for _, v in samples]
    keep, kept, metrics = filter_groups(values, uids)
    by_group = {}
    for uid, value in zip(uids, values):
        by_group.setdefault(uid, []).append(value)
    informative = {uid for uid, vals in by_group.items() if len(vals) == 1 or len(set(vals)) > 1}
    assert keep.tolist() == [uid in informative for uid in uids]
    assert kept.tolist() == [i for i, uid in enumerate(uids) if uid in informative]
    assert metrics["filter_groups/num_kept_groups"] == len(informative)
    assert metrics["filter_groups/num_groups"] == len(by_group)


def test_compute_filter_metric():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5]])
    rewards = torch.tensor([[0.1, 0.9, 0.0], [0.0, -0.2, 0.5]])
    assert compute_filter_metric("seq_reward", token_level_scores=scores).tolist() == [1.0, 0.5]
    assert compute_filter_metric("reward", token_level_scores=scores).tolist() == [1.0, 0.5]
    final = compute_filter_metric("seq_final_reward", token_level_rewards=rewards)
    assert final.dtype == torch.float64 and final.tolist() == pytest.approx([1.0, 0.3])
    assert compute_filter_metric("acc", reward_extra_info={"acc": [1, 0]}).tolist() == [1.0, 0.0]
    assert compute_filter_metric("score", reward_extra_info={"score": torch.tensor([0.5, 2.0])}).tolist() == [0.5, 2.0]
    with pytest.raises(
        ValueError,
        match=r"filter_groups.metric='acc' is not available; choose one of \['seq_final_reward', 'seq_reward', 'reward', 'score'\]",
    ):
        compute_filter_metric("acc", reward_extra_info={"score": [1.0]})
    with pytest.raises(ValueError, match="filter_groups.metric='seq_final_reward' needs token_level_rewards"):
        compute_filter_metric("seq_final_reward", token_level_scores=scores)
