"""DAPO's reward-side pieces: overlong reward shaping and dynamic-sampling group filtering.

DAPO (Yu et al. 2025) = four changes to GRPO. Two live here:

- **Overlong reward shaping** (verl's ``dapo`` reward manager): a response longer than
  ``max_resp_len - buffer_len`` loses ``(length - (max_resp_len - buffer_len)) / buffer_len *
  penalty_factor``, i.e. 0 up to the start of the buffer, then linearly down to
  ``-penalty_factor`` at ``max_resp_len``.
- **Dynamic sampling** (``algorithm.filter_groups``): groups (the ``n`` responses to one prompt)
  whose ``metric`` is the same for every response carry no GRPO signal (all advantages are 0) and
  are dropped; the trainer keeps generating until it has enough informative groups.

The other two need no code of their own: *clip-higher* is the vanilla PPO loss with an
asymmetric clip (``actor.clip_ratio_low=0.2``, ``actor.clip_ratio_high=0.28``), and the
*token-level loss* is ``actor.loss_agg_mode="token-mean"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import torch

from megatron_rl.algos.utils import cfg_get, group_ids

__all__ = [
    "overlong_penalty",
    "apply_overlong_penalty",
    "compute_filter_metric",
    "filter_groups",
]


def _check_overlong_args(max_resp_len: int, buffer_len: int) -> None:
    if buffer_len is None or buffer_len <= 0:
        raise ValueError(
            f"overlong_buffer.len={buffer_len!r} must be > 0 when the overlong penalty is enabled "
            "(set overlong_buffer.enable=False to disable it)"
        )
    if max_resp_len is None:
        raise ValueError("max_resp_len must be set when the overlong penalty is enabled; it is None")
    if max_resp_len < buffer_len:
        raise ValueError(f"max_resp_len={max_resp_len!r} must be >= overlong_buffer.len={buffer_len!r}")


def overlong_penalty(
    response_lengths: torch.Tensor, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment per response (verl's ``DAPORewardManager``), vectorised.

    ``min(-(length - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0)``: 0 for
    ``length <= max_resp_len - buffer_len``, ``-penalty_factor`` at ``length == max_resp_len``
    (and, as in verl, not clamped beyond: a longer length keeps decreasing linearly).

    Args:
        response_lengths: ``[bs]`` number of valid response tokens (int or float tensor).
        max_resp_len: the response-length limit the buffer is measured from.
        buffer_len: ``overlong_buffer.len``; > 0 and <= ``max_resp_len``.
        penalty_factor: ``overlong_buffer.penalty_factor``.

    Returns:
        ``[bs]`` float32 penalties (<= 0).
    """
    _check_overlong_args(max_resp_len, buffer_len)
    lengths = torch.as_tensor(response_lengths)
    if not lengths.is_floating_point():
        lengths = lengths.long()
    exceed_len = lengths - (max_resp_len - buffer_len)
    # Same operation order and dtype (int division -> float32) as verl's per-sample expression.
    penalty = -exceed_len / buffer_len * penalty_factor
    return torch.clamp(penalty.float(), max=0.0)


def apply_overlong_penalty(
    scores: torch.Tensor,
    response_lengths: torch.Tensor,
    max_resp_len: Optional[int],
    overlong_buffer_cfg: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the overlong penalty to per-response ``scores`` ``[bs]`` as verl's DAPO reward manager does.

    ``overlong_buffer_cfg`` holds verl's keys ``enable``, ``len``, ``penalty_factor``, ``log``
    (a DictConfig, dict or None). Disabled/None returns ``scores`` unchanged. With ``log`` the
    extra info holds ``overlong_reward`` ``[bs]`` and ``overlong`` ``[bs]`` bool, verl's
    ``reward_extra_info`` keys. The caller places the reward on the last valid token.
    """
    if overlong_buffer_cfg is None or not cfg_get(overlong_buffer_cfg, "enable", False):
        return scores, {}
    penalty = overlong_penalty(
        response_lengths,
        max_resp_len=max_resp_len,
        buffer_len=cfg_get(overlong_buffer_cfg, "len"),
        penalty_factor=cfg_get(overlong_buffer_cfg, "penalty_factor", 1.0),
    ).to(device=scores.device)
    extra: dict[str, torch.Tensor] = {}
    if cfg_get(overlong_buffer_cfg, "log", False):
        extra = {"overlong_reward": penalty, "overlong": penalty < 0}
    return scores + penalty, extra


def compute_filter_metric(
    metric: str,
    token_level_scores: Optional[torch.Tensor] = None,
    token_level_rewards: Optional[torch.Tensor] = None,
    reward_extra_info: Optional[Mapping[str, Any]] = None,
) -> torch.Tensor:
    """Per-sample values of ``algorithm.filter_groups.metric``, as a ``[bs]`` float64 tensor.

    ``seq_final_reward`` = ``token_level_rewards.sum(-1)`` (after KL-in-reward),
    ``seq_reward`` = ``token_level_scores.sum(-1)``, ``reward`` (verl's v1 trainer canonical
    reward) = ``token_level_scores.sum(-1)``; any other name (``acc``, ``score`` ...) is read
    from ``reward_extra_info``.
    """
    if metric == "seq_final_reward":
        source = token_level_rewards
    elif metric in ("seq_reward", "reward"):
        source = token_level_scores
    else:
        if reward_extra_info is None or metric not in reward_extra_info:
            available = ["seq_final_reward", "seq_reward", "reward"] + sorted(reward_extra_info or {})
            raise ValueError(f"filter_groups.metric={metric!r} is not available; choose one of {available}")
        values = reward_extra_info[metric]
        if isinstance(values, torch.Tensor):
            return values.detach().to(torch.float64).reshape(-1)
        return torch.as_tensor(np.asarray(values, dtype=np.float64)).reshape(-1)
    if source is None:
        needed = "token_level_rewards" if metric == "seq_final_reward" else "token_level_scores"
        raise ValueError(f"filter_groups.metric={metric!r} needs {needed}; it is None")
    return source.detach().sum(dim=-1).to(torch.float64)


def filter_groups(
    metric_values: torch.Tensor | np.ndarray | list,
    index: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """DAPO dynamic sampling: keep the groups whose metric varies across their samples.

    A group with more than one sample and the same metric value in all of them (std == 0) is
    dropped; single-sample groups are kept (verl keeps ``std > 0 or len == 1``).

    Args:
        metric_values: ``[bs]`` per-sample metric (see ``compute_filter_metric``).
        index: ``[bs]`` group label per sample (verl's ``uid`` strings, ints or a tensor).

    Returns:
        ``(keep_mask [bs] bool, kept_indices [num_kept] long, metrics)``; kept indices are in batch
        order. Metrics: ``filter_groups/num_groups``, ``num_kept_groups``, ``num_filtered_groups``,
        ``num_kept_samples``, ``kept_group_ratio``.
    """
    values = torch.as_tensor(np.asarray(metric_values) if not isinstance(metric_values, torch.Tensor) else metric_values)
    values = values.detach().reshape(-1).to(torch.float64)
    ids, num_groups = group_ids(index, device=values.device)
    if ids.numel() != values.numel():
        raise ValueError(
            f"filter_groups: metric_values has {values.numel()} entries but index has {ids.numel()}; they must match"
        )
    # Exact equality of all values in a group (max == min) stands for verl's np.std(...) == 0.
    group_max = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    group_min = torch.full((num_groups,), torch.inf, dtype=values.dtype, device=values.device)
    group_max = group_max.scatter_reduce(0, ids, values, reduce="amax")
    group_min = group_min.scatter_reduce(0, ids, values, reduce="amin")
    group_size = torch.bincount(ids, minlength=num_groups)
    group_keep = (group_max != group_min) | (group_size == 1)
    keep_mask = group_keep[ids]
    kept_indices = keep_mask.nonzero().flatten()
    num_kept = int(group_keep.sum())
    metrics = {
        "filter_groups/num_groups": float(num_groups),
        "filter_groups/num_kept_groups": float(num_kept),
        "filter_groups/num_filtered_groups": float(num_groups - num_kept),
        "filter_groups/num_kept_samples": float(kept_indices.numel()),
        "filter_groups/kept_group_ratio": num_kept / num_groups if num_groups else 0.0,
    }
    return keep_mask, kept_indices, metrics
