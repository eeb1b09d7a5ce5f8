"""DAPO's overlong reward shaping (verl's ``dapo`` reward manager), applied by ``RewardFunction``.

A response longer than ``max_resp_len - buffer_len`` loses ``(length - (max_resp_len -
buffer_len)) / buffer_len * penalty_factor``: 0 up to the start of the buffer, then linearly
down to ``-penalty_factor`` at ``max_resp_len``. Re-exported by ``megatron_rl.algos.dapo``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_rl.utils.config_access import cfg_get

__all__ = ["overlong_penalty", "apply_overlong_penalty"]


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
