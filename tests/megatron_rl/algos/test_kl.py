"""KL estimators, straight-through variants, KL controllers and KL-in-reward (verl semantics)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from megatron_rl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
    valid_kl_penalty_names,
)
from megatron_rl.config import KLControlConfig
from tests.numerics import rounding_bound

LOGPROB = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # delta = logprob - ref = [0.5, -1.0]

BASE_NAMES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]

finite_logprobs = st.lists(st.floats(-25.0, 0.0, allow_nan=False), min_size=1, max_size=16)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("kl", [0.5, -1.0]),
        ("k1", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),
        ("k2", [0.125, 0.5]),
        # k3 = exp(ref - lp) - (ref - lp) - 1: exp(-0.5) + 0.5 - 1 and exp(1) - 1 - 1
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_estimators_hand_computed(name, expected):
    out = kl_penalty(LOGPROB, REF, name)
    # float64: a few roundings of values up to e, ~1e-15 (rounding_bound(4, e, float64) = 2.4e-15)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(kl_penalty_forward(LOGPROB, REF, name), out, rtol=0, atol=0)


def test_k3_is_clamped_like_verl():
    logprob = torch.tensor([0.0, 0.0, -30.0])
    ref = torch.tensor([-30.0, 30.0, -29.0])
    out = kl_penalty(logprob, ref, "k3")
    # ref - lp = -30 -> clamp -20 -> exp(-20) + 19 > 10 -> 10; +30 -> exp(20) - 21 -> 10; +1 -> e - 2.
    # 10 is the clamp itself; e - 2: ref - lp = 1 exactly, float32 rounds exp(1) and two subtractions, the
    # float32 expectation rounds e - 2 once: 3 roundings of values up to e
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, math.e - 2.0]), rtol=0, atol=rounding_bound(3, math.e))


@pytest.mark.parametrize("name", BASE_NAMES)
def test_straight_through_value_is_base_and_gradient_is_k2(name):
    logprob = torch.tensor([[-0.3, -2.0, -0.01, -5.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.9, -0.5, -0.02, -1.0]], dtype=torch.float64)
    value = kl_penalty(logprob, ref, name + "+")
    assert torch.equal(value.detach(), kl_penalty(logprob.detach(), ref, name))
    (grad,) = torch.autograd.grad(value.sum(), logprob)
    # d/d logprob of 0.5 * (logprob - ref)^2 is (logprob - ref): [0.6, -1.5, 0.01, -4.0]
    torch.testing.assert_close(grad, logprob.detach() - ref, rtol=0, atol=1e-12)  # float64, one rounding at 5


def test_plain_k1_gradient_is_one_not_k2():
    logprob = torch.tensor([-0.3, -2.0], requires_grad=True)
    (grad,) = torch.autograd.grad(kl_penalty(logprob, torch.tensor([-0.9, -0.5]), "k1").sum(), logprob)
    assert grad.tolist() == [1.0, 1.0]


@settings(max_examples=50, deadline=None, database=None)
@given(finite_logprobs)
def test_k1_of_identical_logprobs_is_zero(values):
    lp = torch.tensor(values)
    for name in ("k1", "kl", "k2", "abs", "k3", "low_var_kl", "k1+", "k3+"):
        assert torch.equal(kl_penalty(lp, lp.clone(), name), torch.zeros_like(lp)), name


@settings(max_examples=100, deadline=None, database=None)
@given(finite_logprobs, finite_logprobs)
def test_k3_abs_k2_are_nonnegative(a, b):
    n = min(len(a), len(b))
    lp, ref = torch.tensor(a[:n]), torch.tensor(b[:n])
    for name in ("abs", "k2"):
        assert (kl_penalty(lp, ref, name) >= 0).all(), name
    for name in ("k3", "low_var_kl", "k3+"):
        out = kl_penalty(lp, ref, name)
        # exp(r) - r - 1 >= 0; in float32 the rounding of exp(r) near r = 0 can leave -6e-8
        assert (out >= -1.2e-7).all(), (name, out)
        assert (kl_penalty(lp.double(), ref.double(), name) >= -1e-15).all(), name
    assert (kl_penalty(lp, ref, "k3") <= 10.0).all()


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as err:
        kl_penalty(LOGPROB, REF, "k4")
    msg = str(err.value)
    assert "'k4'" in msg
    for name in BASE_NAMES + ["k3+", "low_var_kl+"]:
        assert repr(name) in msg
    with pytest.raises(ValueError, match="'k4\\+'"):
        kl_penalty(LOGPROB, REF, "k4+")
    with pytest.raises(NotImplementedError, match="full"):
        kl_penalty(LOGPROB, REF, "full")
    with pytest.raises(ValueError, match="base estimator"):
        kl_penalty_forward(LOGPROB, REF, "k3+")
    assert valid_kl_penalty_names()[:7] == sorted(BASE_NAMES)
    assert len(valid_kl_penalty_names()) == 14


def test_adaptive_controller_follows_verl_formula():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    # Python float64 on both sides: ~6 roundings of values up to 1.02 differ by <= 1.4e-15, the bound below
    tol = rounding_bound(6, 1.02, torch.float64)
    ctrl.update(current_kl=0.1, n_steps=10)  # error 1.0 -> clipped to 0.2: * (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.1 * 1.02, abs=tol)
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.045, n_steps=10)  # error -0.1: * (1 - 0.1 * 0.1) -> KL below target, coef down
    assert ctrl.value == pytest.approx(0.099, abs=tol)
    ctrl.update(current_kl=0.0, n_steps=100)  # error -1 -> clipped to -0.2: * 0.8
    assert ctrl.value == pytest.approx(0.099 * 0.8, abs=tol)
    ctrl.update(current_kl=0.05, n_steps=100)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.099 * 0.8, abs=tol)


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(kl_coef=0.2)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.2


@pytest.mark.parametrize(
    "config",
    [
        KLControlConfig(type="adaptive", kl_coef=0.3, horizon=50, target_kl=0.01),
        OmegaConf.create({"type": "adaptive", "kl_coef": 0.3, "horizon": 50, "target_kl": 0.01}),
        {"type": "adaptive", "kl_coef": 0.3, "horizon": 50, "target_kl": 0.01},
    ],
)
def test_get_kl_controller_reads_typed_and_dict_configs(config):
    ctrl = get_kl_controller(config)
    assert isinstance(ctrl, AdaptiveKLController)
    assert (ctrl.value, ctrl.target, ctrl.horizon) == (0.3, 0.01, 50)


def test_get_kl_controller_errors():
    fixed = get_kl_controller(OmegaConf.create({"type": "fixed", "kl_coef": 0.02}))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.02
    with pytest.raises(ValueError, match=r"kl_ctrl.type='pid' is not allowed; choose one of \['adaptive', 'fixed'\]"):
        get_kl_controller({"type": "pid"})
    with pytest.raises(ValueError, match="kl_ctrl.horizon=0 must be > 0"):
        get_kl_controller({"type": "adaptive", "horizon": 0})


SCORES = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
OLD = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, 0.0]])
REF_LP = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -0.5, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_apply_kl_penalty_hand_computed_fixed():
    ctrl = FixedKLController(kl_coef=0.1)
    rewards, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, ctrl, kl_penalty="kl")
    # k1 = old - ref = [[0.5, 0, -0.5], [0.5, 0, (3, masked)]]; rewards = scores - 0.1 * k1
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.05, 2.0, 0.0]]))
    # per-sequence mean KL: [0/3, 0.5/2] -> batch mean 0.125
    assert metrics["actor/reward_kl_penalty"] == 0.125  # exact: dyadic k1 values, sums and means of 2 and 4
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert set(metrics) == {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"}


def test_apply_kl_penalty_updates_adaptive_controller_after_use():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, ctrl, kl_penalty="k1")
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the beta that was applied
    torch.testing.assert_close(rewards[0, 0], torch.tensor(-0.05))
    # KL 0.125 vs target 0.1: error 0.25 -> 0.2; n_steps = bs = 2: 0.1 * (1 + 0.2 * 2 / 10)
    # Python float64 arithmetic from the exact float32 KL 0.125: 4 roundings of values up to 0.104
    assert ctrl.value == pytest.approx(0.104, abs=rounding_bound(4, 0.104, torch.float64))


def test_apply_kl_penalty_low_var_kl_and_shape_check():
    ctrl = FixedKLController(kl_coef=1.0)
    rewards, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, ctrl, kl_penalty="low_var_kl")
    k3_row0 = [math.exp(-0.5) - 0.5, 0.0, math.exp(0.5) - 1.5]
    torch.testing.assert_close(rewards[0], torch.tensor([0.0, 0.0, 1.0]) - torch.tensor(k3_row0))
    assert rewards[1, 2].item() == 0.0  # padding gets no penalty
    with pytest.raises(ValueError, match=r"shape mismatch: .*response_mask\[2, 2\]"):
        apply_kl_penalty(SCORES, OLD, REF_LP, MASK[:, :2], ctrl)
