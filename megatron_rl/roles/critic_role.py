"""The ``critic`` role: a trainable scalar head read at the positions that predict the responses.

It runs a ``scalar``-head engine (one value per token, ``ModelOutput.values``) and trains it with
verl's clipped value loss over typed ``ValueLossInputs``. Every method that takes a batch
declares its fields with ``batch_fields``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from megatron_rl.algos.value_loss import compute_value_loss
from megatron_rl.config import CriticConfig
from megatron_rl.data.batch import batch_fields
from megatron_rl.engine import LossMetrics, MegatronEngine, ModelOutput, StepInfo
from megatron_rl.roles.common import check_config, update_in_mini_batches, with_batch_info

__all__ = ["Critic", "ValueLossInputs"]

Batch = Mapping[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ValueLossInputs:
    """One micro-batch's tensors for the value loss (all ``[b, r]``)."""

    response_mask: torch.Tensor
    """1 on response tokens."""
    vpreds: torch.Tensor
    """The critic's current values at the response positions, masked (differentiable)."""
    values: torch.Tensor
    """The values the advantages were computed with (the clipping centre)."""
    returns: torch.Tensor
    """Regression targets."""

    @classmethod
    def from_micro_batch(cls, mb: Mapping[str, torch.Tensor], out: ModelOutput) -> "ValueLossInputs":
        """The inputs of micro-batch ``mb`` with the values read from ``out``."""
        mask = mb["response_mask"]
        return cls(mask, out.response_values() * mask, mb["values"], mb["returns"])


def value_loss(inputs: ValueLossInputs, config: CriticConfig) -> tuple[torch.Tensor, LossMetrics]:
    """verl's clipped value loss of one micro-batch and the ``critic/*`` metrics.

    ``config`` carries this step's ``global_batch_info`` (``with_batch_info``).
    """
    mask, vpreds = inputs.response_mask, inputs.vpreds
    vf_loss, vf_clipfrac = compute_value_loss(
        vpreds=vpreds,
        returns=inputs.returns,
        values=inputs.values,
        response_mask=mask,
        cliprange_value=config.cliprange_value,
        loss_agg_mode=config.loss_agg_mode,
        **config.global_batch_info,
    )
    tokens = mask.sum()
    weighted = {
        "critic/vf_clipfrac": float(vf_clipfrac) * float(tokens),
        "critic/vpred_mean": float((vpreds.detach() * mask).sum()),
    }
    return vf_loss, LossMetrics(sums={"critic/vf_loss": float(vf_loss.detach())}, weighted=weighted)


class Critic:
    """A scalar-head engine with the critic's methods.

    Args:
        engine: a trainable ``scalar``-head ``MegatronEngine``.
        config: the critic config (value loss, batch sizes; ``ppo_micro_batch_size_per_gpu`` is
            also the default forward micro-batch).
    """

    head = "scalar"
    config_type = CriticConfig

    def __init__(self, engine: MegatronEngine, config: CriticConfig):
        if engine.head != self.head:
            raise ValueError(f"the {engine.name!r} role needs a scalar head; its engine has head {engine.head!r}")
        check_config(engine.name, config, self.config_type)
        self.engine, self.config = engine, config

    @batch_fields("input_ids", "attention_mask", "responses", "response_mask")
    def compute_values(self, batch: Batch, *, micro_batch_size: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Critic values ``[b, r]`` at the positions predicting each response token (masked); micro-batches
        of ``micro_batch_size`` (default ``ppo_micro_batch_size_per_gpu``) or, with ``use_dynamic_bsz``,
        ``forward_max_token_len_per_gpu`` tokens."""

        def head(mb: dict, out: ModelOutput) -> dict[str, torch.Tensor]:
            return {"values": out.response_values() * mb["response_mask"]}

        budget = self.config.forward_token_budget()
        if budget is not None:  # use_dynamic_bsz: a token budget per micro-batch
            return self.engine.forward(
                batch, head, max_token_len=budget, budget_key="critic.forward_max_token_len_per_gpu"
            )
        mbs = micro_batch_size or self.config.ppo_micro_batch_size_per_gpu
        return self.engine.forward(batch, head, micro_batch_size=mbs)

    @batch_fields("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss update of the critic; returns verl's ``critic/*`` metrics."""
        cfg = self.config

        def loss_fn(mb: dict, out: ModelOutput, step: StepInfo):
            return value_loss(ValueLossInputs.from_micro_batch(mb, out), with_batch_info(cfg, step))

        return update_in_mini_batches(self.engine, batch, loss_fn, cfg, section="critic")
