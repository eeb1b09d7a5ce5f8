"""Advantage estimators: bad input and edges, the two config forms and mask dtypes, group ids.

The hand-computed cases and the properties are in ``test_advantage.py``; its helpers are shared.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from megatron_rl.config import AlgoConfig
from tests.megatron_rl.algos.test_advantage import GROUP_ESTIMATORS, VERL_NAMES, est, otb_kwargs, outcome
from tests.numerics import assert_close_within, group_advantage_bound, rounding_bound

# ----------------------------------------------------------------------------- bad input / edges


def _kwargs_for(name, r, mask, index):
    kw = dict(
        token_level_rewards=r,
        response_mask=mask,
        index=index,
        values=torch.zeros_like(r),
        reward_baselines=torch.zeros(r.shape[0]),
        config=AlgoConfig(),
        gamma=1.0,
        lam=1.0,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
        **otb_kwargs(tuple(r.shape)),
    )
    return kw


@pytest.mark.parametrize("name", sorted(VERL_NAMES))
def test_rows_without_valid_tokens_get_zero_never_nan(name):
    r, mask = outcome([1.0, 0.0, 2.0, 0.0, 3.0, 1.0, 4.0], [3, 2, 0, 1, 0, 0, 0], width=3)
    index = ["a", "a", "a", "b", "b", "c", "c"]  # group c has no valid token at all
    adv, ret = est(name, **_kwargs_for(name, r, mask, index))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.all(adv[[2, 4, 5, 6]] == 0)


def test_opo_group_of_empty_responses_has_zero_baseline_not_nan():
    r, mask = outcome([1.0, 2.0], [0, 0], width=2)
    adv, _ = est("opo", token_level_rewards=r, response_mask=mask, index=[0, 0])
    assert torch.equal(adv, torch.zeros(2, 2))


@pytest.mark.parametrize("name", sorted(VERL_NAMES))
def test_shape_mismatch_names_the_tensors(name):
    kw = _kwargs_for(name, torch.zeros(2, 3), torch.ones(2, 4), [0, 0])
    with pytest.raises(ValueError, match=r"^shape mismatch: token_level_rewards\[2, 3\], response_mask\[2, 4\]"):
        est(name, **kw)


def test_extra_tensor_shape_mismatch_and_non_2d():
    r = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"^shape mismatch: token_level_rewards\[2, 3\], response_mask\[2, 3\], values\[2, 2\]$"
    ):
        est("gae", token_level_rewards=r, values=torch.zeros(2, 2), response_mask=torch.ones(2, 3))
    with pytest.raises(
        ValueError, match=r"^grpo: token_level_rewards must be a 2-D tensor \[batch, response_length\], got \[3\]$"
    ):
        est("grpo", token_level_rewards=torch.zeros(3), response_mask=torch.ones(3), index=[0, 0, 0])
    with pytest.raises(ValueError, match=r"^remax: reward_baselines must have shape \[2\], got \[3\]$"):
        est("remax", token_level_rewards=r, reward_baselines=torch.zeros(3), response_mask=torch.ones(2, 3))


@pytest.mark.parametrize("name", sorted(VERL_NAMES))
def test_non_finite_rewards_name_the_samples(name):
    r, mask = outcome([1.0, 2.0, 3.0, 4.0], [2, 2, 2, 2])
    r[1, 0], r[3, 1] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=r"^token_level_rewards has non-finite values in samples \[1, 3\]$"):
        est(name, **_kwargs_for(name, r, mask, [0, 0, 1, 1]))


def test_reward_sum_overflow_is_reported():
    r = torch.tensor([[3e38, 3e38], [1.0, 0.0]])
    with pytest.raises(
        ValueError, match=r"^token_level_rewards rows sum to inf \(float overflow\) in samples \[0\]; rescale them$"
    ):
        est("grpo", token_level_rewards=r, response_mask=torch.ones(2, 2), index=[0, 0])


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_estimators_require_index(name):
    r, mask = outcome([1.0, 2.0], [1, 1])
    kw = _kwargs_for(name, r, mask, None)
    name = "grpo" if name == "grpo_vectorized" else name  # one function serves both names
    with pytest.raises(
        ValueError,
        match=rf"^{name}: index is required \(the prompt uid of each sample, e.g. "
        r"non_tensor_batch\['uid'\]\); got None$",
    ):
        est(name, **kw)
    kw["index"] = [0, 0, 0]
    with pytest.raises(
        ValueError,
        match=rf"^{name}: index has 3 labels but token_level_rewards has 2 samples; "
        r"pass one uid per sample$",
    ):
        est(name, **kw)


def test_passk_rejects_a_one_sample_group_by_label():
    r, mask = outcome([1.0, 2.0, 3.0], [1, 1, 1])
    with pytest.raises(
        ValueError,
        match=r"^grpo_passk: Pass@k requires at least 2 samples per group. "
        r"Got 1 for group 'lonely'.$",
    ):
        est("grpo_passk", token_level_rewards=r, response_mask=mask, index=np.array(["p", "lonely", "p"], dtype=object))


def test_missing_required_inputs():
    r, mask = outcome([1.0, 2.0], [1, 1])
    with pytest.raises(ValueError, match=r"^gae: values \(critic values \[batch, response_length\]\) are required$"):
        est("gae", token_level_rewards=r, response_mask=mask)
    with pytest.raises(
        ValueError, match=r"^remax: reward_baselines \(the greedy response's reward, shape \[batch\]\) are required$"
    ):
        est("remax", token_level_rewards=r, response_mask=mask)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises(ValueError, match=rf"^{name}: sum_pi_squared \[batch, response_length\] is required"):
            est(name, token_level_rewards=r, response_mask=mask, index=[0, 0], old_log_probs=torch.zeros(2, 1))


def test_whitening_needs_two_valid_tokens():
    r, mask = outcome([1.0, 2.0], [0, 0])
    for name in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo"):
        with pytest.raises(ValueError, match=r"^masked_var: the mask selects no element; at least two are needed$"):
            est(name, **_kwargs_for(name, r, mask, [0, 0]))


def test_gdpo_config_errors():
    r, mask = outcome([1.0, 2.0], [1, 1])
    ntb = {"acc": np.array([1.0, 0.0])}
    with pytest.raises(ValueError, match=r"^gdpo: algorithm.gdpo_reward_keys must list the reward components"):
        est("gdpo", token_level_rewards=r, response_mask=mask, index=[0, 0], config=AlgoConfig(), non_tensor_batch=ntb)
    with pytest.raises(
        ValueError, match=r"^gdpo: reward key 'fmt' not found in non_tensor_batch; available keys: \['acc'\]$"
    ):
        est(
            "gdpo",
            token_level_rewards=r,
            response_mask=mask,
            index=[0, 0],
            non_tensor_batch=ntb,
            config=OmegaConf.create({"gdpo_reward_keys": ["fmt"]}),
        )
    with pytest.raises(
        ValueError, match=r"^gdpo: algorithm.gdpo_reward_weights has 2 entries but gdpo_reward_keys has 1"
    ):
        est(
            "gdpo",
            token_level_rewards=r,
            response_mask=mask,
            index=[0, 0],
            non_tensor_batch=ntb,
            config=OmegaConf.create({"gdpo_reward_keys": ["acc"], "gdpo_reward_weights": [1.0, 2.0]}),
        )
    with pytest.raises(ValueError, match=r"^gdpo: non_tensor_batch\['acc'\] must have shape \[2\], got \[3\]$"):
        est(
            "gdpo",
            token_level_rewards=r,
            response_mask=mask,
            index=[0, 0],
            non_tensor_batch={"acc": [1.0, 0.0, 1.0]},
            config=OmegaConf.create({"gdpo_reward_keys": ["acc"]}),
        )
    with pytest.raises(ValueError, match=r"^non_tensor_batch\['acc'\] has non-finite values in samples \[1\]$"):
        est(
            "gdpo",
            token_level_rewards=r,
            response_mask=mask,
            index=[0, 0],
            non_tensor_batch={"acc": np.array([1.0, np.nan])},
            config=OmegaConf.create({"gdpo_reward_keys": ["acc"]}),
        )


# ----------------------------------------------------------------------------- configs and mask dtypes


@pytest.mark.parametrize(
    "make", [lambda **kw: OmegaConf.create(kw), lambda **kw: AlgoConfig(**kw)], ids=["DictConfig", "AlgoConfig"]
)
def test_settings_come_from_either_config_form(make):
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 3.0]])
    mask = torch.ones(2, 3)
    _, ret = est("reinforce_plus_plus", token_level_rewards=r, response_mask=mask, config=make(gamma=0.5))
    torch.testing.assert_close(ret[0], torch.tensor([1.5, 1.0, 2.0]))
    _, ret = est("reinforce_plus_plus", token_level_rewards=r, response_mask=mask, config=make(gamma=0.5), gamma=1.0)
    torch.testing.assert_close(ret[0], torch.tensor([3.0, 2.0, 2.0]))  # an explicit keyword wins
    v = torch.zeros(2, 3)
    _, gae_ret = est("gae", token_level_rewards=r, values=v, response_mask=mask, config=make(gamma=0.5, lam=1.0))
    torch.testing.assert_close(gae_ret[0], torch.tensor([1.5, 1.0, 2.0]))
    scores, m = outcome([1.0, 3.0], [1, 1])
    dr, _ = est(
        "grpo", token_level_rewards=scores, response_mask=m, index=[0, 0], config=make(norm_adv_by_std_in_grpo=False)
    )
    torch.testing.assert_close(dr[:, 0], torch.tensor([-1.0, 1.0]))
    passk, _ = est(
        "grpo_passk",
        token_level_rewards=scores,
        response_mask=m,
        index=[0, 0],
        config=make(norm_adv_by_std_in_grpo=False),
    )
    torch.testing.assert_close(passk[:, 0], torch.tensor([0.0, 2.0]))


@pytest.mark.parametrize("name", sorted(VERL_NAMES))
def test_bool_int_and_float_masks_agree(name):
    r, mask = outcome([1.0, 0.0, 2.0, 0.5, 3.0, 1.0], [3, 2, 1, 1, 2, 3], width=3)
    mask[0, 1] = 0.0  # a hole
    index = np.array([7, 7, 7, 9, 9, 9])
    ref = est(name, **_kwargs_for(name, r, mask, index))
    for dtype in (torch.bool, torch.int64):
        out = est(name, **_kwargs_for(name, r, mask.to(dtype), index))
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1], ref[1])


@pytest.mark.parametrize(
    "rewards_dtype, mask_dtype, expected",
    [
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.float64, torch.float64),
        (torch.float32, torch.bool, torch.float32),
        (torch.float64, torch.int64, torch.float64),
    ],
)
def test_grpo_output_dtype_is_verls_promotion(rewards_dtype, mask_dtype, expected):
    # verl returns scores.unsqueeze(-1) * response_mask: the mask's dtype takes part in the promotion.
    # Scores 1, 3, 2 in one group: mean 2, std 1 -> -1/(1+eps), 1/(1+eps), 0; row 1 has one valid token.
    r = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 0.0]], dtype=rewards_dtype)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]]).to(mask_dtype)
    for name in ("grpo", "grpo_vectorized"):
        adv, ret = est(name, token_level_rewards=r, response_mask=mask, index=np.array(["a"] * 3, dtype=object))
        assert adv.dtype == expected and ret is adv
        # verl computes in the rewards' dtype (bfloat16: 1 + 1e-6 rounds to 1) before the mask promotes it;
        # mean 2 and std 1 are exact, so both sides round only 1 + 1e-6 and the division, on values up to 1
        hand = (torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]], dtype=rewards_dtype) / (1 + 1e-6)).to(expected)
        torch.testing.assert_close(adv, hand, atol=2 * rounding_bound(2, 1.0, rewards_dtype), rtol=0)


# ----------------------------------------------------------------------------- group ids


def _first_appearance_ids(labels):
    mapping = {}
    return [mapping.setdefault(label, len(mapping)) for label in labels], len(mapping)


@pytest.mark.parametrize(
    "index, expected_ids, expected_groups",
    [
        # a label recurring in a later run keeps its first id
        (np.array(["b", "b", "a", "b", "c", "c", "a"], dtype=object), [0, 0, 1, 0, 2, 2, 1], 3),
        (["b", "b", "a", "b"], [0, 0, 1, 0], 2),
        (("x", "y", "x"), [0, 1, 0], 2),
        (np.array(["u", "u", "v"]), [0, 0, 1], 2),  # numpy unicode dtype
        (np.array([7, 7, 3, 3, 7]), [0, 0, 1, 1, 0], 2),
        (np.array([1, 1.0, True, 2], dtype=object), [0, 0, 0, 1], 2),  # equal as Python objects, like dict keys
        (np.array([1.0, np.nan, np.nan, 1.0]), [0, 1, 2, 0], 3),  # every NaN float is its own label, as in a dict
        (torch.tensor([5, 5, 2, 5]), [1, 1, 0, 1], 2),  # tensors: sorted label order
        (np.array(["only"], dtype=object), [0], 1),
        (np.array([], dtype=object), [], 0),
    ],
)
def test_group_ids_hand_cases(index, expected_ids, expected_groups):
    from megatron_rl.algos.utils import group_ids

    ids, num_groups = group_ids(index)
    assert ids.dtype == torch.long and ids.tolist() == expected_ids and num_groups == expected_groups


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), st.booleans(), st.booleans())
def test_group_ids_equal_a_first_appearance_dict(labels, sort, as_strings):
    from megatron_rl.algos.utils import group_ids

    labels = sorted(labels) if sort else labels
    values = [f"uid-{x}" for x in labels] if as_strings else labels
    expected = _first_appearance_ids(values)
    for index in (np.array(values, dtype=object), np.array(values), list(values)):
        ids, num_groups = group_ids(index)
        assert (ids.tolist(), num_groups) == expected


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("group_size", [2, 5, 16])
def test_grpo_contiguous_groups_match_any_other_layout(norm, group_size):
    # Consecutive equal-size groups take the [G, k] row-reduction path; the same samples shuffled
    # take the scatter/index_add path. Both must give every sample the same advantage.
    gen = torch.Generator().manual_seed(group_size)
    num_groups, width = 7, 5
    r = torch.randn(num_groups * group_size, width, generator=gen)
    r[:group_size] = 0.25  # an all-equal group: exactly zero advantage on both paths
    mask = (torch.rand(num_groups * group_size, width, generator=gen) > 0.3).float()
    index = np.repeat(np.array([f"p{g}" for g in range(num_groups)], dtype=object), group_size)
    perm = torch.randperm(len(index), generator=gen)
    contiguous, _ = est("grpo", token_level_rewards=r, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm)
    shuffled, _ = est(
        "grpo",
        token_level_rewards=r[perm],
        response_mask=mask[perm],
        index=index[perm.numpy()],
        norm_adv_by_std_in_grpo=norm,
    )
    assert shuffled.dtype == contiguous.dtype
    bound = group_advantage_bound(list(r.double().sum(-1).view(-1, group_size)), width, norm)
    assert_close_within(shuffled, contiguous[perm], bound, "shuffled vs contiguous")
    assert bool((contiguous[:group_size] == 0).all())

    scores = r.sum(-1).view(num_groups, group_size).double()  # float64 truth for the contiguous layout
    expected = scores - scores.mean(1, keepdim=True)
    if norm:
        expected = expected / (scores.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(contiguous, (expected.view(-1, 1) * mask).float(), atol=1e-5, rtol=1e-5)
