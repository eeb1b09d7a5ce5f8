"""Rollout correction: IS weights (TIS/IcePop), rejection sampling, diagnostics, bypass mode."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from tensordict import TensorDict

from megatron_rl.algos.rollout_correction import (
    ROLLOUT_RS_OPTIONS,
    apply_bypass_mode,
    compute_bypass_mode_correction,
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    parse_rollout_is_threshold,
    parse_rollout_rs_thresholds,
)
from megatron_rl.config import PolicyLossConfig, RolloutCorrectionConfig
from parallel.testing import run_distributed
from tests.numerics import rounding_bound

e = math.exp
# log_ratio = old - rollout = [[0.5, -1.0, 0.0], [0.0, 0.7, (masked)]]
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.3, 0.0]])
ROLL = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
LOG_RATIO = OLD - ROLL


def close(actual, expected, tol=None):
    """float32 metrics of these 5-token cases against float64 hand values: the inputs' rounding, exp, the
    5-term sums, a division or two, about 12 roundings of values up to e^1.4 ~ 4 (a weight or its square),
    or up to |expected| where that is larger. ``tol``: an absolute bound where the basis differs."""
    bound = rounding_bound(12, max(4.0, abs(expected))) if tol is None else tol
    assert actual == pytest.approx(expected, abs=bound)


def test_token_tis_weights_and_metrics_hand_computed():
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 2.0)
    expected = torch.tensor([[e(0.5), e(-1.0), 1.0], [1.0, 2.0, 0.0]])  # e^0.7 = 2.01 truncated to 2
    torch.testing.assert_close(weights, expected)
    valid = [e(0.5), e(-1.0), 1.0, 1.0, 2.0]
    mean = sum(valid) / 5
    close(metrics["rollout_is_mean"], mean)
    close(metrics["rollout_is_max"], 2.0)
    close(metrics["rollout_is_min"], e(-1.0))
    close(metrics["rollout_is_ratio_fraction_high"], 0.2)  # raw e^0.7 > 2
    close(metrics["rollout_is_ratio_fraction_low"], 0.2)  # raw e^-1 < 1/2
    close(metrics["rollout_is_std"], math.sqrt(sum(w * w for w in valid) / 5 - mean**2))
    close(metrics["rollout_is_eff_sample_size"], mean**2 / (sum(w * w for w in valid) / 5))
    seq = [(e(0.5) + e(-1.0) + 1.0) / 3, 1.5]
    close(metrics["rollout_is_seq_mean"], sum(seq) / 2)
    close(metrics["rollout_is_seq_max"], 1.5)
    close(metrics["rollout_is_seq_min"], seq[0])
    close(metrics["rollout_is_seq_max_deviation"], 0.5)
    close(metrics["rollout_is_seq_std"], abs(seq[0] - seq[1]) / math.sqrt(2))
    # raw (untruncated) row means 1.006 and (1 + e^0.7) / 2 = 1.507: inside [1/2, 2]
    assert metrics["rollout_is_seq_fraction_high"] == 0.0 and metrics["rollout_is_seq_fraction_low"] == 0.0
    assert "rollout_is_oob_ratio" not in metrics and "rollout_is_batch_norm_factor" not in metrics


def test_token_icepop_zeroes_outside_bounds():
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", "0.5_2.0")
    torch.testing.assert_close(weights, torch.tensor([[e(0.5), 0.0, 1.0], [1.0, 0.0, 0.0]]))
    close(metrics["rollout_is_oob_ratio"], 0.4)
    close(metrics["rollout_is_min"], 0.0)


def test_sequence_level_weights_hand_computed():
    # summed log-ratios: row 0: -0.5, row 1: 0.7
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "sequence", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[e(-0.5)] * 3, [2.0, 2.0, 0.0]]))
    close(metrics["rollout_is_max"], e(0.7))  # diagnostics use the untruncated sequence ratio
    close(metrics["rollout_is_min"], e(-0.5))
    close(metrics["rollout_is_mean"], (3 * e(-0.5) + 2 * 2.0) / 5)
    close(metrics["rollout_is_ratio_fraction_high"], 0.5)
    close(metrics["rollout_is_ratio_fraction_low"], 0.0)
    second = (3 * e(-1.0) + 2 * 4.0) / 5
    variance = second - ((3 * e(-0.5) + 4.0) / 5) ** 2
    # the variance errs as close()'s values do; sqrt divides that by 2 * std
    close(metrics["rollout_is_std"], math.sqrt(variance), tol=rounding_bound(12, 4.0) / (2 * math.sqrt(variance)))
    close(metrics["rollout_is_seq_mean"], (e(-0.5) + 2.0) / 2)
    close(metrics["rollout_is_seq_fraction_high"], 0.5)
    icepop, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "sequence", "0.7_2.5")
    torch.testing.assert_close(icepop, torch.tensor([[0.0] * 3, [e(0.7), e(0.7), 0.0]]))
    close(metrics["rollout_is_oob_ratio"], 3 / 5)  # row 0's three tokens


def test_batch_normalize_gives_mean_one():
    weights, metrics = compute_rollout_correction_weights(
        LOG_RATIO, MASK, "token", 2.0, rollout_is_batch_normalize=True
    )
    close(metrics["rollout_is_batch_norm_factor"], (e(0.5) + e(-1.0) + 1.0 + 1.0 + 2.0) / 5)
    close(((weights * MASK).sum() / MASK.sum()).item(), 1.0)
    weights, metrics = compute_rollout_correction_weights(
        LOG_RATIO, MASK, "sequence", 2.0, rollout_is_batch_normalize=True
    )
    close(metrics["rollout_is_batch_norm_factor"], (e(-0.5) + 2.0) / 2)  # mean over sequences
    close(((weights[0, 0] + weights[1, 0]) / 2).item(), 1.0)
    # IcePop zeroing everything: nothing to normalise by, factor 1, ESS 0 (verl divides by zero here).
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "sequence", "3_4", True)
    assert metrics["rollout_is_batch_norm_factor"] == 1.0 and metrics["rollout_is_eff_sample_size"] == 0.0
    assert torch.count_nonzero(weights) == 0


def test_ess_is_one_when_all_weights_are_equal():
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    for shift in (0.0, 0.3, -2.0):
        # token level: every token has ratio e^shift; sequence level: every row sums to 2 * shift
        token_lr = torch.full((4, 6), shift)
        seq_lr = torch.zeros(4, 6)
        seq_lr[:, 0] = 2 * shift
        for level, log_ratio in (("token", token_lr), ("sequence", seq_lr)):
            weights, metrics = compute_rollout_correction_weights(log_ratio, mask, level, 10.0)
            assert metrics["rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-5)
            # E[w^2] - E[w]^2 in float32 (verl's formula) leaves ~sqrt(eps) * w of rounding noise
            assert metrics["rollout_is_std"] == pytest.approx(0.0, abs=1e-3)
            assert weights[mask.bool()].unique().numel() == 1


def test_ess_drops_when_one_weight_dominates():
    log_ratio = torch.tensor([[2.0, -8.0, -8.0, -8.0]])
    _, metrics = compute_rollout_correction_weights(log_ratio, torch.ones(1, 4), "token", 100.0)
    w = [e(2.0)] + [e(-8.0)] * 3
    close(metrics["rollout_is_eff_sample_size"], (sum(w) / 4) ** 2 / (sum(x * x for x in w) / 4))
    assert metrics["rollout_is_eff_sample_size"] < 0.26


log_ratios = st.lists(st.floats(-30.0, 30.0, allow_nan=False), min_size=2, max_size=24)


@settings(max_examples=60, deadline=None, database=None)
@given(log_ratios, st.floats(1.01, 50.0))
def test_tis_weights_never_exceed_threshold(values, threshold):
    log_ratio = torch.tensor(values).reshape(2, -1) if len(values) % 2 == 0 else torch.tensor(values).reshape(1, -1)
    mask = torch.ones_like(log_ratio)
    for level in ("token", "sequence"):
        weights, metrics = compute_rollout_correction_weights(log_ratio, mask, level, threshold)
        assert (weights <= threshold).all() and (weights >= 0).all()
        # ESS <= 1, up to verl's w / (mean + 1e-8) normaliser, which inflates it for tiny weights
        ess_bound = (1 + 1e-8 / metrics["rollout_is_mean"]) ** 2 * (1 + 1e-5)
        assert 0 < metrics["rollout_is_eff_sample_size"] <= ess_bound


@settings(max_examples=60, deadline=None, database=None)
@given(log_ratios, st.floats(0.05, 1.0), st.floats(1.0, 20.0))
def test_icepop_zeroes_exactly_outside_bounds(values, low, high):
    log_ratio = torch.tensor(values).unsqueeze(0)
    mask = torch.ones_like(log_ratio)
    weights, _ = compute_rollout_correction_weights(log_ratio, mask, "token", f"{low}_{high}")
    raw = torch.exp(log_ratio.clamp(-20, 20))
    inside = (raw >= low) & (raw <= high)
    assert torch.equal(weights[~inside], torch.zeros_like(weights[~inside]))
    assert torch.equal(weights[inside], raw[inside])


def test_rejection_modes_hand_computed():
    cases = {
        # token k1 = -log r = [[-0.5, 1, 0], [0, -0.7]]; keep within [log 0.5, log 2] = [-0.693, 0.693]
        ("token_k1", "0.5_2.0"): [[1, 0, 1], [1, 0, 0]],
        ("token_k1", 2.0): [[1, 0, 1], [1, 0, 0]],  # one number = [1/2, 2]
        # k3 = r - 1 - log r: [[0.149, 0.368, 0], [0, 0.314]] <= 0.2
        ("token_k3", 0.2): [[1, 0, 1], [1, 0, 0]],
        # k2 = (log r)^2 / 2 = [[0.125, 0.5, 0], [0, 0.245]] <= 0.3
        ("token_k2", "0.3"): [[1, 0, 1], [1, 1, 0]],
        # row sums of k1: 0.5 (kept), -0.7 (< -0.693, dropped)
        ("seq_sum_k1", "0.5_2.0"): [[1, 1, 1], [0, 0, 0]],
        # row means of k1: 0.167, -0.35 -> both inside [log(1/1.5), log 1.5] = [-0.405, 0.405]
        ("seq_mean_k1", 1.5): [[1, 1, 1], [1, 1, 0]],
        # row max of k2: 0.5 (dropped), 0.245 (kept)
        ("seq_max_k2", 0.3): [[0, 0, 0], [1, 1, 0]],
        ("seq_sum_k3", 0.4): [[0, 0, 0], [1, 1, 0]],  # sums 0.517, 0.314
        ("seq_mean_k2", 0.2): [[0, 0, 0], [1, 1, 0]],  # means 0.625 / 3 = 0.208, 0.245 / 2
    }
    for (mode, threshold), expected in cases.items():
        mask, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, mode, threshold)
        assert mask.tolist() == [[float(x) for x in row] for row in expected], mode
        dropped = 5 - sum(sum(row) for row in expected)
        close(metrics[f"rollout_rs_{mode}_masked_fraction"], dropped / 5)
        close(metrics["rollout_rs_masked_fraction"], dropped / 5)


def test_rejection_metrics_hand_computed():
    _, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, "token_k1", "0.5_2.0")
    close(metrics["rollout_rs_token_k1_mean"], (-0.5 + 1.0 + 0.0 + 0.0 - 0.7) / 5)
    close(metrics["rollout_rs_token_k1_max"], 1.0)
    close(metrics["rollout_rs_token_k1_min"], -0.7)
    close(metrics["rollout_rs_token_k1_fraction_high"], 0.2)
    close(metrics["rollout_rs_token_k1_fraction_low"], 0.2)
    close(metrics["rollout_rs_token_k1_seq_masked_fraction"], 1.0)
    close(metrics["rollout_rs_seq_masked_fraction"], 1.0)
    close(metrics["rollout_rs_token_k1_seq_mean"], (0.5 / 3 - 0.35) / 2)
    _, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_max_k2", 0.3)
    close(metrics["rollout_rs_seq_max_k2_mean"], (3 * 0.5 + 2 * 0.245) / 5)  # token-weighted
    close(metrics["rollout_rs_seq_max_k2_max"], 0.5)
    close(metrics["rollout_rs_seq_max_k2_fraction_high"], 0.5)
    assert metrics["rollout_rs_seq_max_k2_fraction_low"] == 0.0
    assert "rollout_rs_seq_max_k2_seq_fraction_low" not in metrics
    close(metrics["rollout_rs_seq_max_k2_seq_masked_fraction"], 0.5)


def test_combined_options_must_all_pass_and_mask_shrinks_only():
    mask, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_sum_k1, seq_max_k2,seq_sum_k1", "0.5_2.0,0.3")
    assert mask.tolist() == [[0.0] * 3, [0.0] * 3]
    close(metrics["rollout_rs_masked_fraction"], 1.0)
    torch.manual_seed(0)
    log_ratio = torch.randn(16, 32)
    base = (torch.rand(16, 32) > 0.2).long()
    base[0] = 0  # an empty sequence
    for mode in ROLLOUT_RS_OPTIONS:
        thr = "0.7_1.4" if mode.endswith("k1") else 0.3
        mask, _ = compute_rollout_rejection_mask(log_ratio, base, mode, thr)
        assert mask.dtype == torch.long and ((mask == 0) | (base == 1)).all(), mode
    bool_mask, _ = compute_rollout_rejection_mask(log_ratio, base.bool(), "token_k3", 0.3)
    assert bool_mask.dtype == torch.bool


def test_offpolicy_metrics_hand_computed():
    metrics = compute_offpolicy_metrics(OLD, ROLL, MASK)
    close(metrics["kl"], -0.2 / 5)
    k3 = [e(0.5) - 1.5, e(-1.0), 0.0, 0.0, e(0.7) - 1.7]
    close(metrics["k3_kl"], sum(k3) / 5)
    close(metrics["training_log_ppl"], (3.5 / 3 + 0.3) / 2)
    close(metrics["training_ppl"], (e(3.5 / 3) + e(0.3)) / 2)
    close(metrics["rollout_log_ppl"], (1.0 + 0.65) / 2)
    close(metrics["rollout_ppl"], (e(1.0) + e(0.65)) / 2)
    diff = [-1.0 + 3.5 / 3, -0.65 + 0.3]  # mean rollout log-prob - mean training log-prob
    close(metrics["log_ppl_diff"], sum(diff) / 2)
    close(metrics["log_ppl_abs_diff"], (abs(diff[0]) + abs(diff[1])) / 2)
    close(metrics["log_ppl_diff_max"], diff[0])
    close(metrics["log_ppl_diff_min"], diff[1])
    close(metrics["ppl_ratio"], (e(diff[0]) + e(diff[1])) / 2)
    close(metrics["chi2_token"], (e(1.0) + e(-2.0) + 1 + 1 + e(1.4)) / 5 - 1)
    close(metrics["chi2_seq"], (e(-1.0) + e(1.4)) / 2 - 1)
    assert set(compute_offpolicy_metrics(OLD, None, MASK)) == {"training_ppl", "training_log_ppl"}
    prefixed = compute_rollout_corr_metrics_from_logprobs(OLD, ROLL, MASK)
    assert prefixed["rollout_corr/kl"] == metrics["kl"] and len(prefixed) == len(metrics)


def test_identical_policies_have_zero_divergence():
    torch.manual_seed(1)
    lp = -torch.rand(4, 8) * 3
    proto, mask, metrics = compute_rollout_correction_and_rejection_mask(
        lp, lp.clone(), torch.ones(4, 8), "token", 2.0, False, "token_k1,seq_max_k3", "0.9_1.1,0.01"
    )
    weights = proto.batch["rollout_is_weights"]  # a DataProto first, as verl returns it
    assert torch.equal(weights, torch.ones(4, 8)) and torch.equal(mask, torch.ones(4, 8))
    for key in ("kl", "k3_kl", "chi2_seq", "log_ppl_diff", "rollout_rs_masked_fraction"):
        assert metrics[f"rollout_corr/{key}"] == 0.0, key  # exact: every term is x - x = 0 or exp(0) - 1 = 0
    # chi2_token = exp(lse(0, ..., 0) - log(32 + 1e-8)) - 1: the 32 ones sum exactly, so only the float32
    # log(32) (one rounding of 3.47) and the 1e-8 / 32 remain
    assert metrics["rollout_corr/chi2_token"] == pytest.approx(0.0, abs=rounding_bound(1, math.log(32)) + 1e-8 / 32)
    close(metrics["rollout_corr/rollout_is_eff_sample_size"], 1.0)
    close(metrics["rollout_corr/ppl_ratio"], 1.0)


def test_entry_point_prefixes_and_disables():
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(OLD, ROLL, MASK)
    assert weights is None and torch.equal(mask, MASK) and mask is not MASK
    assert all(k.startswith("rollout_corr/") for k in metrics) and "rollout_corr/kl" in metrics
    weights, _, metrics = compute_rollout_correction_and_rejection_mask(OLD, ROLL, MASK, "token", None)
    assert weights is None and "rollout_corr/rollout_is_mean" not in metrics


@pytest.mark.parametrize(
    "config",
    [
        RolloutCorrectionConfig(
            rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"
        ),
        OmegaConf.create(
            {
                "rollout_is": "token",
                "rollout_is_threshold": 2.0,
                "rollout_rs": "token_k1",
                "rollout_rs_threshold": "0.5_2.0",
            }
        ),
        {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"},
    ],
)
def test_add_to_batch_with_any_config_form(config):
    for batch in (
        {"old_log_probs": OLD, "rollout_log_probs": ROLL, "response_mask": MASK},
        TensorDict({"old_log_probs": OLD, "rollout_log_probs": ROLL, "response_mask": MASK}, batch_size=[2]),
    ):
        batch, metrics = compute_rollout_correction_and_add_to_batch(batch, config)
        assert batch["response_mask"].tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
        torch.testing.assert_close(batch["rollout_is_weights"], torch.tensor([[e(0.5), e(-1.0), 1.0], [1.0, 2.0, 0.0]]))
        close(metrics["rollout_corr/rollout_rs_masked_fraction"], 0.4)
    with pytest.raises(ValueError, match=r"batch\['rollout_log_probs'\]"):
        compute_rollout_correction_and_add_to_batch({"old_log_probs": OLD, "response_mask": MASK}, config)


def test_add_to_batch_without_is_keeps_batch_free_of_weights():
    batch, metrics = compute_rollout_correction_and_add_to_batch(
        {"old_log_probs": OLD, "rollout_log_probs": ROLL, "response_mask": MASK}, {"rollout_is": None}
    )
    assert "rollout_is_weights" not in batch and "rollout_corr/chi2_token" in metrics


def test_bypass_mode_setup_and_correction():
    batch = {"rollout_log_probs": ROLL, "response_mask": MASK}
    corr = RolloutCorrectionConfig(rollout_is="token", loss_type="reinforce", bypass_mode=True)
    typed = apply_bypass_mode(batch, corr, PolicyLossConfig())
    assert batch["old_log_probs"] is ROLL
    assert typed.loss_mode == "bypass_mode" and typed.rollout_correction.loss_type == "reinforce"
    assert PolicyLossConfig().loss_mode == "vanilla"
    dict_cfg = OmegaConf.create({"loss_mode": "vanilla", "clip_cov_ratio": 0.1})
    updated = apply_bypass_mode(batch, {"rollout_is": "sequence"}, dict_cfg)
    assert updated.loss_mode == "bypass_mode" and updated.rollout_correction.rollout_is == "sequence"
    assert dict_cfg.loss_mode == "vanilla"
    assert apply_bypass_mode(batch, corr, {"loss_mode": "gspo"})["rollout_correction"] is corr
    with pytest.raises(ValueError, match="rollout_log_probs"):
        apply_bypass_mode({"response_mask": MASK}, corr, PolicyLossConfig())

    log_prob = OLD.clone().requires_grad_(True)  # the current policy
    weights, mask, metrics = compute_bypass_mode_correction(log_prob, ROLL, MASK, corr)
    assert not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor([[e(0.5), e(-1.0), 1.0], [1.0, 2.0, 0.0]]))
    assert torch.equal(mask, MASK) and "rollout_corr/rollout_is_eff_sample_size" in metrics
    with pytest.raises(ValueError, match="rollout_correction"):
        compute_bypass_mode_correction(log_prob, ROLL, MASK, None)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("abc", "rollout_is_threshold='abc' is not a valid threshold: 'abc' is not a number"),
        ("2_1", "rollout_is_threshold='2_1' is not a valid threshold: lower bound 2.0 > upper bound 1.0"),
        (-1.0, "rollout_is_threshold=-1.0 is not a valid threshold: bounds must be positive, got -1.0"),
        ("0.5_x", "rollout_is_threshold='0.5_x' is not a valid threshold: 'x' is not a number"),
        ("", "rollout_is_threshold='' is not a valid threshold: empty string"),
    ],
)
def test_bad_is_thresholds(spec, message):
    with pytest.raises(ValueError) as err:
        compute_rollout_correction_weights(LOG_RATIO, MASK, "token", spec)
    assert str(err.value) == message


def test_threshold_parsing_rules():
    assert parse_rollout_is_threshold(2) == (2.0, None)
    assert parse_rollout_is_threshold(" 3.5 ") == (3.5, None)
    assert parse_rollout_is_threshold("0.5_5") == (5.0, 0.5)
    with pytest.raises(TypeError, match="rollout_is_threshold=True"):
        parse_rollout_is_threshold(True)
    parsed = parse_rollout_rs_thresholds(["token_k1", "seq_mean_k3"], "4,0.01")
    assert parsed == {"token_k1": (0.25, 4.0), "seq_mean_k3": (None, 0.01)}
    assert parse_rollout_rs_thresholds(["token_k2", "seq_sum_k1"], 4) == {
        "token_k2": (None, 4.0),
        "seq_sum_k1": (0.25, 4.0),
    }
    with pytest.raises(ValueError, match=r"option 'seq_sum_k1'\): lower bound 2.0 > upper bound 0.5"):
        parse_rollout_rs_thresholds(["token_k2", "seq_sum_k1"], 0.5)  # k1 lower = 1 / 0.5


def test_bad_rs_configurations():
    with pytest.raises(
        ValueError,
        match=r"rollout_rs_threshold='0.1_0.2' \(option 'token_k2'\): k2/k3 options take a single upper bound",
    ):
        compute_rollout_rejection_mask(LOG_RATIO, MASK, "token_k2", "0.1_0.2")
    with pytest.raises(
        ValueError, match=r"rollout_rs_threshold='2_1' \(option 'seq_sum_k1'\): lower bound 2.0 > upper bound 1.0"
    ):
        compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_sum_k1", "2_1")
    with pytest.raises(
        ValueError, match=r"rollout_rs_threshold='1,2,3' has 3 entries; give one shared threshold or exactly 2"
    ):
        compute_rollout_rejection_mask(LOG_RATIO, MASK, "token_k2,token_k3", "1,2,3")
    with pytest.raises(
        ValueError,
        match=r"rollout_rs_threshold='zz' \(option 'token_k3'\) is not a valid threshold: 'zz' is not a number",
    ):
        compute_rollout_rejection_mask(LOG_RATIO, MASK, "token_k3", "zz")
    with pytest.raises(ValueError, match=r"rollout_rs option 'seq_max_k1' is not allowed; choose from \['token_k1'"):
        compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_max_k1", 2.0)
    with pytest.raises(ValueError, match="rollout_rs='token_k1' needs rollout_rs_threshold"):
        compute_rollout_correction_and_rejection_mask(OLD, ROLL, MASK, rollout_rs="token_k1")
    with pytest.raises(ValueError, match=r"rollout_is='tokens' is not allowed; choose one of \['token', 'sequence'\]"):
        compute_rollout_correction_weights(LOG_RATIO, MASK, "tokens", 2.0)
    with pytest.raises(ValueError, match="at least one valid token"):
        compute_rollout_correction_and_rejection_mask(OLD, ROLL, torch.zeros_like(MASK), "token")
    with pytest.raises(ValueError, match=r"shape mismatch: old_log_prob\[2, 3\], rollout_log_prob\[2, 2\]"):
        compute_rollout_correction_and_rejection_mask(OLD, ROLL[:, :2], MASK)


def _normalise_on_ranks(rank, world_size):
    import torch.distributed as dist

    torch.manual_seed(0)
    log_ratio = torch.randn(8, 12) * 0.5
    mask = (torch.arange(12)[None] < torch.randint(1, 13, (8, 1))).float()
    mask[5] = 0  # an empty sequence on rank 1
    rows = slice(rank * 4, rank * 4 + 4)
    diffs = {}
    for level in ("token", "sequence"):
        local, _ = compute_rollout_correction_weights(
            log_ratio[rows], mask[rows], level, 3.0, rollout_is_batch_normalize=True, group=dist.group.WORLD
        )
        whole, _ = compute_rollout_correction_weights(log_ratio, mask, level, 3.0, rollout_is_batch_normalize=True)
        alone, _ = compute_rollout_correction_weights(
            log_ratio[rows], mask[rows], level, 3.0, rollout_is_batch_normalize=True
        )
        diffs[level] = (
            (local - whole[rows]).abs().max().item(),
            (alone - whole[rows]).abs().max().item(),
            _normalise_bound(log_ratio, mask, level, whole),
        )
    return diffs


def _normalise_bound(log_ratio, mask, level, whole) -> float:
    """Two float32 paths to w / mean(w): the mean of the tokens' weights (w >= 0, no cancellation) errs
    by eps * tokens relative, the division by one more; a sequence's weight exp(sum of its log-ratios)
    errs relatively by the sum's error, eps * its length * sum |log-ratio|. Both paths: twice that."""
    num_terms = int(mask.sum()) + 1
    if level == "sequence":
        num_terms += mask.shape[-1] * float((log_ratio.abs() * mask).sum(-1).max())
    return 2 * rounding_bound(math.ceil(num_terms), float(whole.abs().max()))


def test_batch_normalize_over_a_process_group_equals_whole_batch():
    for diffs in run_distributed(_normalise_on_ranks, 2):
        for level, (with_group, without_group, bound) in diffs.items():
            assert with_group < bound, level
            assert without_group > 1e-3, level  # the local-only mean differs: the group matters
