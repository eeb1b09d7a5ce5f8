"""The optimal-token-baseline advantage estimators (verl 0.9.1's ``optimal_token_baseline`` and
``tir_optimal_token_baseline``): a per-token baseline that minimises the policy-gradient
variance, from the returns and the path variance ``||s_t||^2 = 1 - 2 pi_t + sum_v pi_v^2``. They
declare ``needs_sum_pi_squared``: the trainer asks the actor for ``sum_pi_squared`` (the fused
vocab-parallel pass computes it with the log-probs). Same conventions as ``megatron_rl.algos.advantage``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.algos.advantage import (
    _check_inputs,
    _groups,
    _reverse_cumsum,
)
from megatron_rl.algos.algo_registry import register_adv_est

__all__ = [
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
]


def _otb_inputs(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    sum_pi_squared: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks, then ``(mask, returns G_t, cumulative path-variance W_t)``, all ``[bs, T]``."""
    for arg, value in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared)):
        if value is None:
            raise ValueError(
                f"{name}: {arg} [batch, response_length] is required (set "
                f"actor.calculate_sum_pi_squared=True for sum_pi_squared)"
            )
    mask, _ = _check_inputs(
        name,
        token_level_rewards,
        response_mask,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
    )
    returns = _reverse_cumsum(token_level_rewards * mask)
    # ||s_t||^2 = 1 - 2 pi_t + sum_v pi_v^2, scaled by rho^2 under rollout importance sampling
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    w_cum = torch.where(mask.bool(), w, 0.0).cumsum(dim=-1)
    return mask, returns, w_cum


def _zero_tail_cut(
    lengths: torch.Tensor, gid: torch.Tensor, num_groups: int, member: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For groups (of ``member`` rows, >= 2) whose longest row is unique, return which rows are
    that longest row and, per row, the second-longest length from which its baseline is zeroed."""
    fill = torch.full((num_groups,), -1, dtype=lengths.dtype, device=lengths.device)
    masked_len = torch.where(member, lengths, -1)
    longest = fill.clone().scatter_reduce_(0, gid, masked_len, "amax", include_self=True)
    at_max = member & (lengths == longest[gid])
    num_at_max = torch.bincount(gid, weights=at_max.to(torch.float64), minlength=num_groups)
    num_members = torch.bincount(gid, weights=member.to(torch.float64), minlength=num_groups)
    second = fill.clone().scatter_reduce_(0, gid, torch.where(at_max, -1, masked_len), "amax", include_self=True)
    unique_longest = at_max & (num_at_max[gid] == 1) & (num_members[gid] >= 2)
    return unique_longest, second[gid]


@register_adv_est("optimal_token_baseline", needs_sum_pi_squared=True)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline: a per-timestep group baseline ``B_t = sum(G_t W_t) / (sum(W_t) + eps)``
    with ``W_t = cumsum(1 - 2 pi + sum pi^2)`` (times ``rho^2`` with IS weights).

    One-sample groups get no baseline. With ``handle_zero_tail`` a group's unique longest row
    gets no baseline from the second-longest length on (no peers to average with there).
    Returns ``((G - B) * mask, G)`` with ``G`` the undiscounted reward-to-go.
    """
    mask, returns, w_cum = _otb_inputs(
        "optimal_token_baseline", token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
    )
    batch_size, seq_len = returns.shape
    gid, num_groups = _groups("optimal_token_baseline", index, batch_size, returns.device)
    w_masked = w_cum * mask
    numerator = returns.new_zeros(num_groups, seq_len).index_add_(0, gid, returns * w_masked)
    denominator = returns.new_zeros(num_groups, seq_len).index_add_(0, gid, w_masked) + epsilon
    count = torch.bincount(gid, minlength=num_groups)
    baselines = torch.where((count > 1)[gid].unsqueeze(-1), (numerator / denominator)[gid], 0.0)
    if handle_zero_tail:
        lengths = mask.sum(dim=-1).long()
        longest_row, cut = _zero_tail_cut(lengths, gid, num_groups, torch.ones_like(lengths, dtype=torch.bool))
        columns = torch.arange(seq_len, device=returns.device)
        baselines = baselines.masked_fill(longest_row.unsqueeze(-1) & (columns >= cut.unsqueeze(-1)), 0.0)
    return (returns - baselines) * mask, returns


@register_adv_est("tir_optimal_token_baseline", needs_sum_pi_squared=True)
@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline for multi-turn / tool-integrated rollouts.

    Like ``optimal_token_baseline`` but timesteps count *valid* tokens: each row's valid tokens
    (the response mask has holes where tool observations sit) are packed to the left, the
    baseline is computed per packed position over the group's non-empty rows, and the result is
    scattered back. Empty rows get advantage 0 and are not group members.
    """
    mask, returns, w_cum = _otb_inputs(
        "tir_optimal_token_baseline",
        token_level_rewards,
        response_mask,
        old_log_probs,
        sum_pi_squared,
        rollout_is_weights,
    )
    batch_size, seq_len = returns.shape
    gid, num_groups = _groups("tir_optimal_token_baseline", index, batch_size, returns.device)
    valid = mask.bool()
    lengths = valid.sum(dim=-1)
    # Flat position of each valid token once packed: row * T + (its rank among the row's valid tokens).
    packed_pos = valid.cumsum(dim=-1) - 1 + torch.arange(batch_size, device=returns.device).unsqueeze(-1) * seq_len
    flat = packed_pos[valid]
    packed_w = returns.new_zeros(batch_size * seq_len).index_put_((flat,), w_cum[valid]).view(batch_size, seq_len)
    packed_g = returns.new_zeros(batch_size * seq_len).index_put_((flat,), returns[valid]).view(batch_size, seq_len)
    numerator = returns.new_zeros(num_groups, seq_len).index_add_(0, gid, packed_g * packed_w)
    denominator = returns.new_zeros(num_groups, seq_len).index_add_(0, gid, packed_w) + epsilon
    member = lengths > 0
    num_members = torch.bincount(gid, weights=member.to(torch.float64), minlength=num_groups)
    baselines = torch.where((num_members > 1)[gid].unsqueeze(-1), (numerator / denominator)[gid], 0.0)
    if handle_zero_tail:
        longest_row, cut = _zero_tail_cut(lengths, gid, num_groups, member)
        columns = torch.arange(seq_len, device=returns.device)
        baselines = baselines.masked_fill(longest_row.unsqueeze(-1) & (columns >= cut.unsqueeze(-1)), 0.0)
    packed_adv = (packed_g - baselines).view(-1)
    advantages = torch.zeros_like(returns)
    advantages[valid] = packed_adv[flat]
    return advantages, returns
