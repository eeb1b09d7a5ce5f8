"""verl 0.9.1 functions and constants that have no other home here, by verl's names and signatures.

A verl user's ``from verl.trainer.ppo.core_algos import ...`` / ``from verl.trainer.ppo.rollout_corr_helper
import ...`` / ``from verl.utils import group_mean_std`` becomes ``from megatron_rl.algos import ...``:

- ``compute_policy_loss``: verl's deprecated PPO-clip entry point (``cliprange*`` arguments, four
  tensors back); it runs the registered ``vanilla`` loss.
- ``compute_rewards``: ``scores - kl_ratio * (old_log_prob - ref_log_prob)``.
- ``group_mean_std``: per-group mean / std / count of ``[N]`` scores (float32, the variance
  floored at ``eps``, a one-sample group gets mean 0 and std 1), verl's ``verl.utils.groupwise``.
- ``SUPPORTED_ROLLOUT_RS_OPTIONS`` / ``TOKEN_LEVEL_ROLLOUT_RS_OPTIONS``: the rejection-sampling
  options as sets; ``compute_is_metrics`` / ``compute_rs_metrics``: the IS-weight and per-option
  rejection diagnostics from explicit tensors (the rollout-correction entry points compute the same
  numbers on the way, without the broadcast ``[bs, T]`` copies).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from megatron_rl.algos.policy_loss import compute_policy_loss_vanilla
from megatron_rl.algos.rollout_correction import ROLLOUT_RS_OPTIONS, SAFETY_BOUND
from megatron_rl.algos.utils import masked_mean

__all__ = [
    "compute_policy_loss",
    "compute_rewards",
    "group_mean_std",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "compute_is_metrics",
    "compute_rs_metrics",
]

SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = set(ROLLOUT_RS_OPTIONS)
"""Every ``rollout_rs`` option (verl's set)."""
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}
"""The options that reject single tokens; the others keep or drop whole sequences."""


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: Optional[float] = None,
    cliprange_low: Optional[float] = None,
    cliprange_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's deprecated PPO-clip loss: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``.

    ``cliprange_low`` / ``cliprange_high`` default to ``cliprange`` (which must then be given);
    ``clip_ratio_c`` is the dual-clip bound (> 1). Same numbers as the ``vanilla`` policy loss,
    which is what new code should call (``get_policy_loss_fn("vanilla")``).
    """
    warnings.warn(
        "compute_policy_loss is deprecated in verl; use get_policy_loss_fn('vanilla')", DeprecationWarning, stacklevel=2
    )
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss: give cliprange (or both cliprange_low and cliprange_high)")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c!r} must be > 1.0 (the dual-clip bound for negative advantages)")
    config = {
        "clip_ratio": cliprange if cliprange is not None else low,
        "clip_ratio_low": low,
        "clip_ratio_high": high,
        "clip_ratio_c": clip_ratio_c,
    }
    loss, metrics = compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, None
    )
    as_tensor = lambda key: torch.tensor(metrics[key], dtype=log_prob.dtype, device=log_prob.device)  # noqa: E731
    return loss, as_tensor("actor/pg_clipfrac"), as_tensor("actor/ppo_kl"), as_tensor("actor/pg_clipfrac_lower")


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """Token rewards with a fixed k1 KL penalty: ``scores - kl_ratio * (old_log_prob - ref_log_prob)``."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


def group_mean_std(
    scores: torch.Tensor, gidx: torch.Tensor, eps: float = 1e-6, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group ``(mean, std, count)``, each ``[G]`` float32, of ``scores [N]`` with group ids ``gidx [N]``
    in ``0..G-1`` (verl's ``group_mean_std``).

    ``std = sqrt(max(var, eps))`` with the unbiased variance; a one-sample group gets mean 0, std 1.
    """
    target = scores.device if device is None else torch.device(device)
    scores = scores.reshape(-1).to(device=target, dtype=torch.float32)
    gidx = gidx.reshape(-1).to(device=target, dtype=torch.long)
    if scores.numel() != gidx.numel():
        raise ValueError(f"scores and gidx length mismatch: {scores.numel()} vs {gidx.numel()}")
    num_groups = int(gidx.max().item()) + 1 if gidx.numel() else 0
    count = torch.zeros(num_groups, device=target).index_add_(0, gidx, torch.ones_like(scores))
    mean = torch.zeros(num_groups, device=target).index_add_(0, gidx, scores) / count.clamp_min(1.0)
    centered = scores - mean[gidx]
    var = torch.zeros(num_groups, device=target).index_add_(0, gidx, centered * centered) / (count - 1).clamp_min(1.0)
    std = var.clamp(min=eps).sqrt()
    single = count <= 1
    return mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0), count


def _masked_extreme(values: torch.Tensor, mask_bool: torch.Tensor, largest: bool) -> float:
    fill = float("-inf") if largest else float("inf")
    filled = values.masked_fill(~mask_bool, fill)
    return (filled.max() if largest else filled.min()).item()


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: Optional[float] = None,
) -> dict[str, float]:
    """Diagnostics of IS weights (verl's names, no ``rollout_corr/`` prefix).

    Args:
        rollout_is_weights: ``[bs, T]`` the applied (truncated / IcePop-masked) weights.
        raw_rollout_is_weights: ``[bs, T]`` the weights before truncation, zero on padding.
        log_ratio_for_metrics: the unclamped log-ratio: ``[bs, T]`` (token) or ``[bs, 1]`` summed (sequence).
        response_mask: ``[bs, T]`` 1 on valid tokens (at least one).
        rollout_is: ``token`` or ``sequence``.
        rollout_is_threshold / rollout_is_threshold_lower: the bounds (lower defaults to ``1 / upper``).
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is={rollout_is!r} is not allowed; choose one of ['token', 'sequence']")
    upper = float(rollout_is_threshold)
    lower = 1.0 / upper if rollout_is_threshold_lower is None else float(rollout_is_threshold_lower)
    mask_bool = response_mask.bool()
    metrics: dict[str, float] = {"rollout_is_mean": masked_mean(rollout_is_weights, response_mask).item()}
    if rollout_is == "sequence":
        device = rollout_is_weights.device
        log_upper, log_lower = (
            torch.log(torch.tensor(upper, device=device)),
            torch.log(torch.tensor(lower, device=device)),
        )
        metrics["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean(
            (raw_rollout_is_weights > upper).float(), response_mask
        ).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean(
            (raw_rollout_is_weights < lower).float(), response_mask
        ).item()
        metrics["rollout_is_max"] = _masked_extreme(rollout_is_weights, mask_bool, largest=True)
        metrics["rollout_is_min"] = _masked_extreme(rollout_is_weights, mask_bool, largest=False)
    clamped = rollout_is_weights.clamp(min=0.0, max=upper)
    first, second = masked_mean(clamped, response_mask), masked_mean(clamped.square(), response_mask)
    metrics["rollout_is_std"] = (
        torch.sqrt(torch.clamp(second - first.square(), min=0.0)).item() if response_mask.sum() > 1 else 0.0
    )
    normalized = clamped / (first + 1e-8)
    # ESS = 1 / E[(w / E[w])^2]; with every weight zeroed (IcePop) no sample is effective.
    mean_square = masked_mean(normalized.square(), response_mask).item()
    metrics["rollout_is_eff_sample_size"] = 1.0 / mean_square if mean_square > 0 else 0.0
    if rollout_is_weights.dim() > 1:
        seq = masked_mean(rollout_is_weights, response_mask, axis=-1)  # [bs]
        raw_seq = masked_mean(raw_rollout_is_weights, response_mask, axis=-1)
        metrics.update(
            {
                "rollout_is_seq_mean": seq.mean().item(),
                "rollout_is_seq_std": seq.std().item() if seq.numel() > 1 else 0.0,
                "rollout_is_seq_max": seq.max().item(),
                "rollout_is_seq_min": seq.min().item(),
                "rollout_is_seq_max_deviation": (seq - 1.0).abs().max().item(),
                "rollout_is_seq_fraction_high": (raw_seq > upper).float().mean().item(),
                "rollout_is_seq_fraction_low": (raw_seq < lower).float().mean().item(),
            }
        )
    return metrics


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: Optional[torch.Tensor],
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> dict[str, float]:
    """Diagnostics of one rejection-sampling option, named ``rollout_rs_{option_name}_*`` (verl's).

    Args:
        option_name: the ``rollout_rs`` option (``token_k1``, ``seq_mean_k3`` ...).
        rs_statistic: ``[bs, T]`` the statistic per token (a sequence statistic broadcast over its tokens).
        response_mask: ``[bs, T]`` 1 on valid tokens (at least one).
        seq_valid_mask: ``[bs]`` sequences with at least one valid token.
        level: ``token`` or ``sequence``.
        per_sequence_values: ``[bs]`` the sequence statistic, or None (then the token mean per row).
        rollout_rs_threshold / rollout_rs_threshold_lower: bounds in the statistic's units (log-ratio for k1).
        apply_lower_threshold: whether the lower bound applies (k1 options).
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    if option_name not in SUPPORTED_ROLLOUT_RS_OPTIONS:
        raise ValueError(
            f"rollout_rs option {option_name!r} is not allowed; choose from {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}"
        )
    prefix, mask_bool = f"rollout_rs_{option_name}", response_mask.bool()
    upper, lower = rollout_rs_threshold, rollout_rs_threshold_lower
    seq_values = (
        per_sequence_values if per_sequence_values is not None else masked_mean(rs_statistic, response_mask, axis=-1)
    )
    seq_values = seq_values.squeeze(-1) if seq_values.dim() > 1 else seq_values
    valid = seq_values[seq_valid_mask]
    by_sequence = level == "sequence" and valid.numel() > 0
    metrics: dict[str, float] = {f"{prefix}_mean": masked_mean(rs_statistic, response_mask).item()}
    if by_sequence:
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = valid.max().item(), valid.min().item()
        metrics[f"{prefix}_fraction_high"] = (valid > upper).float().mean().item()
        metrics[f"{prefix}_fraction_low"] = (valid < lower).float().mean().item() if apply_lower_threshold else 0.0
    else:
        metrics[f"{prefix}_max"] = _masked_extreme(rs_statistic, mask_bool, largest=True)
        metrics[f"{prefix}_min"] = _masked_extreme(rs_statistic, mask_bool, largest=False)
        metrics[f"{prefix}_fraction_high"] = masked_mean((rs_statistic > upper).float(), response_mask).item()
        metrics[f"{prefix}_fraction_low"] = (
            masked_mean((rs_statistic < lower).float(), response_mask).item() if apply_lower_threshold else 0.0
        )
    if response_mask.sum() > 1:
        clamped = rs_statistic.clamp(min=lower if apply_lower_threshold else 0.0, max=upper)
        first, second = masked_mean(clamped, response_mask), masked_mean(clamped.square(), response_mask)
        metrics[f"{prefix}_std"] = torch.sqrt(torch.clamp(second - first.square(), min=0.0)).item()
    else:
        metrics[f"{prefix}_std"] = 0.0
    summary: dict[str, Any]
    if valid.numel() > 0:
        summary = {
            "seq_mean": valid.mean().item(),
            "seq_std": valid.std().item() if valid.numel() > 1 else 0.0,
            "seq_max": valid.max().item(),
            "seq_min": valid.min().item(),
            "seq_max_deviation": valid.abs().max().item(),
            "seq_fraction_high": (valid > upper).float().mean().item(),
        }
        if apply_lower_threshold:
            summary["seq_fraction_low"] = (valid < lower).float().mean().item()
    else:
        summary = dict.fromkeys(
            ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high", "seq_fraction_low"),
            0.0,
        )
    metrics.update({f"{prefix}_{key}": value for key, value in summary.items()})
    return metrics
