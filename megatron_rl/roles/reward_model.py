"""The ``reward`` role: a frozen scalar-head reward model scoring whole sequences.

Its engine is a ``scalar``-head ``MegatronEngine`` loaded from an HF ``*ForSequenceClassification``
checkpoint (the score head becomes the scalar head); the score of a sequence is the head's value
at its last valid token.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from megatron_rl.config import RewardModelConfig
from megatron_rl.data.batch import batch_fields
from megatron_rl.engine import MegatronEngine, ModelOutput
from megatron_rl.roles.common import check_config

__all__ = ["RewardModel"]

Batch = Mapping[str, torch.Tensor]


class RewardModel:
    """A scalar-head engine with the reward model's method.

    Args:
        engine: a frozen ``scalar``-head ``MegatronEngine``.
        config: ``reward.reward_model`` (``micro_batch_size_per_gpu`` is the forward micro-batch).
    """

    head = "scalar"
    config_type = RewardModelConfig

    def __init__(self, engine: MegatronEngine, config: RewardModelConfig):
        if engine.head != self.head:
            raise ValueError(
                f"compute_rm_score needs a scalar-head engine (role 'reward'); this one is {engine.name!r}"
            )
        check_config(engine.name, config, self.config_type)
        self.engine, self.config = engine, config

    @batch_fields("input_ids", "attention_mask", "responses")
    def compute_rm_score(self, batch: Batch, *, micro_batch_size: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Reward-model scores ``rm_scores [b]``: the scalar head at the last valid token.

        The last valid token is the last ``attention_mask`` token of prompt + response (the end
        of the response, or of the prompt for an empty response) -- verl's reward-model semantics,
        and what HF ``*ForSequenceClassification`` picks (last non-pad token) when pads carry
        ``pad_token_id``.
        """

        def head(mb: dict, out: ModelOutput) -> dict[str, torch.Tensor]:
            values = out.sequence_values()  # [b, s]
            # Rows are left-aligned (packed rows unpacked so): the last valid token sits at column length - 1.
            last = (mb["attention_mask"].sum(-1).long() - 1).clamp(min=0)  # [b]
            return {"rm_scores": values.gather(1, last[:, None]).squeeze(1)}

        budget = self.config.forward_token_budget()
        if budget is not None:  # use_dynamic_bsz: a token budget per micro-batch
            return self.engine.forward(
                batch, head, max_token_len=budget, budget_key="reward.reward_model.forward_max_token_len_per_gpu"
            )
        mbs = micro_batch_size or self.config.micro_batch_size_per_gpu
        return self.engine.forward(batch, head, micro_batch_size=mbs)
