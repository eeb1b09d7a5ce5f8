"""``actor_rollout_ref``: the policy model and its three roles -- the actor (``ActorConfig``, with its policy loss),
the rollout (``megatron_rl.config.rollout.RolloutConfig``) and the reference (``RefConfig``) -- with verl's keys.

A verl user's ``actor_rollout_ref.actor`` maps onto ``ActorConfig`` one to one, so
``megatron_rl.config.verl.omega_conf_to_dataclass(cfg.actor, ActorConfig)`` takes it; the algorithm functions
accept either form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from megatron_rl.config.algorithm import LOSS_AGG_MODES, RolloutCorrectionConfig, check_kl_type
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
from megatron_rl.config.rollout import RolloutConfig

__all__ = ["PolicyLossConfig", "ActorConfig", "RefConfig", "ActorRolloutRefConfig"]


@dataclasses.dataclass
class PolicyLossConfig(BaseConfig):
    """``actor.policy_loss.*``."""

    loss_mode: str = "vanilla"
    """Name in ``megatron_rl.algos.POLICY_LOSSES``."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is detached."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower covariance bound."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper covariance bound."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov / dppo_kl: KL penalty coefficient."""
    dro_beta: Optional[float] = None
    """dro: quadratic log-ratio penalty (required for ``dro``)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Rollout correction used inside the loss (bypass mode)."""
    plugins: Any = field(default=None, metadata=INTERNAL)
    """Estimators and policy losses registered from user code (``megatron_rl.algos.algo_registry.Plugins``),
    set by ``resolve_run``; unpickling it in a worker registers them there."""


@dataclasses.dataclass
class ActorConfig(BaseConfig):
    """``actor_rollout_ref.actor``: policy loss, batch sizes, optimizer and Megatron layout of the actor (verl's
    ``McoreActorConfig`` keys). The engine takes it as it is (``megatron_rl.roles``)."""

    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times ``rollout_n`` responses, split over DP ranks)."""
    ppo_micro_batch_size_per_gpu: int = 1
    """Responses per forward/backward micro-batch on each rank."""
    use_dynamic_bsz: bool = False
    """Form training micro-batches by a token budget (``ppo_max_token_len_per_gpu``) instead of
    ``ppo_micro_batch_size_per_gpu`` samples (verl's dynamic batch size)."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one training micro-batch on each rank (``use_dynamic_bsz``); it must hold the
    longest sample (``data.max_prompt_length + data.max_response_length``)."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Token-budget micro-batches for forward passes (the old log-probs; the reference's and teacher's
    default); None = ``use_dynamic_bsz``."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one forward micro-batch; None = ``ppo_max_token_len_per_gpu``."""
    ppo_epochs: int = 1
    """Passes over the batch per training step."""
    shuffle: bool = False
    """Shuffle samples between mini-batches (seeded by ``data_loader_seed``)."""
    data_loader_seed: int = 42
    """Seed for ``shuffle``."""
    rollout_n: int = 1
    """Responses per prompt (set from the rollout config)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk in the vocab-parallel log-prob/entropy computation (bounds memory)."""
    calculate_entropy: bool = True
    """Compute entropy in ``compute_log_prob`` (reported as ``actor/entropy``)."""
    calculate_sum_pi_squared: bool = False
    """Also compute ``sum_pi_squared`` (sum over the vocabulary of pi^2 per response token) in the
    old-log-prob pass, vocab-parallel in the same fused pass as log-probs and entropy; the
    optimal-token-baseline estimators need it (they turn it on themselves)."""
    strategy: str = "megatron"
    """Training backend; only ``megatron``."""

    clip_ratio: float = 0.2
    """PPO clip epsilon."""
    clip_ratio_low: Optional[float] = 0.2
    """Lower clip epsilon (ratio >= 1 - low); ``None`` = ``clip_ratio``."""
    clip_ratio_high: Optional[float] = 0.2
    """Upper clip epsilon (ratio <= 1 + high); DAPO's clip-higher raises it (e.g. 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages; must be > 1."""
    loss_agg_mode: str = "token-mean"
    """How token losses become a scalar (see ``LOSS_AGG_MODES``)."""
    loss_scale_factor: Optional[int] = None
    """Constant divisor for ``seq-mean-token-sum-norm`` (default: the response length)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy-loss selection and options."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    tau_pos: float = 1.0
    """sapo: temperature for positive advantages."""
    tau_neg: float = 1.05
    """sapo: temperature for negative advantages."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(actor || ref)`` to the loss."""
    kl_loss_coef: float = 0.001
    """KL loss coefficient."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the KL loss."""
    global_batch_info: dict = field(default_factory=dict, metadata=INTERNAL)
    """Set by the engine per step: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor`` so ``agg_loss`` normalises by the global batch."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout, offload and dtype of the policy."""

    def __post_init__(self) -> None:
        check_built("actor.strategy", self.strategy, TRAINING_ENGINES, "training engines")  # before the loss checks
        check_rollout_n(self.rollout_n)
        for name in (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_epochs",
            "rollout_n",
            "logprob_chunk_size",
            "ppo_max_token_len_per_gpu",
        ):
            check_range(f"actor.{name}", getattr(self, name), low=1)
        if self.log_prob_max_token_len_per_gpu is not None:
            check_range("actor.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu, low=1)
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c={self.clip_ratio_c!r} must be > 1.0 (dual-clip lower bound)")
        check_choice("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_kl_type("actor.kl_loss_type", self.kl_loss_type)

    def train_token_budget(self) -> Optional[int]:
        """Tokens per training micro-batch with ``use_dynamic_bsz``, else None (fixed-size micro-batches)."""
        return self.ppo_max_token_len_per_gpu if self.use_dynamic_bsz else None

    def forward_token_budget(self) -> Optional[int]:
        """Tokens per forward micro-batch (``log_prob_*``, defaulting to the training keys), or None."""
        dynamic = self.use_dynamic_bsz if self.log_prob_use_dynamic_bsz is None else self.log_prob_use_dynamic_bsz
        if not dynamic:
            return None
        budget = self.log_prob_max_token_len_per_gpu
        return self.ppo_max_token_len_per_gpu if budget is None else budget


@dataclasses.dataclass
class RefConfig(BaseConfig):
    """``actor_rollout_ref.ref``: the frozen reference policy (same model as the actor)."""

    strategy: str = "megatron"
    """Backend; only ``megatron``."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Layout, dtype and offload of the reference; each key left out is copied from the actor's."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per forward micro-batch; None = ``actor.ppo_micro_batch_size_per_gpu``."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Token-budget forward micro-batches; None = ``actor.log_prob_use_dynamic_bsz`` (itself
    ``actor.use_dynamic_bsz`` by default)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one forward micro-batch; None = the actor's forward budget."""

    def __post_init__(self) -> None:
        check_built("ref.strategy", self.strategy, TRAINING_ENGINES, "training engines")
        if self.log_prob_micro_batch_size_per_gpu is not None:
            check_range("ref.log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu, low=1)
        if self.log_prob_max_token_len_per_gpu is not None:
            check_range("ref.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu, low=1)


@dataclasses.dataclass
class ActorRolloutRefConfig(BaseConfig):
    """``actor_rollout_ref``: the policy model and its three roles."""

    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    """The policy model (shared by actor, rollout and reference)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation with vLLM."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy for KL terms."""
