"""``actor.optim`` / ``critic.optim``: the Megatron optimizer and learning-rate schedule of a trained role."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

from megatron_rl.config.base_config import BaseConfig, check_choice, check_range

__all__ = ["OptimConfig"]


@dataclasses.dataclass
class OptimConfig(BaseConfig):
    """``actor.optim`` / ``critic.optim``: Megatron optimizer and learning-rate schedule."""

    optimizer: str = "adam"
    """``adam`` (AdamW with decoupled weight decay) or ``sgd``."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    lr_warmup_steps: int = -1
    """Linear warm-up steps; -1 = use ``lr_warmup_steps_ratio``."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of ``total_training_steps``."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warm-up."""
    lr_decay_style: str = "constant"
    """``constant``, ``linear``, ``cosine`` or ``inverse-square-root``."""
    lr_decay_steps: Optional[int] = None
    """Decay horizon; None = ``total_training_steps``."""
    total_training_steps: int = -1
    """Optimizer steps in the run (set by the trainer)."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    betas: tuple = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all model-parallel ranks); 0 disables."""
    override_optimizer_config: Optional[dict] = None
    """Fields of Megatron's ``OptimizerConfig`` set on top of the ones above, as verl sets them
    (``optimizer_cpu_offload``, ``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``,
    ``use_precision_aware_optimizer`` ...); a name megatron-core lacks is refused when the optimizer is built."""

    def __post_init__(self) -> None:
        check_choice("optim.optimizer", self.optimizer, ("adam", "sgd"))
        if self.override_optimizer_config is not None and not isinstance(self.override_optimizer_config, Mapping):
            raise ValueError(
                f"optim.override_optimizer_config={self.override_optimizer_config!r} must be a mapping "
                "of Megatron OptimizerConfig fields"
            )
        check_choice(
            "optim.lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine", "inverse-square-root")
        )
        check_range("optim.lr", self.lr, low=0.0)
        check_range("optim.clip_grad", self.clip_grad, low=0.0)
        if len(tuple(self.betas)) != 2:
            raise ValueError(f"optim.betas={self.betas!r} must have two entries")
