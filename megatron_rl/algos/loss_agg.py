"""Loss aggregation: turn a ``[bs, response_len]`` loss matrix into a scalar.

With ``batch_num_tokens`` / ``global_batch_size`` taken from the *global* batch (all
micro-batches on all data-parallel ranks) the per-micro-batch losses sum (and average over
DP ranks) to exactly the loss of the whole batch at once, so gradient accumulation and data
parallelism do not change the result. ``global_batch_info`` computes those numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_rl.algos.utils import masked_sum

__all__ = ["agg_loss", "global_batch_info", "LOSS_AGG_MODES"]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int | torch.Tensor] = None,
    global_batch_size: Optional[int | torch.Tensor] = None,
    loss_scale_factor: Optional[int] = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``[bs, T]`` under ``loss_mask`` ``[bs, T]`` (verl's ``agg_loss``).

    - ``token-mean``: sum over valid tokens / ``batch_num_tokens``.
    - ``token-sum``: sum over valid tokens.
    - ``seq-mean-token-sum``: per-sequence token sums, averaged over sequences.
    - ``seq-mean-token-mean``: per-sequence token means, averaged over sequences.
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / ``loss_scale_factor`` (default ``T``);
      Dr.GRPO's constant normaliser.

    Sequences with no valid token contribute zero, never NaN. Each result is multiplied by
    ``dp_size`` because data-parallel gradient reduction averages over ranks.
    """
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"shape mismatch: loss_mat{list(loss_mat.shape)}, loss_mask{list(loss_mask.shape)}")
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("agg_loss: batch_num_tokens (of the global batch) is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        # An all-masked batch gives 0 (0 / max(0, 1)), never NaN.
        return masked_sum(loss_mat, loss_mask) / _at_least_one(batch_num_tokens) * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        token_count = loss_mask.sum(dim=-1)
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (token_count + 1e-8)
        seq_mask = (token_count > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("agg_loss: global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / _at_least_one(global_batch_size) * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not allowed; choose one of {list(LOSS_AGG_MODES)}")


def _at_least_one(count: int | float | torch.Tensor) -> float | torch.Tensor:
    """A count as a divisor, clamped to >= 1; kept exact (never rounded to a low-precision dtype)."""
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return max(float(count), 1.0)


def global_batch_info(
    response_masks: Sequence[torch.Tensor] | torch.Tensor,
    dp_size: int = 1,
    loss_scale_factor: Optional[int] = None,
) -> dict:
    """The ``global_batch_info`` dict for ``agg_loss`` from the masks of the *whole* global batch.

    ``response_masks`` is the global batch's mask (or a list of its pieces, e.g. the masks of
    every micro-batch on every DP rank, already gathered). The returned dict is what the engine
    puts in ``ActorConfig.global_batch_info`` for the step.
    """
    masks = [response_masks] if isinstance(response_masks, torch.Tensor) else list(response_masks)
    num_tokens = sum(int(m.sum().item()) for m in masks)
    num_seqs = sum(int((m.sum(dim=-1) > 0).sum().item()) for m in masks)
    info = {"dp_size": dp_size, "batch_num_tokens": num_tokens, "global_batch_size": num_seqs}
    if loss_scale_factor is not None:
        info["loss_scale_factor"] = loss_scale_factor
    return info
