"""Typed configs for the algorithm layer, with verl's key names and defaults.

A verl user's Hydra/OmegaConf config (``algorithm.*`` and ``actor_rollout_ref.actor.*``) maps
onto these one to one, so ``AlgoConfig.from_dict(cfg.algorithm)`` and
``ActorConfig.from_dict(cfg.actor)`` accept it; the algorithm functions accept either form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from megatron_rl.config.base import BaseConfig, check_choice, check_range

__all__ = [
    "KLControlConfig",
    "FilterGroupsConfig",
    "RolloutCorrectionConfig",
    "AlgoConfig",
    "PolicyLossConfig",
    "ActorConfig",
    "LOSS_AGG_MODES",
    "KL_PENALTY_TYPES",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Base estimators; each also has a straight-through "+" variant (e.g. "low_var_kl+").
KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def _check_kl_type(field_name: str, value: str) -> None:
    base = value[:-1] if isinstance(value, str) and value.endswith("+") else value
    allowed = list(KL_PENALTY_TYPES) + [k + "+" for k in KL_PENALTY_TYPES if k != "full"]
    if base not in KL_PENALTY_TYPES or value == "full+":
        raise ValueError(f"{field_name}={value!r} is not allowed; choose one of {allowed}")


@dataclasses.dataclass
class KLControlConfig(BaseConfig):
    """KL coefficient controller for KL-in-reward (``algorithm.kl_ctrl``)."""

    type: str = "fixed"
    """``fixed`` keeps ``kl_coef``; ``adaptive`` steers it towards ``target_kl`` (Ziegler et al.)."""
    kl_coef: float = 0.001
    """Initial (or fixed) KL coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon in samples."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""

    def __post_init__(self) -> None:
        check_choice("kl_ctrl.type", self.type, ("fixed", "adaptive"))
        check_range("kl_ctrl.kl_coef", self.kl_coef, low=0.0)
        if self.type == "adaptive":
            check_range("kl_ctrl.horizon", self.horizon, low=0, low_inclusive=False)


@dataclasses.dataclass
class FilterGroupsConfig(BaseConfig):
    """DAPO dynamic sampling (``algorithm.filter_groups``)."""

    enable: bool = False
    """Drop groups whose ``metric`` is identical across all of their samples."""
    metric: Optional[str] = None
    """Per-sample metric to compare: ``acc``, ``score``, ``seq_reward``, ``seq_final_reward`` ..."""
    max_num_gen_batches: int = 0
    """Re-sample at most this many generation batches per step (0 = unbounded)."""
    max_inflight_gen_batches: int = 1
    """Generation batches in flight at once."""


@dataclasses.dataclass
class RolloutCorrectionConfig(BaseConfig):
    """Rollout (training/inference mismatch) correction, verl's ``rollout_correction``."""

    rollout_is: Optional[str] = "sequence"
    """IS weight level: ``None`` (metrics only), ``token`` or ``sequence``."""
    rollout_is_threshold: Any = 2.0
    """Float = TIS upper clamp; ``"low_high"`` string = IcePop (zero weight outside [low, high])."""
    rollout_is_batch_normalize: bool = False
    """Normalise IS weights to mean 1 over the batch."""
    rollout_rs: Optional[str] = None
    """Rejection sampling mode(s), comma separated (``token_k1``, ``seq_sum_k1``, ``seq_mean_k3`` ...)."""
    rollout_rs_threshold: Any = None
    """Rejection threshold(s): ``"low_high"`` for k1 ratio modes, an upper bound for k2/k3."""
    bypass_mode: bool = False
    """Use rollout log-probs as old log-probs (two policies instead of three)."""
    loss_type: str = "ppo_clip"
    """Loss in bypass mode: ``ppo_clip`` or ``reinforce``."""

    def __post_init__(self) -> None:
        check_choice("rollout_correction.rollout_is", self.rollout_is, (None, "token", "sequence"))
        check_choice("rollout_correction.loss_type", self.loss_type, ("ppo_clip", "reinforce"))


@dataclasses.dataclass
class AlgoConfig(BaseConfig):
    """``algorithm.*``: advantage estimation and KL-in-reward."""

    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    adv_estimator: str = "gae"
    """Name in ``megatron_rl.algos.ADV_ESTIMATORS``."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group std; ``False`` is Dr.GRPO."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_coef * KL(actor || ref)`` from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for KL-in-reward (see ``KL_PENALTY_TYPES``)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL coefficient controller."""
    use_pf_ppo: bool = False
    """Preference-feedback PPO reweighting (GAE only)."""
    pf_ppo: dict = field(default_factory=dict)
    """Options for ``use_pf_ppo``."""
    filter_groups: Optional[FilterGroupsConfig] = None
    """DAPO dynamic sampling."""
    rollout_correction: Optional[RolloutCorrectionConfig] = None
    """Rollout correction (IS weights, rejection sampling, bypass mode)."""
    gdpo_reward_keys: Optional[list] = None
    """GDPO: names of the per-sample reward components, normalised separately."""
    gdpo_reward_weights: Optional[list] = None
    """GDPO: weight of each component (default: all 1)."""

    def __post_init__(self) -> None:
        check_range("algorithm.gamma", self.gamma, low=0.0, high=1.0)
        check_range("algorithm.lam", self.lam, low=0.0, high=1.0)
        _check_kl_type("algorithm.kl_penalty", self.kl_penalty)
        if self.gdpo_reward_weights is not None and self.gdpo_reward_keys is not None:
            if len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys):
                raise ValueError(
                    f"algorithm.gdpo_reward_weights has {len(self.gdpo_reward_weights)} entries but "
                    f"algorithm.gdpo_reward_keys has {len(self.gdpo_reward_keys)}; they must match"
                )


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


@dataclasses.dataclass
class ActorConfig(BaseConfig):
    """``actor.*`` keys the policy loss reads (the engine extends this with optimiser settings)."""

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
    global_batch_info: dict = field(default_factory=dict)
    """Set by the engine per step: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor`` so ``agg_loss`` normalises by the global batch."""

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c={self.clip_ratio_c!r} must be > 1.0 (dual-clip lower bound)")
        check_choice("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_kl_type("actor.kl_loss_type", self.kl_loss_type)
