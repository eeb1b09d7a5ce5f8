"""Advantage estimators with verl 0.9.1's names, keyword arguments and numerics.

Every estimator is ``fn(token_level_rewards, response_mask, ..., **kwargs) -> (advantages,
returns)``, both ``[bs, response_length]``, and is registered in ``ADV_ESTIMATORS`` under
verl's ``algorithm.adv_estimator`` name. Extra keyword arguments are accepted and ignored, so a
trainer can pass one uniform set (``index``, ``values``, ``gamma``, ``lam``, ``config`` ...).

Everything is vectorised over the batch: group statistics are ``bincount``/``index_add`` over
dense group ids (``utils.group_ids``), never a Python loop per sample or per group. Only the
discounted recursions (GAE, REINFORCE++) loop, over time steps, vectorised over the batch.

Settings resolve in one order everywhere: an explicit keyword argument, then ``config``
(a verl ``DictConfig`` or ``AlgoConfig``), then verl's default. verl itself is inconsistent here
(``grpo_passk`` ignores the keyword and reads ``config``; ``grpo_vectorized`` and ``gdpo``, called
through its generic path, never see ``config.norm_adv_by_std_in_grpo``); with a trainer that
passes the same value both ways, as verl's does, results are the same.

verl behaviours kept on purpose: a one-sample group gets mean 0 / std 1 in ``grpo`` (advantage
``s / (1 + eps)``); ``rloo`` keeps such a sample's raw score while ``rloo_vectorized`` gives it 0;
``grpo_passk`` rejects it (``ValueError`` naming the group); whitening estimators raise when the
batch has fewer than two valid tokens. Rows without valid tokens get zero advantage everywhere.

The optimal-token-baseline estimators (they read ``sum_pi_squared``) are in
``megatron_rl.algos.advantage_otb``.

Deliberate differences from verl (each only where verl returns garbage):
- A group of identical scores gets exactly zero advantage. verl's ``torch.mean`` of e.g.
  sixteen 0.1s is off by one ulp, and dividing that by ``std + 1e-6`` gives ~-0.007 (grpo) or
  ~-0.015 (grpo_vectorized). Group means here are shifted by the group minimum, which is exact.
- GAE advantages are zero on masked positions (verl leaves ``-mean/std`` of the whitening there).
- OPO: a group whose responses are all empty gets baseline 0 instead of verl's 0/0 = NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megatron_rl.algos.algo_registry import register_adv_est
from megatron_rl.algos.utils import cfg_get, check_finite, check_same_shape, group_ids, masked_whiten

__all__ = [
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
]


# ----------------------------------------------------------------------------- input checks


def _check_inputs(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    cast_mask: bool = True,
    **others: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes and reward finiteness.

    Returns ``(mask, scores)``: the mask in the reward dtype (as given when ``cast_mask=False``)
    and the per-sample score ``token_level_rewards.sum(-1)`` (verl's outcome score, over all
    positions), which the finiteness check needs anyway.
    """
    for name, t in (("token_level_rewards", token_level_rewards), ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{estimator}: {name} must be a 2-D tensor [batch, response_length], got {shape}")
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask, **others)
    scores = token_level_rewards.sum(dim=-1)
    _check_finite_rows("token_level_rewards", token_level_rewards, scores)
    return (response_mask.to(token_level_rewards.dtype) if cast_mask else response_mask), scores


def _check_finite_rows(name: str, tensor: torch.Tensor, row_sums: torch.Tensor) -> None:
    """Cheap finiteness check through row sums (NaN/inf anywhere makes the row sum non-finite);
    the element-wise scan only runs to name the bad samples once something is wrong."""
    if bool(torch.isfinite(row_sums).all()):
        return
    check_finite(name, tensor)
    bad = (~torch.isfinite(row_sums)).nonzero().flatten().tolist()
    raise ValueError(f"{name} rows sum to inf (float overflow) in samples {bad[:20]}; rescale them")


def _groups(estimator: str, index: Any, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Dense group ids ``[bs]`` from ``index`` (one prompt uid per sample) and the group count."""
    if index is None:
        raise ValueError(
            f"{estimator}: index is required (the prompt uid of each sample, e.g. non_tensor_batch['uid']); got None"
        )
    gid, num_groups = group_ids(index, device=device)
    if gid.numel() != batch_size:
        raise ValueError(
            f"{estimator}: index has {gid.numel()} labels but token_level_rewards has {batch_size} "
            f"samples; pass one uid per sample"
        )
    return gid, num_groups


def _label(index: Any, position: int) -> Any:
    """The original group label of sample ``position`` (for error messages)."""
    label = index[position]
    return label.item() if hasattr(label, "item") else label


def _group_mean_std(
    scores: torch.Tensor, gid: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group mean, unbiased std (``torch.std``) and count of ``scores: [bs]`` -> ``[G]`` each.

    Means are taken relative to the group minimum, so a group of equal scores has mean equal
    to that score and std exactly 0 (a plain sum/count is off by an ulp for e.g. 0.1).
    """
    dtype = scores.dtype
    count = torch.bincount(gid, minlength=num_groups).to(dtype)
    ref = scores.new_zeros(num_groups).scatter_reduce_(0, gid, scores, "amin", include_self=False)
    shifted_sum = scores.new_zeros(num_groups).index_add_(0, gid, scores - ref[gid])
    mean = ref + shifted_sum / count.clamp_min(1)
    centered = scores - mean[gid]
    sq_sum = scores.new_zeros(num_groups).index_add_(0, gid, centered * centered)
    std = (sq_sum / (count - 1).clamp_min(1)).sqrt()
    return mean, std, count


def _norm_by_std(norm_adv_by_std_in_grpo: bool | None, config: Any) -> bool:
    if norm_adv_by_std_in_grpo is not None:
        return bool(norm_adv_by_std_in_grpo)
    return bool(cfg_get(config, "norm_adv_by_std_in_grpo", True))


def _setting(value: Any, config: Any, key: str, default: float) -> float:
    """Explicit keyword, else ``config.<key>``, else verl's default."""
    if value is None:
        value = cfg_get(config, key, default)
    return float(value)


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Undiscounted reward-to-go along the last dim."""
    return x.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


# ----------------------------------------------------------------------------- token-level


@register_adv_est("gae", needs_values=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    gamma: float | None = None,
    lam: float | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016), whitened over the batch.

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, where
    masked positions (padding, tool observations) are skipped: they neither take a TD step nor
    break the chain. ``returns = A + values`` (before whitening, as the critic target);
    advantages are whitened over ``response_mask`` and zero outside it.
    """
    if values is None:
        raise ValueError("gae: values (critic values [batch, response_length]) are required")
    mask, _ = _check_inputs("gae", token_level_rewards, response_mask, values=values)
    _check_finite_rows("values", values, values.sum(dim=-1))
    gamma = _setting(gamma, config, "gamma", 1.0)
    lam = _setting(lam, config, "lam", 1.0)
    # Time-major copies make each step's slice contiguous over the batch. The loop uses verl's
    # blend ``x * m + y * (1 - m)`` (exact for a 0/1 mask, much faster than torch.where on CPU)
    # in preallocated buffers: per-step temporaries would make glibc trim and re-fault the heap.
    rewards_t, values_t, mask_t = (x.t().contiguous() for x in (token_level_rewards, values, mask))
    gae_t = torch.empty_like(rewards_t)  # [T, bs]
    next_values = torch.zeros_like(rewards_t[0])  # V of the next valid token (0 past the end)
    last_gae = torch.zeros_like(rewards_t[0])
    keep, delta, step_gae, tmp = (torch.empty_like(last_gae) for _ in range(4))
    for t in reversed(range(rewards_t.shape[0])):
        m, v = mask_t[t], values_t[t]
        keep.copy_(m).neg_().add_(1)  # 1 - m
        delta.copy_(next_values).mul_(gamma).add_(rewards_t[t]).sub_(v)  # r + gamma * V_next - V
        step_gae.copy_(last_gae).mul_(gamma * lam).add_(delta)  # delta + gamma * lam * A_next
        next_values.mul_(keep).add_(tmp.copy_(v).mul_(m))
        last_gae = gae_t[t].copy_(last_gae).mul_(keep).add_(step_gae.mul_(m))
    returns = (gae_t + values_t).t().contiguous()
    advantages = (masked_whiten(gae_t, mask_t) * mask_t).t().contiguous()
    return advantages, returns


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ reward-to-go: ``G_t = r_t + gamma * G_next`` on valid tokens, 0 elsewhere;
    masked spans are skipped (their rewards dropped, the running return carried through)."""
    rewards_t, mask_t = rewards.t().contiguous(), mask.t().contiguous()
    returns_t = torch.empty_like(rewards_t)  # [T, bs]
    running, keep = torch.zeros_like(rewards_t[0]), torch.empty_like(rewards_t[0])
    for t in reversed(range(rewards_t.shape[0])):
        m = mask_t[t]
        keep.copy_(m).neg_().add_(1)  # 1 - m
        candidate = returns_t[t].copy_(running).mul_(gamma).add_(rewards_t[t]).mul_(m)
        running.mul_(keep).add_(candidate)  # verl's blend: the candidate if valid, else carried
    return returns_t.t().contiguous()


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted reward-to-go, whitened over the batch.

    ``gamma`` is verl's ``config.gamma`` (an explicit ``gamma=`` wins; default 1.0).
    Returns ``(whiten(G) * mask, G)``.
    """
    mask, _ = _check_inputs("reinforce_plus_plus", token_level_rewards, response_mask)
    returns = _discounted_returns(token_level_rewards, mask, _setting(gamma, config, "gamma", 1.0))
    return masked_whiten(returns, mask) * mask, returns


@register_adv_est("remax", needs_baseline=True)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv:2310.10505): reward-to-go minus the greedy rollout's reward ``b: [bs]``.

    ``returns = revcumsum(r * mask)``, ``advantages = returns - b * mask``.
    """
    mask, _ = _check_inputs("remax", token_level_rewards, response_mask)
    batch_size = token_level_rewards.shape[0]
    if reward_baselines is None:
        raise ValueError("remax: reward_baselines (the greedy response's reward, shape [batch]) are required")
    if reward_baselines.numel() != batch_size or reward_baselines.dim() > 2:
        raise ValueError(f"remax: reward_baselines must have shape [{batch_size}], got {list(reward_baselines.shape)}")
    baselines = reward_baselines.reshape(batch_size).to(token_level_rewards.dtype)
    check_finite("reward_baselines", baselines)
    returns = _reverse_cumsum(token_level_rewards * mask)
    return returns - baselines.unsqueeze(-1) * mask, returns


# ----------------------------------------------------------------------------- group outcome


def _contiguous_group_size(gid: torch.Tensor, num_groups: int) -> int:
    """``k`` when ``gid: [bs]`` is ``num_groups`` consecutive blocks of ``k`` samples numbered
    0, 1, ... (verl's ``repeat(interleave=True)`` layout, as ``group_ids`` numbers it), else 0."""
    if num_groups == 0 or gid.numel() % num_groups:
        return 0
    k = gid.numel() // num_groups
    blocks = torch.arange(num_groups, device=gid.device).unsqueeze(-1)  # [G, 1]
    return k if bool((gid.view(num_groups, k) == blocks).all()) else 0


def _grpo_scalars(scores: torch.Tensor, gid: torch.Tensor, num_groups: int, epsilon: float, norm: bool) -> torch.Tensor:
    """Per-sample GRPO advantage ``(s - mean_g) / (std_g + eps)`` (or ``s - mean_g``);
    a one-sample group uses mean 0 / std 1 like verl."""
    k = _contiguous_group_size(gid, num_groups)
    if k >= 2:
        # Same statistics as _group_mean_std, as row reductions over a [G, k] view: ~10x cheaper
        # than the scatter/index_add/gather path, which any other layout takes.
        grouped = scores.reshape(num_groups, k)  # [G, k]
        ref = grouped.amin(dim=1, keepdim=True)
        centered = grouped - (ref + (grouped - ref).sum(dim=1, keepdim=True) / k)  # [G, k]
        if not norm:
            return centered.reshape(-1)
        std = ((centered * centered).sum(dim=1, keepdim=True) / (k - 1)).sqrt()  # [G, 1]
        return (centered / (std + epsilon)).reshape(-1)
    mean, std, count = _group_mean_std(scores, gid, num_groups)
    single = count <= 1
    mean = mean.masked_fill(single, 0.0)
    if not norm:
        return scores - mean[gid]
    std = std.masked_fill(single, 1.0)
    return (scores - mean[gid]) / (std[gid] + epsilon)


@register_adv_est("grpo")
@register_adv_est("grpo_vectorized")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: each response's score ``s = sum(r)`` normalised within its group.

    ``A = (s - mean_g) / (std_g + epsilon)`` with ``torch.std`` (unbiased); with
    ``norm_adv_by_std_in_grpo=False`` it is Dr.GRPO's ``s - mean_g``. A group of one sample
    uses mean 0, std 1 (verl). Broadcast over the response: ``A * mask`` (advantages = returns),
    in the dtype verl's ``scores.unsqueeze(-1) * response_mask`` promotes to.

    Cost at 65,536 x 1,024: one read of the rewards (the score sum, which also checks
    finiteness), per-group statistics on ``[bs]``, and one fused pass that reads the mask and
    writes the output; everything else is ``O(bs)``.
    """
    _, scores = _check_inputs("grpo", token_level_rewards, response_mask, cast_mask=False)
    gid, num_groups = _groups("grpo", index, scores.shape[0], scores.device)
    scalars = _grpo_scalars(scores, gid, num_groups, epsilon, _norm_by_std(norm_adv_by_std_in_grpo, config))
    # Type promotion turns a bool/int mask into the score dtype inside the multiply itself:
    # no converted [bs, T] copy of the mask before it.
    advantages = scalars.unsqueeze(-1) * response_mask  # [bs, T]
    return advantages, advantages


compute_grpo_vectorized_outcome_advantage = compute_grpo_outcome_advantage
"""verl's ``grpo_vectorized`` computes the same as ``grpo``; here they are one function."""


@register_adv_est("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (arXiv:2503.19595): only each group's best response gets ``r_max - r_second``
    (divided by ``std_g + epsilon`` when normalising); every group needs >= 2 samples."""
    mask, scores = _check_inputs("grpo_passk", token_level_rewards, response_mask)
    gid, num_groups = _groups("grpo_passk", index, scores.shape[0], scores.device)
    _, std, count = _group_mean_std(scores, gid, num_groups)
    if bool((count < 2).any()):
        g = int((count < 2).nonzero()[0])
        label = _label(index, int((gid == g).nonzero()[0]))
        raise ValueError(f"grpo_passk: Pass@k requires at least 2 samples per group. Got 1 for group {label!r}.")
    # Sort by score (descending), then stably by group: each group's block starts with its top two.
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(gid[order], stable=True)]
    starts = torch.cumsum(count.long(), 0) - count.long()
    best, second = order[starts], order[starts + 1]
    gap = scores[best] - scores[second]  # [G]; 0 on ties, so which tied sample is "best" is moot
    if _norm_by_std(norm_adv_by_std_in_grpo, config):
        gap = gap / (std + epsilon)
    advantages = torch.zeros_like(scores).index_put_((best,), gap)
    advantages = advantages.unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, config: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean score (0 for a one-sample group), broadcast
    over the response, then whiten over the whole batch's valid tokens."""
    mask, scores = _check_inputs("reinforce_plus_plus_baseline", token_level_rewards, response_mask)
    gid, num_groups = _groups("reinforce_plus_plus_baseline", index, scores.shape[0], scores.device)
    mean, _, count = _group_mean_std(scores, gid, num_groups)
    centered = scores - mean.masked_fill(count <= 1, 0.0)[gid]
    advantages = masked_whiten(centered.unsqueeze(-1) * mask, mask) * mask
    return advantages, advantages


def _rloo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, name: str, keep_single_score: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    mask, scores = _check_inputs(name, token_level_rewards, response_mask)
    gid, num_groups = _groups(name, index, scores.shape[0], scores.device)
    mean, _, count = _group_mean_std(scores, gid, num_groups)
    n = count[gid]
    # s - mean(others) = (s - mean) * n / (n - 1)
    loo = (scores - mean[gid]) * (n / (n - 1).clamp_min(1))
    single = n <= 1
    scalars = torch.where(single, scores if keep_single_score else torch.zeros_like(scores), loo)
    advantages = scalars.unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_est("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, config: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): ``s_i - mean_{j != i} s_j``. A one-sample group keeps its raw
    score as the advantage, as verl's ``rloo`` does (``rloo_vectorized`` gives it 0)."""
    return _rloo(token_level_rewards, response_mask, index, "rloo", keep_single_score=True)


@register_adv_est("rloo_vectorized")
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, config: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO as verl's ``rloo_vectorized``: same as ``rloo`` except a one-sample group gets 0."""
    return _rloo(token_level_rewards, response_mask, index, "rloo_vectorized", keep_single_score=False)


@register_adv_est("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, config: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): subtract the length-weighted group mean ``sum(l*s) / sum(l)``
    (0 for a one-sample group, and for a group of empty responses where verl gives NaN)."""
    mask, scores = _check_inputs("opo", token_level_rewards, response_mask)
    lengths = mask.sum(dim=-1)
    gid, num_groups = _groups("opo", index, scores.shape[0], scores.device)
    count = torch.bincount(gid, minlength=num_groups)
    # Relative to the group minimum, so a group of equal scores gets exactly zero advantage.
    ref = scores.new_zeros(num_groups).scatter_reduce_(0, gid, scores, "amin", include_self=False)
    weighted = scores.new_zeros(num_groups).index_add_(0, gid, lengths * (scores - ref[gid]))
    total_len = scores.new_zeros(num_groups).index_add_(0, gid, lengths)
    baseline = torch.where((count > 1) & (total_len > 0), ref + weighted / total_len.clamp_min(1), 0.0)
    advantages = (scores - baseline[gid]).unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_est("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv:2504.02546): ``alpha * (s - mean_g) / f_norm`` with
    ``alpha = bs / max(#nonzero scores, 1)`` (mean 0 for a one-sample group; no std)."""
    mask, scores = _check_inputs("gpg", token_level_rewards, response_mask)
    gid, num_groups = _groups("gpg", index, scores.shape[0], scores.device)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    mean, _, count = _group_mean_std(scores, gid, num_groups)
    scalars = alpha * (scores - mean.masked_fill(count <= 1, 0.0)[gid]) / f_norm
    advantages = scalars.unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_est("gdpo", needs_reward_fields=True)
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    non_tensor_batch: dict | None = None,
    batch: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv:2601.05242): GRPO-normalise each reward component separately, sum them with
    ``algorithm.gdpo_reward_weights``, then whiten over the batch.

    Components are ``non_tensor_batch[key]`` (one score per sample) for each key in
    ``algorithm.gdpo_reward_keys``; without ``non_tensor_batch`` the single component is
    ``token_level_rewards``. verl places each component on the last valid token and sums the
    row again, which is the score itself, so ``batch`` is not needed and is ignored.
    """
    mask, scores = _check_inputs("gdpo", token_level_rewards, response_mask)
    batch_size = token_level_rewards.shape[0]
    gid, num_groups = _groups("gdpo", index, batch_size, token_level_rewards.device)
    components = [scores]
    weights: list[float] = [1.0]
    if non_tensor_batch is not None and config is not None:
        keys = cfg_get(config, "gdpo_reward_keys")
        if not keys:
            raise ValueError(
                "gdpo: algorithm.gdpo_reward_keys must list the reward components returned by the "
                "reward function (e.g. ['format_reward', 'accuracy_reward']); got none"
            )
        components = []
        for key in keys:
            if key not in non_tensor_batch:
                raise ValueError(
                    f"gdpo: reward key {key!r} not found in non_tensor_batch; available keys: "
                    f"{sorted(non_tensor_batch)}"
                )
            # np.asarray first: reward functions hand back lists or object arrays of Python floats
            comp = torch.from_numpy(np.asarray(non_tensor_batch[key], dtype=np.float32))
            comp = comp.to(token_level_rewards.device)
            if comp.shape != (batch_size,):
                raise ValueError(
                    f"gdpo: non_tensor_batch[{key!r}] must have shape [{batch_size}], got {list(comp.shape)}"
                )
            check_finite(f"non_tensor_batch[{key!r}]", comp)
            components.append(comp.to(token_level_rewards.dtype))
        weights = list(cfg_get(config, "gdpo_reward_weights", [1.0] * len(keys)))
        if len(weights) != len(keys):
            raise ValueError(
                f"gdpo: algorithm.gdpo_reward_weights has {len(weights)} entries but gdpo_reward_keys has "
                f"{len(keys)}; they must match"
            )
    norm = _norm_by_std(norm_adv_by_std_in_grpo, config)
    weight = torch.tensor(weights, dtype=torch.float32, device=token_level_rewards.device)
    combined = None
    for k, scores in enumerate(components):  # a loop over reward components, not samples
        part = weight[k] * (_grpo_scalars(scores, gid, num_groups, epsilon, norm).unsqueeze(-1) * mask)
        combined = part if combined is None else combined + part
    advantages = masked_whiten(combined, mask) * mask
    return advantages, advantages
