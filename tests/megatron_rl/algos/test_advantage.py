"""Advantage estimators: hand-computed cases, properties, bad input, config forms.

Expected numbers in the hand-computed cases are worked out in the comments next to them.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from megatron_rl.algos import ADV_ESTIMATORS
from megatron_rl.config import AlgoConfig
from tests.numerics import rounding_bound

VERL_NAMES = {
    "gae",
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
}
GROUP_ESTIMATORS = sorted(VERL_NAMES - {"gae", "reinforce_plus_plus", "remax"})


def est(name, **kwargs):
    return ADV_ESTIMATORS[name](**kwargs)


def outcome(scores, lengths, width=None):
    """Rewards with ``scores[i]`` on the last valid token of a row of ``lengths[i]`` tokens."""
    width = width or max(max(lengths), 1)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(len(scores), width)
    rewards[torch.arange(len(scores)), (torch.tensor(lengths) - 1).clamp_min(0)] = torch.tensor(
        scores, dtype=torch.float32
    )
    return rewards, mask


def otb_kwargs(shape, pi=0.5, spp=0.5):
    # pi = 0.5 and sum pi^2 = 0.5 make every per-token weight w = 1 - 2*0.5 + 0.5 = 0.5
    return {"old_log_probs": torch.full(shape, math.log(pi)), "sum_pi_squared": torch.full(shape, spp)}


def test_every_verl_estimator_is_registered():
    assert VERL_NAMES <= set(ADV_ESTIMATORS)
    assert ADV_ESTIMATORS["grpo"] is ADV_ESTIMATORS["grpo_vectorized"]


# ----------------------------------------------------------------------------- hand-computed


def test_gae_hand_computed_returns_with_discount():
    # gamma = lam = 0.5, r = [0, 0, 1], V = [.5, .25, .5]:
    # A2 = 1 - .5 = .5; A1 = (0 + .5*.5 - .25) + .25*.5 = .125; A0 = (0 + .5*.25 - .5) + .25*.125 = -.34375
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25, 0.5]])
    adv, ret = est("gae", token_level_rewards=r, values=v, response_mask=torch.ones(1, 3), gamma=0.5, lam=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.15625, 0.375, 1.0]]))
    raw = torch.tensor([-0.34375, 0.125, 0.5])
    torch.testing.assert_close(adv[0], (raw - raw.mean()) / raw.std())


def test_gae_skips_masked_observation_tokens_and_zeroes_padding():
    # gamma = lam = 1, V = 0, mask [1, 0, 1]: the masked token's reward 5 is not a TD step and
    # does not break the chain, so the raw advantage is 1 everywhere; row 2 is padding only.
    r = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, ret = est("gae", token_level_rewards=r, values=torch.zeros(3, 3), response_mask=mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # valid raw advantages [1, 1, 2, 0]: mean 1, unbiased var 2/3
    expected = torch.tensor([[0.0, 0.0, 0.0], [1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]) / math.sqrt(2 / 3)
    torch.testing.assert_close(adv, expected)


def test_grpo_and_dr_grpo_hand_computed():
    # group a: [1, 0, 0, 1] -> mean .5, unbiased std sqrt(1/3); group b: one sample -> mean 0, std 1
    r, mask = outcome([1.0, 0.0, 2.0, 0.0, 1.0], [2, 1, 3, 2, 1], width=3)
    index = np.array(["a", "a", "b", "a", "a"], dtype=object)
    adv, ret = est("grpo", token_level_rewards=r, response_mask=mask, index=index)
    scal = torch.tensor([0.5, -0.5, 2.0, -0.5, 0.5]) / torch.tensor(
        [math.sqrt(1 / 3) + 1e-6] * 2 + [1 + 1e-6] + [math.sqrt(1 / 3) + 1e-6] * 2
    )
    torch.testing.assert_close(adv, scal[:, None] * mask)
    assert adv is ret
    dr, _ = est(
        "grpo_vectorized", token_level_rewards=r, response_mask=mask, index=index, norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, 2.0, -0.5, 0.5])[:, None] * mask)


@pytest.mark.parametrize("norm, gap", [(True, 1 / (1 + 1e-6)), (False, 1.0)])
def test_grpo_passk_hand_computed(norm, gap):
    # group [1, 3, 2]: only the best (index 1) gets r_max - r_second = 1, over std([1, 3, 2]) = 1
    r, mask = outcome([1.0, 3.0, 2.0, 5.0, 5.0], [1, 2, 1, 1, 1], width=2)
    index = [0, 0, 0, 1, 1]  # group 1 is a tie: gap 0
    adv, _ = est(
        "grpo_passk",
        token_level_rewards=r,
        response_mask=mask,
        index=index,
        config=OmegaConf.create({"norm_adv_by_std_in_grpo": norm}),
    )
    torch.testing.assert_close(adv, torch.tensor([0.0, gap, 0.0, 0.0, 0.0])[:, None] * mask)


def test_rloo_hand_computed_and_single_sample_groups():
    # group [1, 2, 3]: leave-one-out means [2.5, 2, 1.5] -> [-1.5, 0, 1.5]; singleton score 5
    r, mask = outcome([1.0, 5.0, 2.0, 3.0], [1, 1, 1, 1])
    index = np.array(["x", "y", "x", "x"])
    adv, _ = est("rloo", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.5, 5.0, 0.0, 1.5]))  # verl's rloo keeps the score
    adv_v, _ = est("rloo_vectorized", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(adv_v[:, 0], torch.tensor([-1.5, 0.0, 0.0, 1.5]))  # verl's rloo_vectorized: 0


def test_reinforce_plus_plus_hand_computed():
    # gamma .5: row 0 r [1, 0, 2] -> G [1.5, 1, 2]; row 1 r [0, 4, pad] -> G [2, 4, 0]
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = est("reinforce_plus_plus", token_level_rewards=r, response_mask=mask, config=AlgoConfig(gamma=0.5))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]]))
    # valid G [1.5, 1, 2, 2, 4]: mean 2.1, unbiased var 5.2 / 4 = 1.3
    expected = torch.tensor([[-0.6, -1.1, -0.1], [-0.1, 1.9, 0.0]]) / math.sqrt(1.3)
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_baseline_hand_computed():
    # groups a [1, 3] -> [-1, 1], b [2] (one sample: mean 0) -> 2; lengths 2, 1, 1
    r, mask = outcome([1.0, 3.0, 2.0], [2, 1, 1])
    adv, _ = est("reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=mask, index=["a", "a", "b"])
    # valid tokens [-1, -1, 1, 2]: mean .25, unbiased var 6.75 / 3 = 2.25 -> std 1.5
    torch.testing.assert_close(adv, torch.tensor([[-5 / 6, -5 / 6], [0.5, 0.0], [7 / 6, 0.0]]))


def test_remax_hand_computed():
    r = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, ret = est("remax", token_level_rewards=r, reward_baselines=torch.tensor([1.5, 1.0]), response_mask=mask)
    torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 2.0], [3.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.5, 0.5], [2.0, 0.0, 0.0]]))


def test_opo_hand_computed():
    # group: lengths [1, 3], scores [2, 4] -> baseline (1*2 + 3*4) / 4 = 3.5; singleton keeps 7
    r, mask = outcome([2.0, 4.0, 7.0], [1, 3, 2])
    adv, _ = est("opo", token_level_rewards=r, response_mask=mask, index=[0, 0, 1])
    torch.testing.assert_close(adv, torch.tensor([-1.5, 0.5, 7.0])[:, None] * mask)


def test_gpg_hand_computed():
    # scores [1, 0, 0, 3], groups [a, a, b, b]: 2 non-zero -> alpha = 4/2; means .5, 1.5
    r, mask = outcome([1.0, 0.0, 0.0, 3.0], [1, 1, 1, 1])
    adv, _ = est("gpg", token_level_rewards=r, response_mask=mask, index=["a", "a", "b", "b"])
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, -3.0, 3.0]))
    adv, _ = est("gpg", token_level_rewards=r, response_mask=mask, index=["a", "a", "b", "b"], f_norm=2.0)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, -1.5, 1.5]))


@pytest.mark.parametrize(
    "config",
    [
        OmegaConf.create({"gdpo_reward_keys": ["fmt", "acc"], "gdpo_reward_weights": [1.0, 0.5]}),
        AlgoConfig(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=[1.0, 0.5]),
    ],
)
def test_gdpo_hand_computed_two_components(config):
    # groups (0,1), (2,3). fmt [1,0 | 1,1] -> [+s, -s | 0, 0]; acc [0,0 | 1,0] -> [0, 0 | +s, -s]
    # with s = .5 / sqrt(.5) = 1/sqrt(2). Weighted: [s, -s, s/2, -s/2]; whitening: mean 0,
    # unbiased var (2 * .5 + 2 * .125) / 3 = 5/12.
    r, mask = outcome([0.0, 0.0, 0.0, 0.0], [1, 1, 1, 1])
    ntb = {"fmt": np.array([1.0, 0.0, 1.0, 1.0]), "acc": [0.0, 0.0, 1.0, 0.0]}  # arrays or lists
    adv, ret = est(
        "gdpo",
        token_level_rewards=r,
        response_mask=mask,
        index=[0, 0, 1, 1],
        config=config,
        non_tensor_batch=ntb,
        batch={},
    )
    s = 1 / math.sqrt(2)
    expected = torch.tensor([s, -s, s / 2, -s / 2]) / math.sqrt(5 / 12)
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-5, rtol=0)
    assert adv is ret


def test_optimal_token_baseline_hand_computed():
    # w = .5 per token. Group (rows 0, 1), lengths 2 and 2: W = [.5, 1], G row0 [1, 1], row1 [3, 3]
    # B_0 = (1*.5 + 3*.5) / 1 = 2, B_1 = (1 + 3) / 2 = 2. Row 2 is alone: advantage = return.
    r = torch.tensor([[0.0, 1.0], [0.0, 3.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    adv, ret = est(
        "optimal_token_baseline", token_level_rewards=r, response_mask=mask, index=[0, 0, 1], **otb_kwargs((3, 2))
    )
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [3.0, 3.0], [2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0], [1.0, 1.0], [2.0, 0.0]]))


@pytest.mark.parametrize("zero_tail, last", [(True, 3.0), (False, 0.0)])
def test_optimal_token_baseline_zero_tail(zero_tail, last):
    # lengths 1 and 2: B_0 = (1*.5 + 3*.5) / 1 = 2, B_1 = 3*1 / 1 = 3 (only row 1 is valid there).
    # The unique longest row gets no baseline from the second-longest length (1) on.
    r = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv, _ = est(
        "optimal_token_baseline",
        token_level_rewards=r,
        response_mask=mask,
        index=[0, 0],
        handle_zero_tail=zero_tail,
        **otb_kwargs((2, 2)),
    )
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0], [1.0, last]]))


def test_tir_optimal_token_baseline_packs_valid_tokens():
    # masks with holes: row 0 [1, 0, 1], row 1 [1, 1, 0]; row 2 is empty (not a group member).
    # G row0 [2, 2, 2] -> packed [2, 2]; row1 [4, 4, 0] -> packed [4, 4]; packed W [.5, 1] both.
    # Packed B = [(1 + 2) / 1, (2 + 4) / 2] = [3, 3] -> packed A row0 [-1, -1], row1 [1, 1].
    r = torch.tensor([[0.0, 0.0, 2.0], [0.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    kw = dict(token_level_rewards=r, response_mask=mask, index=[0, 0, 0], **otb_kwargs((3, 3)))
    adv, ret = est("tir_optimal_token_baseline", **kw)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, -1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 2.0], [4.0, 4.0, 0.0], [0.0, 0.0, 0.0]]))
    # The unpacked estimator averages by column: B = [3, 4 (row 1 only), 2 (row 0 only)].
    adv, _ = est("optimal_token_baseline", **kw)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


# ----------------------------------------------------------------------------- properties

group_batches = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 6), st.floats(-4, 4, width=32)), min_size=1, max_size=12
)


def _batch(rows, width=6):
    groups, lengths, scores = zip(*rows)
    r, mask = outcome(list(scores), list(lengths), width=width)
    return r, mask, np.array([f"g{g}" for g in groups], dtype=object), torch.tensor(scores), list(groups)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=3), st.integers(2, 9))
def test_identical_rewards_in_a_group_give_exactly_zero(values, size):
    scores = [v for v in values for _ in range(size)]
    r, mask = outcome(scores, [2] * len(scores))
    index = [i for i in range(len(values)) for _ in range(size)]
    for name in ("grpo", "rloo", "rloo_vectorized", "opo", "gpg"):
        adv, _ = est(name, token_level_rewards=r, response_mask=mask, index=index)
        assert torch.equal(adv, torch.zeros_like(adv)), name


@settings(max_examples=60, deadline=None)
@given(group_batches)
def test_group_baselines_match_their_definitions(rows):
    r, mask, index, scores, groups = _batch(rows)
    members = {g: [i for i, h in enumerate(groups) if h == g] for g in set(groups)}
    mean = torch.tensor(
        [float(np.mean([scores[j] for j in members[g]])) if len(members[g]) > 1 else 0.0 for g in groups]
    )
    dr, _ = est("grpo", token_level_rewards=r, response_mask=mask, index=index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(dr, (scores - mean)[:, None] * mask, atol=1e-5, rtol=0)  # Dr.GRPO: mean-centred
    loo = torch.tensor(
        [
            scores[i] - float(np.mean([scores[j] for j in members[g] if j != i])) if len(members[g]) > 1 else scores[i]
            for i, g in enumerate(groups)
        ]
    )
    adv, _ = est("rloo", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(adv, loo[:, None] * mask, atol=1e-5, rtol=0)  # leave-one-out mean
    single = torch.tensor([len(members[g]) == 1 for g in groups])
    adv_v, _ = est("rloo_vectorized", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(adv_v, torch.where(single, 0.0, loo)[:, None] * mask, atol=1e-5, rtol=0)
    gpg, _ = est("gpg", token_level_rewards=r, response_mask=mask, index=index)
    alpha = len(groups) / max(int((scores != 0).sum()), 1)
    torch.testing.assert_close(gpg, alpha * dr, atol=1e-4, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(group_batches)
def test_grpo_groups_have_zero_mean_unit_std(rows):
    r, mask, index, scores, groups = _batch(rows)
    adv, _ = est("grpo", token_level_rewards=r, response_mask=torch.ones_like(mask), index=index)
    for g in set(groups):
        a = adv[[i for i, h in enumerate(groups) if h == g], 0].double()
        s = scores[[i for i, h in enumerate(groups) if h == g]].double()
        if a.numel() == 1:
            # verl: mean 0, std 1; float32 s / (1 + 1e-6) against float64: two roundings of values up to |s|,
            # each at least the subnormal spacing 2^-149 (hypothesis finds scores of 1e-43)
            assert a.item() == pytest.approx(
                s.item() / (1 + 1e-6), abs=rounding_bound(2, abs(s.item())) + 2 * 2.0**-149
            )
        elif s.std() > 1e-3:  # std of (s - mean) / (std + eps): 1 up to the epsilon
            expected = (s.std() / (s.std() + 1e-6)).item()
            assert abs(a.mean().item()) < 1e-5 and a.std().item() == pytest.approx(expected, abs=1e-4)


@settings(max_examples=60, deadline=None)
@given(group_batches)
def test_passk_only_the_best_gets_the_gap(rows):
    r, mask, index, scores, groups = _batch(rows)
    if min(groups.count(g) for g in groups) < 2:
        return
    adv, _ = est(
        "grpo_passk",
        token_level_rewards=r,
        response_mask=torch.ones_like(mask),
        index=index,
        norm_adv_by_std_in_grpo=False,
    )
    for g in set(groups):
        idx = [i for i, h in enumerate(groups) if h == g]
        top = sorted(scores[idx].tolist(), reverse=True)
        nonzero = [i for i in idx if adv[i, 0] != 0]
        assert len(nonzero) <= 1 and adv[idx, 0].sum().item() == pytest.approx(top[0] - top[1], abs=1e-5)
        if nonzero:
            assert scores[nonzero[0]] == top[0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(2, 7), st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_reward_to_go_properties(batch, width, gamma, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, width, generator=g)
    mask = (torch.rand(batch, width, generator=g) > 0.3).float()
    mask[0] = 1.0  # at least two valid tokens for the whitening
    # naive discounted reward-to-go over valid tokens (masked tokens skipped, chain unbroken)
    expected = torch.zeros(batch, width)
    for i in range(batch):
        running = 0.0
        for t in reversed(range(width)):
            if mask[i, t]:
                running = r[i, t].item() + gamma * running
                expected[i, t] = running
    adv, ret = est("reinforce_plus_plus", token_level_rewards=r, response_mask=mask, config=AlgoConfig(gamma=gamma))
    torch.testing.assert_close(ret, expected, atol=1e-5, rtol=1e-5)
    if mask.sum() > 1:
        valid = ret[mask.bool()]
        torch.testing.assert_close(
            adv[mask.bool()], (valid - valid.mean()) / (valid.var() + 1e-8).sqrt(), atol=1e-4, rtol=1e-4
        )
    # GAE with gamma = lam = 1 and zero values: the raw advantage (= returns) is the reward-to-go
    values = torch.zeros(batch, width)
    _, gae_ret = est("gae", token_level_rewards=r, values=values, response_mask=mask, gamma=1.0, lam=1.0)
    undiscounted = est("reinforce_plus_plus", token_level_rewards=r, response_mask=mask, config=AlgoConfig())[1]
    torch.testing.assert_close(gae_ret * mask, undiscounted, atol=1e-5, rtol=1e-5)
    # returns = raw advantages + values, and advantages are those raw advantages whitened
    values = torch.randn(batch, width, generator=g)
    gae_adv, gae_ret = est("gae", token_level_rewards=r, values=values, response_mask=mask, gamma=gamma, lam=0.9)
    if mask.sum() > 1:
        raw = (gae_ret - values)[mask.bool()]
        torch.testing.assert_close(
            gae_adv[mask.bool()], (raw - raw.mean()) / (raw.var() + 1e-8).sqrt(), atol=1e-4, rtol=1e-4
        )
    assert torch.all(gae_adv[~mask.bool()] == 0)
    # ReMax subtracts the baseline from the undiscounted reward-to-go on valid tokens
    b = torch.randn(batch, generator=g)
    remax_adv, remax_ret = est("remax", token_level_rewards=r, reward_baselines=b, response_mask=mask)
    torch.testing.assert_close(remax_ret * mask, undiscounted, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(remax_adv, remax_ret - b[:, None] * mask)


@settings(max_examples=40, deadline=None)
@given(group_batches)
def test_whitened_group_estimators(rows):
    r, mask, index, scores, groups = _batch(rows)
    if mask.sum() < 2:
        return
    dr, _ = est("grpo", token_level_rewards=r, response_mask=mask, index=index, norm_adv_by_std_in_grpo=False)
    grpo, _ = est("grpo", token_level_rewards=r, response_mask=mask, index=index)
    valid = mask.bool()

    def whiten(x):
        v = x[valid]
        out = torch.zeros_like(x)
        out[valid] = (v - v.mean()) / (v.var() + 1e-8).sqrt()
        return out

    # Whitening values that are (almost) all equal divides rounding noise by sqrt(1e-8): such
    # batches say nothing about the estimators, only about float error, so they are skipped.
    rpp, _ = est("reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=mask, index=index)
    if float(dr[valid].var()) > 1e-6:
        torch.testing.assert_close(rpp, whiten(dr), atol=1e-4, rtol=1e-4)
    gdpo, _ = est("gdpo", token_level_rewards=r, response_mask=mask, index=index)  # one component
    if float(grpo[valid].var()) > 1e-6:
        torch.testing.assert_close(gdpo, whiten(grpo), atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=8), st.integers(0, 10_000))
def test_optimal_token_baseline_properties(rows, seed):
    groups, lengths = zip(*rows)
    g = torch.Generator().manual_seed(seed)
    width = 5
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    r = torch.randn(len(rows), width, generator=g) * mask
    pi = torch.rand(len(rows), width, generator=g)
    kw = dict(
        token_level_rewards=r,
        response_mask=mask,
        index=list(groups),
        old_log_probs=pi.log(),
        sum_pi_squared=pi**2 + torch.rand(len(rows), width, generator=g) * (1 - pi) ** 2,
    )
    adv, ret = est("optimal_token_baseline", handle_zero_tail=False, **kw)
    # B_t is the W-weighted mean of G_t, so sum_i W_it (G_it - B_t) = 0 per group and step
    w_cum = ((1 - 2 * pi + kw["sum_pi_squared"]) * mask).cumsum(-1) * mask
    for grp in set(groups):
        idx = [i for i, h in enumerate(groups) if h == grp]
        if len(idx) > 1:
            torch.testing.assert_close((w_cum[idx] * adv[idx]).sum(0), torch.zeros(width), atol=1e-4, rtol=0)
        else:
            torch.testing.assert_close(adv[idx], ret[idx] * mask[idx])
    # with contiguous (hole-free) masks, packing changes nothing: tir == otb
    otb, _ = est("optimal_token_baseline", **kw)
    tir, _ = est("tir_optimal_token_baseline", **kw)
    torch.testing.assert_close(tir, otb, atol=1e-5, rtol=1e-5)
