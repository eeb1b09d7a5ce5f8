"""verl's multi-output advantage rule against a hand-computed case.

Group ``a`` has three sessions: session 0 with one output, session 1 with three (indices 0, 1, 2;
its final output is index 2), session 2 with no output at all (absent). Group ``b`` has two
sessions of one output each. Scores sit on each row's last response token.
"""

import math

import numpy as np
import pytest
import torch

from megatron_rl.algos.advantage import compute_grpo_outcome_advantage
from megatron_rl.algos import compute_advantage_for_multi_trajectories
from megatron_rl.algos.multi_trajectory import (
    parse_trajectory_key,
    trajectory_keys,
)
from tests.numerics import assert_close_within, group_advantage_bound, rounding_bound

KEYS = ["a_0_0", "a_1_0", "a_1_1", "a_1_2", "b_0_0", "b_1_0"]
SCORES = [1.0, 5.0, 7.0, 3.0, 2.0, 0.0]  # the non-final outputs of a_1 (5 and 7) must not count
MASK = torch.tensor(
    [
        [1, 1, 0, 0],
        [0, 1, 1, 0],  # a response starting after observation tokens
        [1, 0, 1, 1],  # a hole: an observation inside the response
        [1, 1, 1, 0],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
    ],
    dtype=torch.float32,
)


def _rewards():
    rewards = torch.zeros(MASK.shape)
    for row, score in enumerate(SCORES):
        rewards[row, int(MASK[row].nonzero().max())] = score
    return rewards


def test_grpo_uses_each_sessions_final_output_and_broadcasts_it():
    adv, ret = compute_advantage_for_multi_trajectories(_rewards(), MASK, KEYS, "grpo")
    # Group a over the final outputs {a_0: 1, a_1: 3}: mean 2, unbiased std sqrt(2).
    # Group b over {2, 0}: mean 1, std sqrt(2).
    eps, s = 1e-6, math.sqrt(2.0)
    a0, a1, b0, b1 = (1 - 2) / (s + eps), (3 - 2) / (s + eps), (2 - 1) / (s + eps), (0 - 1) / (s + eps)
    per_row = torch.tensor([a0, a1, a1, a1, b0, b1])
    expected = per_row[:, None] * MASK
    # integer scores: the means are exact; float32 rounds sqrt(2), + eps and the division, and the float64
    # expectation rounds once to float32: 4 roundings of values up to 1
    torch.testing.assert_close(adv, expected, rtol=0, atol=rounding_bound(4, 1.0))
    assert torch.equal(adv, ret)
    assert (adv[MASK == 0] == 0).all()  # observation tokens get no advantage


def test_one_output_per_session_equals_plain_grpo_and_dr_grpo():
    keys = ["p_0_0", "p_1_0", "p_2_0", "q_0_0", "q_1_0"]
    g = torch.Generator().manual_seed(0)
    rewards, mask = torch.randn(5, 6, generator=g), (torch.rand(5, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1
    index = np.array(["p", "p", "p", "q", "q"], dtype=object)
    for norm in (True, False):
        adv, _ = compute_advantage_for_multi_trajectories(
            rewards * mask, mask, keys, "grpo", norm_adv_by_std_in_grpo=norm
        )
        ref, _ = compute_grpo_outcome_advantage(rewards * mask, mask, index=index, norm_adv_by_std_in_grpo=norm)
        assert adv.dtype == ref.dtype
        groups = [(rewards * mask).double().sum(-1)[rows] for rows in (slice(0, 3), slice(3, 5))]
        assert_close_within(adv, ref, group_advantage_bound(groups, rewards.shape[-1], norm), f"norm={norm}")


def test_other_estimators_pass_through_unchanged():
    from megatron_rl.algos.algo_registry import ADV_ESTIMATORS

    rewards = _rewards()
    index = np.array([parse_trajectory_key(k)[0] for k in KEYS], dtype=object)
    adv, ret = compute_advantage_for_multi_trajectories(rewards, MASK, KEYS, "rloo")
    ref_adv, ref_ret = ADV_ESTIMATORS["rloo"](token_level_rewards=rewards, response_mask=MASK, index=index)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)
    values = torch.randn(MASK.shape, generator=torch.Generator().manual_seed(1))
    adv, _ = compute_advantage_for_multi_trajectories(rewards, MASK, KEYS, "gae", values=values, gamma=0.9, lam=0.8)
    ref, _ = ADV_ESTIMATORS["gae"](token_level_rewards=rewards, response_mask=MASK, values=values, gamma=0.9, lam=0.8)
    assert torch.equal(adv, ref)


def test_keys_round_trip_and_bad_keys_are_named():
    assert trajectory_keys(["0-17", "u_x"], [3, 0], [0, 2]) == ["0-17_3_0", "u_x_0_2"]
    assert parse_trajectory_key("u_x_0_2") == ("u_x", "0", 2)
    with pytest.raises(ValueError, match=r"batch key 'nounderscore' is not of the form"):
        compute_advantage_for_multi_trajectories(_rewards()[:1], MASK[:1], ["nounderscore"], "grpo")
    with pytest.raises(ValueError, match="5 batch keys for 6 samples"):
        compute_advantage_for_multi_trajectories(_rewards(), MASK, KEYS[:5], "grpo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        compute_advantage_for_multi_trajectories(_rewards(), MASK, KEYS, "nope")
