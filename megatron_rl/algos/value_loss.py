"""Critic and entropy losses (verl 0.9.1's ``compute_value_loss`` / ``compute_entropy_loss``).

Both reduce through :func:`megatron_rl.algos.loss_agg.agg_loss`; pass the step's global batch
numbers (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) so
micro-batch and data-parallel losses add up to the whole-batch loss.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algos.loss_agg import LOSS_AGG_MODES, agg_loss
from megatron_rl.algos.utils import check_same_shape, entropy_from_logits, masked_mean

__all__ = ["compute_value_loss", "compute_entropy_loss"]


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not allowed; choose one of {list(LOSS_AGG_MODES)}")


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped PPO value loss: ``0.5 * agg(max((v - R)^2, (clip(v, V-c, V+c) - R)^2))``.

    ``vpreds`` are the critic's current predictions, ``values`` the predictions at rollout
    time, ``returns`` the targets; all ``[bs, T]``. ``cliprange_value`` (``c``) bounds how far a
    prediction may move from ``values`` before the clipped (pessimistic) term takes over.
    Returns ``(vf_loss, vf_clipfrac)``; ``vf_clipfrac`` (a 0-d tensor) is the fraction of
    valid tokens where the clipped term is the larger one.
    """
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    _check_mode(loss_agg_mode)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value={cliprange_value!r} must be >= 0")
    vpred_clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    losses_unclipped = (vpreds - returns) ** 2
    losses_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.max(losses_unclipped, losses_clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
) -> torch.Tensor:
    """Aggregated entropy of ``softmax(logits)``; ``logits: [bs, T, vocab]`` (the full vocabulary).

    The actor *subtracts* ``entropy_coeff`` times this value (an entropy bonus). The global
    batch arguments default to local normalisation, which is verl's behaviour.
    """
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(response_mask.shape):
        raise ValueError(
            f"shape mismatch: logits{list(logits.shape)} must be response_mask{list(response_mask.shape)} + [vocab]"
        )
    _check_mode(loss_agg_mode)
    token_entropy = entropy_from_logits(logits)  # [bs, T]
    return agg_loss(
        token_entropy,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
