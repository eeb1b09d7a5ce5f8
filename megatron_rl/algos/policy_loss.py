"""Policy losses with verl 0.9.1's names, semantics and metric keys.

Every entry of ``POLICY_LOSSES`` has one signature::

    fn(old_log_prob, log_prob, advantages, response_mask,
       loss_agg_mode="token-mean", config=None, rollout_is_weights=None) -> (loss, metrics)

- tensors are ``[bs, response_len]``; ``response_mask`` is 1 on tokens that count;
- ``config`` is the actor config, either verl's OmegaConf ``DictConfig`` (keys ``clip_ratio``,
  ``clip_ratio_low/high/c``, ``tau_pos/neg``, ``policy_loss.*``, ``global_batch_info``) or our
  typed ``megatron_rl.config.ActorConfig``; ``None`` means ``ActorConfig()`` defaults;
- ``rollout_is_weights`` (detached, same shape) multiply the token losses (rollout correction);
- ``metrics`` maps verl's names (``actor/pg_clipfrac``, ``actor/ppo_kl``,
  ``actor/pg_clipfrac_lower``) to Python floats.

Token losses are reduced by :func:`megatron_rl.algos.loss_agg.agg_loss` with the config's
``global_batch_info`` so that micro-batches and data-parallel ranks add up to the loss of the
whole batch. ``geo_mean`` keeps verl's own reduction (a plain mean over the micro-batch's
sequences).

This module holds the PPO-clip family (vanilla, GSPO, CISPO, Clip-Cov, KL-Cov, GMPO) and the
helpers every loss shares; ``megatron_rl.algos.policy_loss_variants`` the others (DPPO's trust
regions, SAPO, GPG, DRO, REINFORCE and bypass mode).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_rl.algos.loss_agg import LOSS_AGG_MODES, agg_loss
from megatron_rl.algos.algo_registry import register_policy_loss
from megatron_rl.algos.utils import cfg_get, check_same_shape, masked_mean, masked_sum
from megatron_rl.config.actor_rollout_ref import ActorConfig

__all__ = [
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_geo_mean",
]

# exp(±20) bounds the importance ratio; beyond it the ratio (and its gradient) is frozen.
LOG_RATIO_BOUND = 20.0

Metrics = dict[str, Any]


# ----------------------------------------------------------------------------- helpers


def _actor_config(config: Any) -> Any:
    return ActorConfig() if config is None else config


def _clip_bounds(config: Any) -> tuple[float, float]:
    """``(clip_ratio_low, clip_ratio_high)``; either falls back to ``clip_ratio`` when unset."""
    clip_ratio = cfg_get(config, "clip_ratio", 0.2)
    return cfg_get(config, "clip_ratio_low", clip_ratio), cfg_get(config, "clip_ratio_high", clip_ratio)


def _batch_info(config: Any) -> dict:
    """The step's ``global_batch_info`` as a plain dict (missing -> ``{}``: local normalisation)."""
    info = cfg_get(config, "global_batch_info", None)
    return {} if info is None else dict(info)


def _check_inputs(loss_agg_mode: str, **tensors: Optional[torch.Tensor]) -> None:
    check_same_shape(**tensors)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not allowed; choose one of {list(LOSS_AGG_MODES)}")


def _clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)


def _aggregate(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: Optional[torch.Tensor],
) -> torch.Tensor:
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_batch_info(config))


def _scalar(value: torch.Tensor | float) -> float:
    return value.detach().item() if isinstance(value, torch.Tensor) else float(value)


def _pg_metrics(
    pg_clipfrac: torch.Tensor | float, ppo_kl: torch.Tensor, pg_clipfrac_lower: torch.Tensor | float
) -> Metrics:
    return {
        "actor/pg_clipfrac": _scalar(pg_clipfrac),
        "actor/ppo_kl": _scalar(ppo_kl),
        "actor/pg_clipfrac_lower": _scalar(pg_clipfrac_lower),
    }


# ----------------------------------------------------------------------------- PPO family


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped objective with asymmetric clipping (clip-higher) and dual-clip.

    ``r = exp(clamp(logp - old, ±20))``; per token ``max(-A r, -A clip(r, 1-low, 1+high))``, and for
    ``A < 0`` additionally capped at ``-A * clip_ratio_c`` (dual-clip, arXiv:1912.09729).
    ``pg_clipfrac`` counts tokens where the clipped term wins, ``pg_clipfrac_lower`` tokens
    where the dual-clip cap applies.
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
    clip_ratio_c = cfg_get(config, "clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c!r} must be > 1.0 (the dual-clip bound for negative advantages)")

    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    losses_ppo = torch.maximum(losses_unclipped, losses_clipped)
    pg_clipfrac = masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), response_mask)

    # Dual clip: with A < 0 a huge ratio would give an unbounded loss; cap it at -A * c.
    losses_cap = -advantages * clip_ratio_c
    losses_dual = torch.min(losses_cap, losses_ppo)
    pg_clipfrac_lower = masked_mean(torch.gt(losses_ppo, losses_cap) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, losses_dual, losses_ppo)

    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _pg_metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (arXiv:2507.18071): PPO clipping on the length-normalised sequence ratio.

    ``s_i = exp(mean_t(logp - old))`` per sequence; the token form
    ``s_it = sg[s_i] * p_t / sg[p_t]`` has the value ``s_i`` and the gradient of ``s_i * logp_t``.
    The log of it is clamped at 10.
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

    log_ratio = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)  # [bs]
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / seq_lengths  # [bs]
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))  # [bs, T]

    losses_unclipped = -advantages * seq_ratio
    losses_clipped = -advantages * torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(losses_unclipped, losses_clipped)

    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    pg_clipfrac = masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), response_mask)
    return pg_loss, _pg_metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask), 0.0)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (arXiv:2506.13585): ``-sg[clip(r, 1-low, 1+high)] * A * logp``.

    The clipped ratio only weights the REINFORCE term, so every token keeps a gradient.
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

    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)

    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _pg_metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask), 0.0)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (arXiv:2505.22617): PPO clip, plus zero gradient on a few high-covariance tokens.

    Candidates are valid tokens not already clipped by PPO whose centred covariance
    ``(A - mean A) * (logp - mean logp)`` lies strictly in ``(clip_cov_lb, clip_cov_ub)``;
    ``max(1, int(clip_cov_ratio * num_valid_tokens))`` of them are drawn uniformly with
    ``torch.randperm`` on the global CPU generator (the same draw as verl for the same seed) and
    their loss is multiplied by 0. ``pg_clipfrac`` is the fraction of tokens so detached.
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
    clip_cov_ratio = cfg_get(config, "policy_loss.clip_cov_ratio", 0.0002)
    clip_cov_lb = cfg_get(config, "policy_loss.clip_cov_lb", 1.0)
    clip_cov_ub = cfg_get(config, "policy_loss.clip_cov_ub", 5.0)
    if not clip_cov_ratio > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio={clip_cov_ratio!r} must be > 0")

    # verl applies no ±20 clamp in this loss.
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)

    valid = response_mask > 0
    clipped_by_ppo = (losses_clipped > losses_unclipped) & valid
    with torch.no_grad():
        logp = log_prob.detach()
        cov = (advantages - masked_mean(advantages, response_mask)) * (logp - masked_mean(logp, response_mask))
        candidates = (cov < clip_cov_ub) & (cov > clip_cov_lb) & valid & ~clipped_by_ppo
        candidate_idx = torch.nonzero(candidates)  # [n, 2] row-major, as verl
        num_detach = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
        keep = torch.ones_like(advantages)
        if len(candidate_idx) > 0:
            perm = torch.randperm(len(candidate_idx)).to(candidate_idx.device)
            chosen = candidate_idx[perm[: min(num_detach, len(candidate_idx))]]
            keep[chosen[:, 0], chosen[:, 1]] = 0

    pg_clipfrac = masked_mean((keep == 0).float(), response_mask)
    pg_losses = torch.maximum(losses_unclipped, losses_clipped) * keep
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, {
        "actor/pg_clipfrac": _scalar(pg_clipfrac),
        "actor/ppo_kl": _scalar(masked_mean(-log_ratio, response_mask)),
    }


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (arXiv:2505.22617): unclipped ``-A r``, plus ``ppo_kl_coef * |logp - old|`` on the
    top ``max(1, int(kl_cov_ratio * num_valid))`` valid tokens by centred covariance
    (``torch.topk``, deterministic). Reports ``actor/ppo_kl`` as the mean *absolute* log-ratio.
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
    kl_cov_ratio = cfg_get(config, "policy_loss.kl_cov_ratio", 0.0002)
    ppo_kl_coef = cfg_get(config, "policy_loss.ppo_kl_coef", 1.0)
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(f"policy_loss.kl_cov_ratio={kl_cov_ratio!r} must be in (0, 1]")

    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    losses_plain = -advantages * ratio
    losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl

    valid = response_mask > 0
    flat_valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]  # [n]
    penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if flat_valid_idx.numel() > 0:
        with torch.no_grad():
            adv_valid = advantages.detach()[valid].reshape(-1)
            logp_valid = log_prob.detach()[valid].reshape(-1)
            cov = (adv_valid - adv_valid.mean()) * (logp_valid - logp_valid.mean())
            num_penalised = max(1, int(len(cov) * kl_cov_ratio))
            top = torch.topk(cov, num_penalised, largest=True).indices
            penalised[flat_valid_idx[top]] = True
    pg_losses = torch.where(penalised.view_as(valid), losses_kl, losses_plain)

    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, {"actor/ppo_kl": _scalar(masked_mean(abs_kl, response_mask))}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (arXiv:2507.20673): PPO clipping on the geometric mean of token ratios.

    Token log-ratios are clipped to ``[-low, high]`` in the pessimistic direction given
    ``sign(A)``; the sequence ratio is ``exp(mean_t clipped log-ratio)`` and the loss
    ``-mean_t(A) * ratio``, averaged over the micro-batch's sequences (``loss_agg_mode`` and
    ``global_batch_info`` are not used, as in verl). IS weights enter as their per-sequence
    geometric mean.
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

    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_low, clip_high)
    log_ratio_pessimistic = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)

    seq_lengths = response_mask.sum(dim=-1) + 1e-8  # [bs]
    seq_ratio = torch.exp(masked_sum(log_ratio_pessimistic, response_mask, axis=-1) / seq_lengths)
    seq_advantage = masked_sum(advantages, response_mask, axis=-1) / seq_lengths
    pg_losses = -seq_advantage * seq_ratio  # [bs]
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + 1e-10)
        pg_losses = pg_losses * torch.exp(masked_sum(log_w, response_mask, axis=-1) / seq_lengths)
    pg_loss = torch.mean(pg_losses)

    clipped = torch.ne(log_ratio, log_ratio_clamped)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, _pg_metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask), pg_clipfrac_lower)
