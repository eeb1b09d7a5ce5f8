"""Rollout correction's numerics (verl's ``rollout_corr_helper``): IS weights per token or per
sequence (TIS truncation, IcePop bounds, batch normalisation), rejection masks from divergence
statistics (``token_k1`` ... ``seq_max_k3``), the threshold parsers and the off-policy
diagnostics. The entry points that combine them per mode (decoupled / bypass) are in
``megatron_rl.algos.rollout_correction``, which re-exports everything here.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megatron_rl.algos.utils import check_same_shape, masked_mean, masked_sum

__all__ = [
    "SAFETY_BOUND",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "parse_rollout_is_threshold",
    "parse_rollout_rs_thresholds",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_offpolicy_metrics",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before exp: exp(20) ~ 4.9e8 still fits every float type."""

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def _positive_float(label: str, text: str) -> float:
    """``float(text)`` > 0, else ``ValueError`` starting with ``label`` (``field=value``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{label} is not a valid threshold: {text!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{label} is not a valid threshold: bounds must be positive, got {value}")
    return value


def parse_rollout_is_threshold(spec: Any, field: str = "rollout_is_threshold") -> tuple[float, Optional[float]]:
    """``(upper, lower)`` from an IS threshold: a number (TIS, ``lower=None``) or ``"low_high"`` (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        kind = "a boolean" if isinstance(spec, bool) else type(spec).__name__  # verl's wording for a bool
        raise TypeError(f"{field}={spec!r} must be a number or a 'lower_upper' string, not {kind}")
    text = str(spec).strip()
    if not text:
        raise ValueError(f"{field}={spec!r} is not a valid threshold: empty string")
    if isinstance(spec, str) and "_" in text:
        lower_text, upper_text = text.split("_", 1)
        lower, upper = (
            _positive_float(f"{field}={spec!r}", lower_text),
            _positive_float(f"{field}={spec!r}", upper_text),
        )
        if lower > upper:
            raise ValueError(f"{field}={spec!r} is not a valid threshold: lower bound {lower} > upper bound {upper}")
        return upper, lower
    return _positive_float(f"{field}={spec!r}", text), None


def _parse_rs_options(rollout_rs: Any) -> list[str]:
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs={rollout_rs!r} must be a comma separated string of {list(ROLLOUT_RS_OPTIONS)}")
    options: list[str] = []
    for opt in (part.strip() for part in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"rollout_rs option {opt!r} is not allowed; choose from {list(ROLLOUT_RS_OPTIONS)}")
        if opt not in options:  # duplicates are dropped, order kept (as verl)
            options.append(opt)
    if not options:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no option; choose from {list(ROLLOUT_RS_OPTIONS)}")
    return options


def parse_rollout_rs_thresholds(
    options: list[str], spec: Any, field: str = "rollout_rs_threshold"
) -> dict[str, tuple[Optional[float], float]]:
    """``{option: (lower, upper)}`` from ``rollout_rs_threshold`` (verl's parsing rules).

    One entry per option (comma separated) or a single entry shared by all. ``*_k1`` options
    bound the ratio: ``"low_high"``, or one number ``high`` meaning ``[1/high, high]``. k2/k3
    options take a single positive upper bound (``lower`` is None).
    """
    if spec is None:
        raise ValueError(f"{field} must be set when rollout_rs is enabled")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"{field}={spec!r} must be a number or a comma separated string")
    raw = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if not raw:
        raise ValueError(f"{field}={spec!r} contains no threshold")
    if len(raw) not in (1, len(options)):
        raise ValueError(
            f"{field}={spec!r} has {len(raw)} entries; give one shared threshold or exactly {len(options)} "
            f"(one per rollout_rs option {options})"
        )
    raw = raw * len(options) if len(raw) == 1 else raw
    thresholds: dict[str, tuple[Optional[float], float]] = {}
    for option, text in zip(options, raw):
        where = f"{field}={spec!r} (option {option!r})"
        if option.endswith("k1"):
            lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
            upper = _positive_float(where, upper_text)
            lower = 1.0 / upper if lower_text is None else _positive_float(where, lower_text)
            if lower > upper:
                raise ValueError(f"{where}: lower bound {lower} > upper bound {upper}")
            thresholds[option] = (lower, upper)
        else:
            if "_" in text:
                raise ValueError(f"{where}: k2/k3 options take a single upper bound, not {text!r}")
            thresholds[option] = (None, _positive_float(where, text))
    return thresholds


def _masked_max(values: torch.Tensor, mask_bool: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask_bool, float("-inf")).max()


def _masked_min(values: torch.Tensor, mask_bool: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask_bool, float("inf")).min()


def _count_fraction(hits: torch.Tensor, mask_bool: torch.Tensor, num_tokens: torch.Tensor) -> float:
    """``masked_mean(hits.float(), mask)`` as an exact count (no float copy of ``hits``)."""
    return ((hits & mask_bool).sum() / (num_tokens + 1e-8)).item()


def _std_from_moments(first: torch.Tensor, second: torch.Tensor) -> float:
    return torch.sqrt(torch.clamp(second - first.square(), min=0.0)).item()


def _count_weighted_moments(
    seq_values: torch.Tensor, seq_tokens: torch.Tensor, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level ``E[x]``, ``E[x^2]`` of a per-sequence value ``x`` ``[bs]`` held by ``seq_tokens`` tokens each.

    Same as masked means of the value broadcast to ``[bs, T]`` without building that tensor;
    accumulated in float64 so the variance ``E[x^2] - E[x]^2`` of a near-constant value is not noise.
    """
    weights = seq_tokens.double() / (num_tokens.double() + 1e-8)
    values = seq_values.double()
    return (weights * values).sum(), (weights * values.square()).sum()


def _seq_summary(prefix: str, seq_values: torch.Tensor, ideal: float) -> dict[str, float]:
    """Mean/std/max/min/max-deviation of a ``[num_seqs]`` statistic."""
    return {
        f"{prefix}_seq_mean": seq_values.mean().item(),
        f"{prefix}_seq_std": seq_values.std().item() if seq_values.numel() > 1 else 0.0,
        f"{prefix}_seq_max": seq_values.max().item(),
        f"{prefix}_seq_min": seq_values.min().item(),
        f"{prefix}_seq_max_deviation": (seq_values - ideal).abs().max().item(),
    }


def _require_valid_token(response_mask: torch.Tensor) -> None:
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1)")


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
    group: Optional[torch.distributed.ProcessGroup] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated (TIS) or masked (IcePop) importance weights ``pi_train / pi_rollout``.

    Args:
        log_ratio: ``[bs, T]`` ``old_log_prob - rollout_log_prob``.
        response_mask: ``[bs, T]`` 1 on valid tokens.
        rollout_is: ``token`` (one weight per token) or ``sequence`` (``exp`` of the summed
            log-ratio, shared by the sequence's tokens).
        rollout_is_threshold: number = clamp weights at it (TIS); ``"low_high"`` = zero the weights
            outside ``[low, high]`` (IcePop).
        rollout_is_batch_normalize: divide by the batch mean weight (token mean for ``token``,
            mean over non-empty sequences for ``sequence``) so the weights average 1.
        group: process group for the batch mean (the global batch); None = this rank only.

    Returns:
        ``(weights [bs, T] detached, zero on padding, metrics)``; metrics are computed before the
        batch normalisation and named ``rollout_is_*`` as in verl (without the ``rollout_corr/``
        prefix, which ``compute_rollout_correction_and_rejection_mask`` adds).
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r} is not allowed; choose one of {list(ROLLOUT_IS_LEVELS)}")
    _require_valid_token(response_mask)
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    log_ratio = log_ratio.detach()  # IS weights change the measure, not the objective: no gradient
    mask_bool = response_mask.bool()
    num_tokens = response_mask.sum()
    # With no explicit lower bound the "low" diagnostics use 1 / upper.
    lower_for_metrics = 1.0 / upper if lower is None else lower

    def truncate(raw: torch.Tensor) -> torch.Tensor:
        if lower is None:
            return raw.clamp(max=upper)
        return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))

    metrics: dict[str, float] = {}
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)) * response_mask
        weights = truncate(raw)
        metrics["rollout_is_mean"] = masked_mean(weights, response_mask).item()
        metrics["rollout_is_ratio_fraction_high"] = _count_fraction(raw > upper, mask_bool, num_tokens)
        metrics["rollout_is_ratio_fraction_low"] = _count_fraction(raw < lower_for_metrics, mask_bool, num_tokens)
        metrics["rollout_is_max"] = _masked_max(weights, mask_bool).item()
        metrics["rollout_is_min"] = _masked_min(weights, mask_bool).item()
        # weights <= upper already, so verl's clamp(0, upper) before the moments is a no-op.
        first = masked_mean(weights, response_mask)
        second = masked_mean(weights.square(), response_mask)
        seq_weights = masked_mean(weights, response_mask, axis=-1)  # [bs]
        raw_seq_weights = masked_mean(raw, response_mask, axis=-1)  # [bs]
        if lower is not None:
            oob = (raw < lower) | (raw > upper)
            metrics["rollout_is_oob_ratio"] = _count_fraction(oob, mask_bool, num_tokens)
    else:
        # One weight per sequence: work on [bs] vectors weighted by the token counts.
        seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1)  # [bs]
        seq_tokens = response_mask.sum(dim=-1).to(log_ratio.dtype)  # [bs]
        seq_present = (seq_tokens > 0).to(log_ratio.dtype)
        raw_seq = torch.exp(torch.clamp(seq_log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)) * seq_present
        weight_seq = truncate(raw_seq)  # [bs]
        weights = weight_seq.unsqueeze(-1) * response_mask  # [bs, T]
        metrics["rollout_is_max"] = torch.exp(torch.clamp(seq_log_ratio.max(), max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(seq_log_ratio.min()).item()
        first, second = _count_weighted_moments(weight_seq, seq_tokens, num_tokens)
        metrics["rollout_is_mean"] = first.item()
        # Bounds compared in log space, rounded like verl (float32 log of the float32 bound).
        log_upper = torch.log(torch.tensor(upper, device=log_ratio.device))
        log_lower = torch.log(torch.tensor(lower_for_metrics, device=log_ratio.device))
        metrics["rollout_is_ratio_fraction_high"] = (seq_log_ratio > log_upper).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (seq_log_ratio < log_lower).float().mean().item()
        token_share = seq_tokens / (seq_tokens + 1e-8)  # masked_mean over a row of identical values
        seq_weights, raw_seq_weights = weight_seq * token_share, raw_seq * token_share
        if lower is not None:
            oob = ((raw_seq < lower) | (raw_seq > upper)).to(log_ratio.dtype)
            metrics["rollout_is_oob_ratio"] = ((oob * seq_tokens).sum() / (num_tokens + 1e-8)).item()

    metrics["rollout_is_std"] = _std_from_moments(first, second) if num_tokens > 1 else 0.0
    # ESS = 1 / E[(w / E[w])^2]: 1 when all weights are equal, 1/n when one weight dominates.
    # (verl divides by zero when IcePop zeroes every weight; no weight left = no effective sample.)
    mean_square_normalized = (second / (first + 1e-8).square()).item()
    metrics["rollout_is_eff_sample_size"] = 1.0 / mean_square_normalized if mean_square_normalized > 0 else 0.0
    metrics.update(_seq_summary("rollout_is", seq_weights, ideal=1.0))
    metrics["rollout_is_seq_fraction_high"] = (raw_seq_weights > upper).float().mean().item()
    metrics["rollout_is_seq_fraction_low"] = (raw_seq_weights < lower_for_metrics).float().mean().item()

    if rollout_is_batch_normalize:
        weights_mean = _batch_mean_weight(weights, response_mask, rollout_is, group)
        if weights_mean > 1e-8:
            weights = weights / weights_mean
            metrics["rollout_is_batch_norm_factor"] = weights_mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _batch_mean_weight(
    weights: torch.Tensor, response_mask: torch.Tensor, rollout_is: str, group: Optional[Any]
) -> torch.Tensor:
    """Mean IS weight over the (global, if ``group``) batch: over tokens, or over non-empty sequences."""
    if rollout_is == "token":
        if group is None:
            return masked_mean(weights, response_mask)
        values, mask = weights, response_mask.to(weights.dtype)
    else:
        values = masked_mean(weights, response_mask, axis=-1)  # [bs]
        mask = (response_mask.sum(dim=-1) > 0).to(weights.dtype)
        if group is None:
            return (values * mask).sum() / mask.sum().clamp_min(1e-8)
    total, count = (values * mask).sum(), mask.sum()
    torch.distributed.all_reduce(total, group=group)
    torch.distributed.all_reduce(count, group=group)
    return total / count


def _k_statistic(kind: str, log_ratio_safe: torch.Tensor) -> torch.Tensor:
    """Per-token divergence: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    if kind == "k1":
        return -log_ratio_safe
    if kind == "k2":
        return 0.5 * log_ratio_safe**2
    return torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Optional[str | float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Zero the tokens/sequences whose divergence estimate leaves its bounds (a hard trust region).

    Options (comma separated in ``rollout_rs``, every one must pass): ``token_k{1,2,3}`` act per
    token; ``seq_sum_k{1,2,3}`` / ``seq_mean_k{1,2,3}`` / ``seq_max_k{2,3}`` reduce the token
    statistic over the sequence and keep or drop it whole. ``k1`` options keep
    ``log(low) <= stat <= log(high)``; k2/k3 keep ``stat <= threshold``.

    Returns:
        ``(modified_response_mask [bs, T] (dtype of response_mask), metrics)`` with verl's names
        ``rollout_rs_{option}_{mean,max,min,std,fraction_high,fraction_low,seq_*,masked_fraction,
        seq_masked_fraction}``, ``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction``.
    """
    options = _parse_rs_options(rollout_rs)
    thresholds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    check_same_shape(log_ratio=log_ratio, response_mask=response_mask)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    _require_valid_token(response_mask)

    log_ratio_safe = torch.clamp(log_ratio.detach(), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    mask_bool = response_mask.bool()
    num_tokens = response_mask.sum()
    seq_tokens = response_mask.sum(dim=-1).to(log_ratio.dtype)  # [bs]
    seq_valid = seq_tokens > 0
    # Keeps are tracked as a token-level mask (token options) and a [bs] mask (sequence options).
    token_keep: Optional[torch.Tensor] = None
    seq_keep = torch.ones_like(seq_valid)
    stats: dict[str, torch.Tensor] = {}
    metrics: dict[str, float] = {}

    for option in options:
        lower, upper = thresholds[option]
        kind = option[-2:]
        is_k1 = kind == "k1"
        # k1 bounds are ratios; the statistic is a log-ratio.
        upper_t = math.log(upper) if is_k1 else upper
        lower_t = math.log(lower) if is_k1 else 0.0
        if kind not in stats:
            stats[kind] = _k_statistic(kind, log_ratio_safe)
        stat = stats[kind]  # [bs, T]
        prefix = f"rollout_rs_{option}"

        if option.startswith("token_"):
            keep = stat <= upper_t
            if is_k1:
                keep &= stat >= lower_t
            token_keep = keep if token_keep is None else token_keep & keep
            seq_stat = masked_mean(stat, response_mask, axis=-1)
            clamped = stat.clamp(min=lower_t, max=upper_t)
            metrics[f"{prefix}_mean"] = masked_mean(stat, response_mask).item()
            metrics[f"{prefix}_max"] = _masked_max(stat, mask_bool).item()
            metrics[f"{prefix}_min"] = _masked_min(stat, mask_bool).item()
            metrics[f"{prefix}_fraction_high"] = _count_fraction(stat > upper_t, mask_bool, num_tokens)
            metrics[f"{prefix}_fraction_low"] = _count_fraction(stat < lower_t, mask_bool, num_tokens) if is_k1 else 0.0
            first, second = masked_mean(clamped, response_mask), masked_mean(clamped.square(), response_mask)
            metrics[f"{prefix}_masked_fraction"] = _count_fraction(~keep, mask_bool, num_tokens)
            seq_option_keep = ~((~keep) & mask_bool).any(dim=-1)
        else:
            if option.startswith("seq_sum_"):
                seq_stat = masked_sum(stat, response_mask, axis=-1)
            elif option.startswith("seq_mean_"):
                seq_stat = masked_mean(stat, response_mask, axis=-1)
            else:  # seq_max_: an empty sequence counts as 0
                seq_max = _row_masked_max(stat, mask_bool)
                seq_stat = torch.where(torch.isneginf(seq_max), torch.zeros_like(seq_max), seq_max)
            keep_seq = seq_stat <= upper_t
            if is_k1:
                keep_seq &= seq_stat >= lower_t
            seq_keep &= keep_seq
            valid_stat = seq_stat[seq_valid]
            clamped = seq_stat.clamp(min=lower_t, max=upper_t)
            # Token-level moments of a per-sequence value = count-weighted sums over sequences.
            metrics[f"{prefix}_mean"] = _count_weighted_moments(seq_stat, seq_tokens, num_tokens)[0].item()
            metrics[f"{prefix}_max"] = valid_stat.max().item()
            metrics[f"{prefix}_min"] = valid_stat.min().item()
            metrics[f"{prefix}_fraction_high"] = (valid_stat > upper_t).float().mean().item()
            metrics[f"{prefix}_fraction_low"] = (valid_stat < lower_t).float().mean().item() if is_k1 else 0.0
            first, second = _count_weighted_moments(clamped, seq_tokens, num_tokens)
            dropped = (~keep_seq).to(log_ratio.dtype)
            metrics[f"{prefix}_masked_fraction"] = ((seq_tokens * dropped).sum() / (num_tokens + 1e-8)).item()
            seq_option_keep = keep_seq | ~seq_valid

        metrics[f"{prefix}_std"] = _std_from_moments(first, second) if num_tokens > 1 else 0.0
        valid_seq_stat = seq_stat[seq_valid]
        metrics.update(_seq_summary(prefix, valid_seq_stat, ideal=0.0))
        metrics[f"{prefix}_seq_fraction_high"] = (valid_seq_stat > upper_t).float().mean().item()
        if is_k1:
            metrics[f"{prefix}_seq_fraction_low"] = (valid_seq_stat < lower_t).float().mean().item()
        metrics[f"{prefix}_seq_masked_fraction"] = (~seq_option_keep[seq_valid]).float().mean().item()

    final_keep = seq_keep.unsqueeze(-1) if token_keep is None else token_keep & seq_keep.unsqueeze(-1)
    final_keep = final_keep.expand_as(mask_bool)
    metrics["rollout_rs_masked_fraction"] = _count_fraction(~final_keep, mask_bool, num_tokens)
    metrics["rollout_rs_seq_masked_fraction"] = ((~final_keep) & mask_bool).any(dim=-1).float().mean().item()
    if response_mask.dtype == torch.bool:
        return response_mask & final_keep, metrics
    return response_mask * final_keep.to(response_mask.dtype), metrics


def _row_masked_max(values: torch.Tensor, mask_bool: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask_bool, float("-inf")).max(dim=-1).values


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Off-policy diagnostics between the training and rollout policies (no ``rollout_corr/`` prefix).

    ``training_ppl``/``training_log_ppl`` (batch mean of per-sequence PPL / log-PPL); with rollout
    log-probs also ``kl`` (k1, ``E[log pi_rollout - log pi_train]``), ``k3_kl``, ``rollout_ppl``,
    ``rollout_log_ppl``, ``log_ppl_diff`` (+ ``_abs``, ``_max``, ``_min``), ``ppl_ratio``,
    ``chi2_token = E_tok[rho^2] - 1`` and ``chi2_seq = E_seq[(prod rho)^2] - 1``.
    """
    _require_valid_token(response_mask)
    old_log_prob = old_log_prob.detach()
    metrics: dict[str, float] = {}
    mean_log_prob_training = masked_mean(old_log_prob, response_mask, axis=-1)  # [bs]
    metrics["training_ppl"] = torch.exp(-mean_log_prob_training).mean().item()
    metrics["training_log_ppl"] = (-mean_log_prob_training).mean().item()
    if rollout_log_prob is None:
        return metrics

    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    rollout_log_prob = rollout_log_prob.detach()
    log_ratio = old_log_prob - rollout_log_prob  # [bs, T]
    # a - b == -(b - a) exactly in IEEE arithmetic, so this is verl's masked_mean(rollout - old).
    metrics["kl"] = -masked_mean(log_ratio, response_mask).item()
    metrics["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()

    mean_log_prob_rollout = masked_mean(rollout_log_prob, response_mask, axis=-1)  # [bs]
    metrics["rollout_ppl"] = torch.exp(-mean_log_prob_rollout).mean().item()
    metrics["rollout_log_ppl"] = (-mean_log_prob_rollout).mean().item()
    log_ppl_diff = mean_log_prob_rollout - mean_log_prob_training  # [bs] = log(training_ppl / rollout_ppl)
    metrics["log_ppl_diff"] = log_ppl_diff.mean().item()
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean().item()
    metrics["log_ppl_diff_max"] = log_ppl_diff.max().item()
    metrics["log_ppl_diff_min"] = log_ppl_diff.min().item()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean().item()

    # chi^2 = E[rho^2] - 1 with rho = exp(clamped log-ratio), in log space: log E[rho^2] = lse(2 log rho) - log n.
    mask_bool = response_mask.bool()
    doubled = (2.0 * torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)).masked_fill_(~mask_bool, -math.inf)
    log_mean_rho_squared = torch.logsumexp(doubled.flatten(), dim=0).item() - math.log(
        response_mask.sum().item() + 1e-8
    )
    metrics["chi2_token"] = math.exp(log_mean_rho_squared) - 1.0
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1)  # [bs]
    rho_squared_seq = torch.exp(2.0 * torch.clamp(seq_log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    metrics["chi2_seq"] = (rho_squared_seq.mean() - 1.0).item()
    return metrics
