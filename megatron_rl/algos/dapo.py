"""DAPO's reward-side pieces: overlong reward shaping and dynamic-sampling group filtering.

DAPO (Yu et al. 2025) = four changes to GRPO. Two live here:

- **Overlong reward shaping** (verl's ``dapo`` reward manager): a response longer than
  ``max_resp_len - buffer_len`` loses ``(length - (max_resp_len - buffer_len)) / buffer_len *
  penalty_factor``, i.e. 0 up to the start of the buffer, then linearly down to
  ``-penalty_factor`` at ``max_resp_len``. The reward manager applies it, so it lives in
  ``megatron_rl.data.shaping`` (below this layer) and is re-exported here.
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

from megatron_rl.algos.utils import group_ids
from megatron_rl.data.shaping import apply_overlong_penalty, overlong_penalty

__all__ = [
    "overlong_penalty",
    "apply_overlong_penalty",
    "compute_filter_metric",
    "filter_groups",
]


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
    values = torch.as_tensor(
        np.asarray(metric_values) if not isinstance(metric_values, torch.Tensor) else metric_values
    )
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
