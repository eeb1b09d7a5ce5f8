"""``critic``: the value function of PPO's GAE -- its loss, batch sizes, optimizer, model and Megatron layout."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from megatron_rl.config.algorithm import LOSS_AGG_MODES
from megatron_rl.config.base_config import (
    INTERNAL,
    TRAINING_ENGINES,
    BaseConfig,
    check_built,
    check_choice,
    check_range,
)
from megatron_rl.config.layout import MegatronConfig, check_rollout_n
from megatron_rl.config.model import ModelSourceConfig
from megatron_rl.config.optim import OptimConfig

__all__ = ["CriticConfig"]


@dataclasses.dataclass
class CriticConfig(BaseConfig):
    """``critic``: value-function training, the value model and its Megatron layout (verl's ``McoreCriticConfig``
    keys)."""

    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times ``rollout_n``)."""
    ppo_micro_batch_size_per_gpu: int = 1
    """Responses per micro-batch on each rank."""
    use_dynamic_bsz: Optional[bool] = None
    """Token-budget micro-batches (``ppo_max_token_len_per_gpu`` for updates,
    ``forward_max_token_len_per_gpu`` for values); None = ``actor_rollout_ref.actor.use_dynamic_bsz``
    (a critic config on its own: off)."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one training micro-batch on each rank (``use_dynamic_bsz``)."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one forward (values) micro-batch; None = ``ppo_max_token_len_per_gpu``."""
    ppo_epochs: int = 1
    """Passes over the batch per training step."""
    shuffle: bool = False
    """Shuffle samples between mini-batches."""
    data_loader_seed: int = 42
    """Seed for ``shuffle``."""
    rollout_n: int = 1
    """Responses per prompt."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss (see ``LOSS_AGG_MODES``)."""
    loss_scale_factor: Optional[int] = None
    """Constant divisor for ``seq-mean-token-sum-norm``."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule."""
    global_batch_info: dict = field(default_factory=dict, metadata=INTERNAL)
    """Set by the engine per step (see ``ActorConfig.global_batch_info``)."""
    strategy: str = "megatron"
    """Backend; only ``megatron``."""
    enable: Optional[bool] = None
    """Train a critic; None = only when ``algorithm.adv_estimator`` uses values (``gae``)."""
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    """Value model (a scalar head on this model); defaults to the policy model."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout, offload and dtype of the critic."""

    def __post_init__(self) -> None:
        check_built("critic.strategy", self.strategy, TRAINING_ENGINES, "training engines")  # before the loss checks
        check_rollout_n(self.rollout_n)
        for name in (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_epochs",
            "rollout_n",
            "ppo_max_token_len_per_gpu",
        ):
            check_range(f"critic.{name}", getattr(self, name), low=1)
        if self.forward_max_token_len_per_gpu is not None:
            check_range("critic.forward_max_token_len_per_gpu", self.forward_max_token_len_per_gpu, low=1)
        check_choice("critic.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)

    def train_token_budget(self) -> Optional[int]:
        """Tokens per training micro-batch with ``use_dynamic_bsz``, else None."""
        return self.ppo_max_token_len_per_gpu if self.use_dynamic_bsz else None

    def forward_token_budget(self) -> Optional[int]:
        """Tokens per forward (values) micro-batch with ``use_dynamic_bsz``, else None."""
        if not self.use_dynamic_bsz:
            return None
        budget = self.forward_max_token_len_per_gpu
        return self.ppo_max_token_len_per_gpu if budget is None else budget
