"""On-policy distillation: top-k forward KL, single-sample estimators, policy-gradient mode."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from megatron_rl.algos import POLICY_LOSSES
from megatron_rl.algos.distillation_loss import (
    DISTILLATION_LOSSES,
    DistillationInputs,
    DistillationLossConfig,
    TopKDistillation,
    combine_with_policy_loss,
    compute_distillation_loss,
    compute_forward_kl_topk,
)
from megatron_rl.algos.algo_registry import UnknownNameError
from tests.numerics import assert_close_within, rounding_bound

ln = math.log
# Student distribution [0.1, 0.2, 0.3, 0.4]; teacher's top-2: token 3 (0.5) and token 2 (0.3).
STUDENT_LOGITS = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.4]]], dtype=torch.float64))
TEACHER_LP = torch.log(torch.tensor([[[0.5, 0.3]]], dtype=torch.float64))
TEACHER_IDS = torch.tensor([[[3, 2]]])


def test_registry_has_verls_mode_names():
    assert set(DISTILLATION_LOSSES) == {"forward_kl_topk", "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    with pytest.raises(
        UnknownNameError, match=r"unknown distillation loss 'reverse_kl'; valid names: abs, forward_kl_topk"
    ):
        DISTILLATION_LOSSES["reverse_kl"]


# The hand cases below run in float64: a dozen roundings of values up to |ln 0.1| err by ~1e-15, so
# abs=1e-12 is rounding_bound(12, 2.3, float64) = 6e-15 with room; a wrong term moves them by > 1e-2.
def test_forward_kl_topk_hand_computed_and_gradient():
    logits = STUDENT_LOGITS.clone().requires_grad_(True)
    out = compute_forward_kl_topk(logits, TEACHER_LP, TEACHER_IDS, log_prob_min_clamp=None)
    # 0.5 * (ln 0.5 - ln 0.4) + 0.3 * (ln 0.3 - ln 0.3)
    assert out.distillation_losses.item() == pytest.approx(0.5 * ln(1.25), abs=1e-12)
    assert out.student_mass.item() == pytest.approx(0.7, abs=1e-12)
    assert out.teacher_mass.item() == pytest.approx(0.8, abs=1e-12)
    assert out.overlap_count.item() == 2 and out.topk == 2
    assert out.overlap_token_advantage.item() == pytest.approx(-0.5 * ln(1.25) / 2, abs=1e-12)
    out.distillation_losses.sum().backward()
    # dL/dz_j = m * p_j - q_j [j in top-k], m = teacher top-k mass 0.8
    expected = torch.tensor([0.08, 0.16, 0.24 - 0.3, 0.32 - 0.5], dtype=torch.float64)
    torch.testing.assert_close(logits.grad[0, 0], expected, rtol=0, atol=1e-12)


def test_forward_kl_topk_clamp_stops_gradient_of_clamped_entries():
    logits = STUDENT_LOGITS.clone().requires_grad_(True)
    out = compute_forward_kl_topk(logits, TEACHER_LP, TEACHER_IDS, log_prob_min_clamp=-1.0)
    # ln 0.3 = -1.20 is floored to -1 on both sides: that entry contributes e^-1 * 0, no gradient
    assert out.distillation_losses.item() == pytest.approx(0.5 * ln(1.25), abs=1e-12)
    assert out.student_mass.item() == pytest.approx(0.7, abs=1e-12)  # masses are taken before the floor
    out.distillation_losses.sum().backward()
    # only token 3 is active: m = 0.5, grad = 0.5 * p - 0.5 * [j == 3]
    expected = torch.tensor([0.05, 0.1, 0.15, 0.2 - 0.5], dtype=torch.float64)
    torch.testing.assert_close(logits.grad[0, 0], expected, rtol=0, atol=1e-12)


def test_forward_kl_topk_chunked_equals_full_and_no_overlap():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40) * 2
    teacher_lp, teacher_ids = torch.log_softmax(torch.randn(3, 5, 40), -1).topk(6, dim=-1)
    full = compute_forward_kl_topk(logits, teacher_lp, teacher_ids)
    chunked = compute_forward_kl_topk(logits, teacher_lp, teacher_ids, chunk_size=4)
    # log_softmax vs logsumexp-then-gather: each float32 log-prob errs by eps * (40 + 6) * max|logit|, a loss
    # is a sum of teacher probabilities (<= 1) times those; two such paths differ by twice that.
    assert chunked.distillation_losses.dtype == full.distillation_losses.dtype
    assert_close_within(
        chunked.distillation_losses,
        full.distillation_losses,
        2 * rounding_bound(40 + 6, float(logits.abs().max())),
        "chunked vs full top-k KL",
    )
    assert torch.equal(chunked.overlap_count, full.overlap_count)
    # Teacher's top-2 = the student's two least likely tokens: no overlap -> advantage 0.
    out = compute_forward_kl_topk(STUDENT_LOGITS, TEACHER_LP, torch.tensor([[[0, 1]]]))
    assert out.overlap_count.item() == 0 and out.overlap_token_advantage.item() == 0.0
    with pytest.raises(ValueError, match=r"shape mismatch: student_logits\[1, 1, 4\]"):
        compute_forward_kl_topk(STUDENT_LOGITS, TEACHER_LP, TEACHER_IDS[..., :1])


def test_forward_kl_topk_loss_entry_clamps_and_reports_masses():
    topk = TopKDistillation(
        distillation_losses=torch.tensor([[0.4, -0.1, 9.0]]),
        student_mass=torch.tensor([[0.5, 0.7, 0.0]]),
        teacher_mass=torch.tensor([[0.9, 0.8, 0.0]]),
        overlap_count=torch.tensor([[2, 0, 4]]),
        overlap_token_advantage=torch.tensor([[-0.2, 0.0, -5.0]]),
        topk=4,
    )
    inputs = DistillationInputs(response_mask=torch.tensor([[1.0, 1.0, 0.0]]), topk=topk)
    loss, metrics = compute_distillation_loss(
        inputs, DistillationLossConfig(loss_mode="forward_kl_topk", use_policy_gradient=False)
    )
    assert loss.item() == pytest.approx(0.2)  # token-mean of [0.4, clamp_min(-0.1, 0) = 0]
    assert metrics["distillation/loss_min"] == pytest.approx(0.0) and metrics["distillation/loss_max"] == pytest.approx(
        0.4
    )
    assert metrics["distillation/student_mass"] == pytest.approx(0.6)
    assert metrics["distillation/teacher_mass_min"] == pytest.approx(0.8)
    assert metrics["distillation/overlap_ratio"] == pytest.approx(1 / 4)  # mean count 1 over k = 4
    assert metrics["distillation/overlap_token_advantage"] == pytest.approx(-0.2)  # only the first token overlaps
    with pytest.raises(ValueError, match="needs inputs.topk"):
        compute_distillation_loss(
            DistillationInputs(response_mask=inputs.response_mask),
            {"loss_mode": "forward_kl_topk", "use_policy_gradient": False},
        )


STUDENT = torch.tensor([[-1.0, -2.0, -0.7]])
TEACHER = torch.tensor([[-1.5, -1.0, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_supervised_estimator_loss_hand_computed():
    student = STUDENT.clone().requires_grad_(True)
    inputs = DistillationInputs(response_mask=MASK, student_log_probs=student, teacher_log_probs=TEACHER)
    loss, metrics = compute_distillation_loss(inputs, {"loss_mode": "k3", "use_policy_gradient": False})
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]  # exp(t - s) - (t - s) - 1
    # float32 against float64: the inputs' rounding, t - s, exp, two subtractions and the 2-token mean,
    # about 8 roundings on values up to e
    tol = rounding_bound(8, math.e)
    assert loss.item() == pytest.approx(sum(k3) / 2, abs=tol)
    assert metrics["distillation/abs_loss"] == pytest.approx(sum(k3) / 2, abs=tol)
    assert metrics["distillation/loss_max"] == pytest.approx(k3[1], abs=tol)
    loss.backward()
    # d k3 / d s = 1 - exp(t - s): [1 - e^-0.5, 1 - e], token-mean over 2 tokens
    torch.testing.assert_close(student.grad, torch.tensor([[(1 - math.exp(-0.5)) / 2, (1 - math.e) / 2, 0.0]]))
    with pytest.raises(ValueError, match="need inputs.student_log_probs and inputs.teacher_log_probs"):
        compute_distillation_loss(
            DistillationInputs(response_mask=MASK, student_log_probs=STUDENT),
            {"loss_mode": "k3", "use_policy_gradient": False},
        )


def test_policy_gradient_mode_uses_negative_loss_as_advantage():
    student = STUDENT.clone().requires_grad_(True)
    inputs = DistillationInputs(
        response_mask=MASK, student_log_probs=student, teacher_log_probs=TEACHER, old_log_probs=STUDENT.clone()
    )
    loss, metrics = compute_distillation_loss(inputs, DistillationLossConfig(loss_mode="k1"))
    # k1 = s - t = [0.5, -1.0]; advantage = -k1; on-policy ratio 1: loss = mean(-A) = mean(k1)
    assert loss.item() == -0.25  # exact: k1 = [0.5, -1.0] exactly in float32, ratio exp(0) = 1, a 2-term mean
    loss.backward()
    # d/ds of -A * exp(s - old) at ratio 1 is -A = k1; token-mean divides by 2. The advantage is detached.
    torch.testing.assert_close(student.grad, torch.tensor([[0.25, -0.5, 0.0]]))
    assert metrics["distillation/ppo_kl"] == 0.0  # exact: old is a clone of the student, old - new = 0
    assert {"distillation/pg_clipfrac", "distillation/pg_clipfrac_lower", "distillation/abs_loss"} <= set(metrics)
    assert not any(key.startswith("actor/") for key in metrics)


def test_policy_gradient_mode_equals_the_policy_loss_with_clamped_advantages():
    torch.manual_seed(0)
    student = -torch.rand(4, 6) * 3
    teacher = student - torch.randn(4, 6) * 8  # k1 beyond the +-10 clamp on some tokens
    old = student + torch.randn(4, 6) * 0.2
    mask = (torch.arange(6)[None] < torch.tensor([[6], [2], [4], [5]])).float()
    cfg = OmegaConf.create({"loss_mode": "k1", "loss_max_clamp": 10.0, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28})
    inputs = DistillationInputs(
        response_mask=mask, student_log_probs=student, teacher_log_probs=teacher, old_log_probs=old
    )
    loss, metrics = compute_distillation_loss(inputs, cfg, "seq-mean-token-mean")
    advantages = -(student - teacher).clamp(-10.0, 10.0)
    expected, _ = POLICY_LOSSES["vanilla"](
        old,
        student,
        advantages,
        mask,
        "seq-mean-token-mean",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio": 0.2},
    )
    # exact: the same policy loss on the same float32 values (-clamp(s - t) is the loss's own advantage)
    assert loss.item() == expected.item()
    raw = (student - teacher)[mask.bool()]
    assert metrics["distillation/loss_min"] == pytest.approx(raw.min().item())
    assert metrics["distillation/loss_max"] == pytest.approx(raw.max().item())
    assert raw.abs().max() > 10.0  # the clamp mattered


def test_combine_with_policy_loss():
    distill = torch.tensor(2.0)
    cfg = DistillationLossConfig(distillation_loss_coef=0.5)
    total, metrics = combine_with_policy_loss(
        distill, {"distillation/abs_loss": 1.0}, cfg, torch.tensor(0.3), {"actor/pg_loss": 0.3}
    )
    assert total.item() == pytest.approx(0.3 + 0.5 * 2.0)
    assert metrics == {"actor/pg_loss": 0.3, "distillation/abs_loss": 1.0, "distillation/loss": 2.0}
    alone, _ = combine_with_policy_loss(
        distill, {}, {"use_task_rewards": False, "distillation_loss_coef": 0.5}, torch.tensor(0.3)
    )
    assert alone.item() == 2.0  # without task rewards the coefficient does not apply
    with pytest.raises(ValueError, match="use_task_rewards=True needs the task policy_loss"):
        combine_with_policy_loss(distill, {}, cfg)


def test_config_validation():
    with pytest.raises(
        ValueError, match=r"distillation_loss.loss_mode='topk' is not allowed; choose one of \['forward_kl_topk', 'kl'"
    ):
        DistillationLossConfig(loss_mode="topk")
    with pytest.raises(ValueError, match="loss_mode='k1' with use_policy_gradient=False is wrong"):
        DistillationLossConfig(loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="loss_mode='k1' with use_policy_gradient=False is wrong"):
        compute_distillation_loss(
            DistillationInputs(response_mask=MASK), {"loss_mode": "k1", "use_policy_gradient": False}
        )
    with pytest.raises(ValueError, match="needs inputs.old_log_probs"):
        compute_distillation_loss(
            DistillationInputs(response_mask=MASK, student_log_probs=STUDENT, teacher_log_probs=TEACHER),
            {"loss_mode": "k3"},
        )
    cfg = DistillationLossConfig.from_dict({"loss_mode": "forward_kl_topk", "topk": 64, "use_policy_gradient": False})
    assert cfg.topk == 64 and cfg.log_prob_min_clamp == -10.0
