"""``distillation``: on-policy distillation from a teacher -- the teacher model (``TeacherModelConfig``) and
verl's ``distillation.distillation_loss`` keys and defaults (``DistillationLossConfig``)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from megatron_rl.config.base_config import INTERNAL, BaseConfig, check_range
from megatron_rl.config.layout import MegatronConfig
from megatron_rl.config.model import ModelConfig

__all__ = [
    "DistillationConfig",
    "TeacherModelConfig",
    "DistillationLossConfig",
    "TOPK_LOSS_MODES",
    "ESTIMATOR_LOSS_MODES",
    "validate_modes",
]

TOPK_LOSS_MODES = ("forward_kl_topk",)
ESTIMATOR_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclasses.dataclass
class DistillationLossConfig(BaseConfig):
    """``distillation.distillation_loss`` with verl's keys and defaults."""

    loss_mode: str = "k3"
    """Name in ``DISTILLATION_LOSSES``."""
    topk: Optional[int] = 128
    """Teacher top-k size for ``forward_kl_topk``."""
    use_task_rewards: bool = True
    """Add the distillation loss to the task policy loss (else the distillation loss alone)."""
    distillation_loss_coef: float = 1.0
    """Weight of the distillation loss when combined with task rewards."""
    loss_max_clamp: Optional[float] = 10.0
    """Clamp per-token losses to ``[-c, c]`` before use; None = no clamp."""
    log_prob_min_clamp: Optional[float] = -10.0
    """Floor for top-k log-probs (teacher and student) in ``forward_kl_topk``; None = no floor."""
    use_chunked_topk: bool = False
    """``forward_kl_topk``: stream logsumexp over chunks of tokens instead of a full log-softmax."""
    chunked_topk_chunk_size: int = 4096
    """Tokens per chunk when ``use_chunked_topk``."""
    use_policy_gradient: bool = True
    """Use ``-loss`` as the advantage of ``policy_loss_mode`` instead of back-propagating the loss."""
    policy_loss_mode: str = "vanilla"
    """Name in ``POLICY_LOSSES`` used when ``use_policy_gradient``."""
    clip_ratio: float = 0.2
    """PPO clip epsilon of that policy loss."""
    clip_ratio_low: float = 0.2
    """Lower clip epsilon of that policy loss."""
    clip_ratio_high: float = 0.2
    """Upper clip epsilon of that policy loss."""
    global_batch_info: dict = field(default_factory=dict, metadata=INTERNAL)
    """Filled per step (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``)."""

    def __post_init__(self) -> None:
        validate_modes(self.loss_mode, self.use_policy_gradient)
        check_range("distillation_loss.chunked_topk_chunk_size", self.chunked_topk_chunk_size, low=1)


def validate_modes(loss_mode: str, use_policy_gradient: bool) -> None:
    valid = list(TOPK_LOSS_MODES + ESTIMATOR_LOSS_MODES)
    if loss_mode not in valid:
        raise ValueError(f"distillation_loss.loss_mode={loss_mode!r} is not allowed; choose one of {valid}")
    if not use_policy_gradient and loss_mode in ("k1", "kl"):
        raise ValueError(
            f"distillation_loss.loss_mode={loss_mode!r} with use_policy_gradient=False is wrong: the gradient of "
            "k1 w.r.t. the student does not depend on the teacher; use k3/forward_kl_topk or use_policy_gradient=True"
        )


@dataclasses.dataclass
class TeacherModelConfig(BaseConfig):
    """``distillation.teacher_model``: the teacher (set exactly one of ``model_path`` and ``config``);
    it must share the student's tokenizer."""

    model_path: Optional[str] = None
    """HF checkpoint of the teacher."""
    config: Optional[ModelConfig] = None
    """Inline architecture of a from-scratch teacher (toy runs)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Layout, dtype and offload of the teacher (forward only)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per forward micro-batch; None = ``actor.ppo_micro_batch_size_per_gpu``."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Token-budget forward micro-batches; None = the actor's (``actor.log_prob_use_dynamic_bsz``)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one forward micro-batch; None = the actor's forward budget."""
    sft_warmup_steps: int = 0
    """Inline teacher only: supervised steps on the built-in task before the run (a teacher must
    know the task better than the student); 0 = a randomly initialised teacher."""

    def __post_init__(self) -> None:
        check_range("distillation.teacher_model.sft_warmup_steps", self.sft_warmup_steps, low=0)
        if self.log_prob_micro_batch_size_per_gpu is not None:
            check_range(
                "distillation.teacher_model.log_prob_micro_batch_size_per_gpu",
                self.log_prob_micro_batch_size_per_gpu,
                low=1,
            )
        if self.log_prob_max_token_len_per_gpu is not None:
            check_range(
                "distillation.teacher_model.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu, low=1
            )


@dataclasses.dataclass
class DistillationConfig(BaseConfig):
    """``distillation``: on-policy distillation from a teacher (verl's keys)."""

    enabled: bool = False
    """Add the distillation loss (or reward) from ``teacher_model``."""
    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    """The teacher."""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """Loss mode, top-k, coefficient, clamps, policy-gradient mode."""
