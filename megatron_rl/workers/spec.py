"""``WorkerSpec``: what the ranks of one Megatron role build, as one typed, picklable value.

The trainer's placement builds one per role from the typed run config and hands it to the
worker group; every rank receives the same spec and builds its engine and role object from it
(``MegatronWorker.init_engine``). Nothing below reads the run config itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_rl.config.model import ModelConfig
from megatron_rl.config.layout import MegatronConfig

__all__ = ["ROLES", "WorkerSpec"]

ROLES = ("actor", "ref", "critic", "reward", "teacher")
"""``actor`` (trainable policy), ``ref`` (frozen policy), ``critic`` (trainable scalar head), ``reward``
(frozen scalar head: an HF ``*ForSequenceClassification`` reward model), ``teacher`` (frozen LM of
on-policy distillation: any size, the student's vocabulary)."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One Megatron role: its name, layout, role config and model (an HF directory or an inline config)."""

    role: str
    """One of ``ROLES``."""
    megatron: MegatronConfig
    """Layout, dtype, seed, offload flags and ``override_transformer_config`` of this role."""
    config: Any = None
    """The role's own config: ``ActorConfig`` (actor, ref, teacher), ``CriticConfig`` (critic) or
    ``RewardModelConfig`` (reward)."""
    hf_dir: Optional[str] = None
    """HF checkpoint to load (its family also names the weights on export)."""
    model_config: Optional[ModelConfig] = None
    """Inline architecture (random init seeded by ``megatron.seed``) instead of ``hf_dir``."""
    model_overrides: dict = dataclasses.field(default_factory=dict)
    """``ModelConfig`` fields set on top of the checkpoint's (``model.override_config``)."""
    lora: Optional[Any] = None
    """The actor's ``megatron_rl.config.lora_config.LoRAConfig`` (``rank > 0``): adapters on a frozen base; None = none."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r}; allowed: {list(ROLES)}")
        if (self.hf_dir is None) == (self.model_config is None):
            raise ValueError(f"{self.role}: give exactly one of hf_dir and model_config")
        if self.lora is not None and self.role != "actor":
            raise ValueError(f"{self.role}: LoRA adapters go on the actor only (got lora.rank={self.lora.rank})")
