"""Advantages when an agent session yields several samples: verl's multi-output rule.

verl 0.9.1's ``compute_advantage_for_multi_trajectories`` (``trainer/ppo/v1/utils.py``): every
sample is keyed ``"{uid}_{session_id}_{index}"`` -- the prompt's group, one of its ``n``
sessions, the sample's position among that session's outputs. For GRPO (and here its variants
``MULTI_TRAJECTORY_ESTIMATORS``) only each session's final output -- the largest ``index`` --
enters the group statistics, and the advantage computed for it (read at its first response
token) is broadcast to every output of the same session, times that output's own
``response_mask``; ``returns`` equal the advantages. A session that produced no output is simply
absent from the keys, so its group is computed over the sessions that did. Any other estimator
passes through unchanged (the registry entry on all samples, grouped by ``uid``).

With one output per session (``index`` 0 everywhere) the rule is exactly the estimator.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from megatron_rl.algos.algo_registry import ADV_ESTIMATORS

__all__ = [
    "MULTI_TRAJECTORY_ESTIMATORS",
    "compute_advantage_for_multi_trajectories",
    "parse_trajectory_key",
    "trajectory_keys",
]

MULTI_TRAJECTORY_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk")
"""Estimators whose group statistics use each session's final output only."""


def trajectory_keys(uids: Sequence[Any], session_ids: Sequence[Any], indices: Sequence[Any]) -> list[str]:
    """verl's sample keys ``"{uid}_{session_id}_{index}"``."""
    if not len(uids) == len(session_ids) == len(indices):
        raise ValueError(
            f"uids ({len(uids)}), session_ids ({len(session_ids)}) and indices ({len(indices)}) "
            "must have one entry per sample"
        )
    return [f"{u}_{int(s)}_{int(i)}" for u, s, i in zip(uids, session_ids, indices)]


def parse_trajectory_key(key: str) -> tuple[str, str, int]:
    """``(uid, session_id, index)`` of a key (the uid may itself contain underscores)."""
    fields = str(key).rsplit("_", 2)
    if len(fields) != 3 or not fields[2].lstrip("-").isdigit():
        raise ValueError(f"batch key {key!r} is not of the form '{{uid}}_{{session_id}}_{{index}}'")
    return fields[0], fields[1], int(fields[2])


@torch.no_grad()
def compute_advantage_for_multi_trajectories(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    batch_keys: Sequence[str],
    adv_estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **estimator_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[bs, T]`` by the multi-output rule (module docstring).

    ``estimator_kwargs`` (``values``, ``reward_baselines`` ...) reach the registry entry of
    ``adv_estimator`` (an unknown name lists the registered ones).
    """
    fn = ADV_ESTIMATORS[adv_estimator]
    if len(batch_keys) != token_level_rewards.shape[0]:
        raise ValueError(f"{len(batch_keys)} batch keys for {token_level_rewards.shape[0]} samples")
    parsed = [parse_trajectory_key(k) for k in batch_keys]
    common = dict(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
    if adv_estimator not in MULTI_TRAJECTORY_ESTIMATORS:
        index = np.array([uid for uid, _, _ in parsed], dtype=object)
        return fn(
            token_level_rewards=token_level_rewards,
            response_mask=response_mask,
            index=index,
            **common,
            **estimator_kwargs,
        )
    final: dict[tuple[str, str], tuple[int, int]] = {}  # (uid, session) -> (largest index, its row)
    for row, (uid, session, index) in enumerate(parsed):
        if (uid, session) not in final or final[(uid, session)][0] < index:
            final[(uid, session)] = (index, row)
    sessions = {s: i for i, s in enumerate(final)}  # first-seen order
    rows = torch.tensor([final[s][1] for s in sessions], device=token_level_rewards.device)
    local = torch.tensor([sessions[(uid, session)] for uid, session, _ in parsed], device=token_level_rewards.device)
    final_mask = response_mask[rows]
    size = token_level_rewards.shape[0]
    extra = {
        k: v[rows] if torch.is_tensor(v) and v.dim() and v.shape[0] == size else v for k, v in estimator_kwargs.items()
    }  # per-sample inputs follow the final outputs
    advantages, _ = fn(
        token_level_rewards=token_level_rewards[rows],
        response_mask=final_mask,
        index=np.array([uid for uid, _ in sessions], dtype=object),
        **common,
        **extra,
    )
    first = final_mask.argmax(dim=1)  # verl reads the final output's advantage at its first response token
    per_session = advantages[torch.arange(len(sessions), device=advantages.device), first]  # [sessions]
    scores = per_session[local].unsqueeze(-1) * response_mask  # [bs, T]
    return scores, scores
