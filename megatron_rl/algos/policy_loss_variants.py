"""The policy losses beyond PPO-clip, with verl 0.9.1's names, semantics and metric keys: DPPO's
trust regions (``dppo_tv``, ``dppo_kl``), SAPO, GPG, DRO, REINFORCE (bypass mode's
``reinforce`` loss type) and ``bypass_mode`` itself. Same signature and helpers as
``megatron_rl.algos.policy_loss``; ``sapo`` keeps verl's own ``seq-mean-token-mean`` reduction.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_rl.algos.loss_agg import agg_loss
from megatron_rl.algos.policy_loss import (
    _actor_config,
    _clip_bounds,
    _batch_info,
    _check_inputs,
    _clamped_log_ratio,
    _aggregate,
    _scalar,
    _pg_metrics,
    Metrics,
    compute_policy_loss_vanilla,
)
from megatron_rl.algos.algo_registry import register_policy_loss
from megatron_rl.algos.utils import cfg_get, masked_mean

__all__ = [
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_dro",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_bypass_mode",
]


def _dppo_loss(
    valid_fn,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Metrics]:
    """DPPO (arXiv:2602.04879) shared body: ``-A * sg[min(r, clip_ratio_c)] * logp`` on the tokens
    ``valid_fn`` keeps inside the divergence trust region; ``clip_ratio`` is the divergence
    threshold here and ``clip_ratio_c`` (default 20) a truncated-IS cap, not a dual clip.
    """
    config = _actor_config(config)
    _check_inputs(
        loss_agg_mode,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    clip_low, clip_high = _clip_bounds(config)
    truncation = cfg_get(config, "clip_ratio_c", 20.0)

    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    truncated_ratio = torch.clamp(ratio, max=truncation).detach()
    with torch.no_grad():
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        valid_pos, valid_neg = valid_fn(prob, old_prob, log_prob, old_log_prob, clip_low, clip_high)
        valid_mask = torch.where(advantages > 0, valid_pos, valid_neg).float()

    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)

    pg_clipfrac = masked_mean(1.0 - valid_mask, response_mask)
    pg_clipfrac_lower = masked_mean((ratio > truncation).float() * valid_mask, response_mask)
    return pg_loss, _pg_metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask), pg_clipfrac_lower)


def _tv_trust_region(prob, old_prob, log_prob, old_log_prob, clip_low, clip_high):
    # A > 0 may raise p by at most clip_high; A <= 0 may lower it by at most clip_low.
    return (prob - old_prob) <= clip_high, (prob - old_prob) >= -clip_low


def _binary_kl_trust_region(prob, old_prob, log_prob, old_log_prob, clip_low, clip_high):
    # KL between Bernoulli(old_prob) and Bernoulli(prob); moves away from the advantage's
    # direction are always allowed.
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    return (binary_kl <= clip_high) | (prob <= old_prob), (binary_kl <= clip_low) | (prob >= old_prob)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV: tokens whose probability moved by more than ``clip_ratio_high`` (up, for
    ``A > 0``) or ``clip_ratio_low`` (down, for ``A <= 0``) get no gradient."""
    return _dppo_loss(
        _tv_trust_region, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL: like ``dppo_tv`` with the binary KL ``KL(Bern(p_old) || Bern(p))`` as the
    divergence (bounded by ``clip_ratio_high`` for ``A > 0``, ``clip_ratio_low`` otherwise)."""
    return _dppo_loss(
        _binary_kl_trust_region,
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (arXiv:2511.20347): a smooth gate instead of a hard clip.

    ``loss = -A * sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` for ``A > 0`` else
    ``tau_neg``; its gradient at ``r = 1`` equals that of ``-A r``. Always aggregated with
    ``seq-mean-token-mean`` (as verl); the clip fractions are reported as 0.
    """
    config = _actor_config(config)
    _check_inputs(
        loss_agg_mode,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    tau_pos = torch.as_tensor(cfg_get(config, "tau_pos", 1.0), dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(cfg_get(config, "tau_neg", 1.05), dtype=advantages.dtype, device=advantages.device)

    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages

    pg_loss = _aggregate(pg_losses, response_mask, "seq-mean-token-mean", config, rollout_is_weights)
    return pg_loss, _pg_metrics(0.0, masked_mean(-log_ratio, response_mask), 0.0)


# ----------------------------------------------------------------------------- REINFORCE family


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (arXiv:2504.02546): plain policy gradient ``-logp * A``; no metrics (as verl)."""
    config = _actor_config(config)
    _check_inputs(
        loss_agg_mode,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    pg_losses = -log_prob * advantages
    return _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights), {}


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Direct Reward Optimisation: ``-(logp * A - dro_beta / 2 * (logp - old)^2)``.

    ``policy_loss.dro_beta`` must be set to a positive number.
    """
    config = _actor_config(config)
    _check_inputs(
        loss_agg_mode,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    beta = cfg_get(config, "policy_loss.dro_beta", None)
    if beta is None or not beta > 0:
        raise ValueError(f"policy_loss.dro_beta={beta!r}: loss_mode 'dro' needs a positive dro_beta")

    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, {"actor/ppo_kl": _scalar(masked_mean(-log_ratio, response_mask))}


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE ``-A * logp`` (times detached IS weights ``w`` if given), no clipping.

    ``actor/ppo_kl`` is the mean ``rollout_log_prob - log_prob`` (the policy drift since rollout).
    """
    config = _actor_config(config)
    _check_inputs(
        loss_agg_mode,
        rollout_log_prob=rollout_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    if rollout_is_weights is not None:
        pg_losses = -advantages * log_prob * rollout_is_weights
    else:
        pg_losses = -advantages * log_prob
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_batch_info(config))
    kl = masked_mean(-(log_prob - rollout_log_prob), response_mask)
    return pg_loss, {"actor/ppo_kl": _scalar(kl)}


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Bypass mode: ``old_log_prob`` *is* the rollout log-prob (no separate old-policy pass).

    IS weights ``pi_current / pi_rollout`` and the rejection mask are computed here from
    ``policy_loss.rollout_correction`` (``rollout_is``, ``rollout_is_threshold``,
    ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``), detached.
    ``loss_type="reinforce"`` applies the weights to ``-A * logp``; ``"ppo_clip"`` runs
    ``vanilla`` on the rejection-masked tokens without them (its ratio already is the IS
    ratio). The passed ``rollout_is_weights`` are ignored. Metrics add ``rollout_corr/*``.
    """
    from megatron_rl.algos.rollout_correction import compute_rollout_correction_and_rejection_mask, is_weights_of

    config = _actor_config(config)
    _check_inputs(
        loss_agg_mode, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
    )
    rc = cfg_get(config, "policy_loss.rollout_correction", None)
    if rc is None:
        raise ValueError(
            "loss_mode='bypass_mode' needs policy_loss.rollout_correction in the actor config; it is missing"
        )
    loss_type = rc.get("loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(
            f"policy_loss.rollout_correction.loss_type={loss_type!r} is not allowed; "
            "choose one of ['ppo_clip', 'reinforce']"
        )

    with torch.no_grad():
        is_weights, effective_mask, rollout_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach(),  # the current policy: the ratio is pi_current / pi_rollout
            rollout_log_prob=old_log_prob,
            response_mask=response_mask,
            rollout_is=rc.get("rollout_is", None),
            rollout_is_threshold=rc.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=rc.get("rollout_is_batch_normalize", False),
            rollout_rs=rc.get("rollout_rs", None),
            rollout_rs_threshold=rc.get("rollout_rs_threshold", None),
        )

    if loss_type == "reinforce":
        pg_loss, pg_metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, is_weights_of(is_weights)
        )
    else:
        # Applying the IS weights on top of the PPO ratio would count the correction twice.
        pg_loss, pg_metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, None
        )
    pg_metrics.update(rollout_metrics)
    return pg_loss, pg_metrics
