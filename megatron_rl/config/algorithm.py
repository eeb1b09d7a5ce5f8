"""``algorithm``: advantage estimation, KL-in-reward, DAPO's group filtering and rollout correction, with
verl's key names and defaults (``megatron_rl.config.verl.omega_conf_to_dataclass(cfg.algorithm)`` takes a verl
config's section), and
the loss-aggregation and KL names the actor's and critic's sections check against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from megatron_rl.config.base_config import BaseConfig, check_choice, check_range

__all__ = [
    "KLControlConfig",
    "FilterGroupsConfig",
    "RolloutCorrectionConfig",
    "AlgoConfig",
    "LOSS_AGG_MODES",
    "KL_PENALTY_TYPES",
    "ROLLOUT_CORRECTION_PRESETS",
    "check_kl_type",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Base estimators; each also has a straight-through "+" variant (e.g. "low_var_kl+").
KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def check_kl_type(field_name: str, value: str) -> None:
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

    # -- verl's named presets (decoupled: three policies; bypass: the rollout's log-probs are the old ones)
    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Token-level truncated IS (Token-TIS)."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Sequence-level truncated IS (Seq-TIS)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """Token-level IcePop: weights outside ``[threshold_lower, threshold]`` are zeroed."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}", rollout_rs=None)

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: Any = "0.5_2.0") -> "RolloutCorrectionConfig":
        """Sequence IS plus sequence rejection on the summed log-ratio (Seq-MIS)."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_sum_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: Any = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Rejection on the geometric-mean ratio (``seq_mean_k1``), no IS weights (Geo-RS)."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def bypass_ppo_clip(cls) -> "RolloutCorrectionConfig":
        """Bypass mode, PPO-clip loss (its ratio already is the IS ratio)."""
        return cls(rollout_is=None, rollout_rs=None, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: Any = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Bypass mode, PPO-clip loss, Geo-RS."""
        return cls(
            rollout_is=None,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """Bypass mode, PPO-clip loss, rejection on the sequence-mean k3 divergence."""
        return cls(
            rollout_is=None,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Bypass mode, REINFORCE loss with sequence-level truncated IS weights."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=threshold,
            rollout_rs=None,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """Bypass mode, REINFORCE loss with token-level IcePop weights."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=f"{threshold_lower}_{threshold}",
            rollout_rs=None,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: Any = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Bypass mode, REINFORCE loss, Geo-RS."""
        return cls(
            rollout_is=None,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def decoupled_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: Any = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Geo-RS plus sequence-level truncated IS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: Any = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Geo-RS plus token-level truncated IS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def bypass_pg_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: Any = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Bypass mode, REINFORCE loss, Geo-RS plus sequence-level truncated IS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: Any = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Bypass mode, REINFORCE loss, Geo-RS plus token-level truncated IS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """Rejection on the sequence-mean k3 divergence, no IS weights (K3-RS)."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
    ) -> "RolloutCorrectionConfig":
        """K3-RS plus sequence-level truncated IS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_k3_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
    ) -> "RolloutCorrectionConfig":
        """K3-RS plus token-level truncated IS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def disabled(cls) -> "RolloutCorrectionConfig":
        """Metrics only: no IS weights, no rejection."""
        return cls(rollout_is=None, rollout_rs=None)


ROLLOUT_CORRECTION_PRESETS = tuple(
    name
    for name, value in vars(RolloutCorrectionConfig).items()
    if isinstance(value, classmethod) and name not in ("from_dict",)
)
"""The names of verl's ``RolloutCorrectionConfig`` presets (classmethods), ``disabled`` included."""


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
        check_kl_type("algorithm.kl_penalty", self.kl_penalty)
        if self.gdpo_reward_weights is not None and self.gdpo_reward_keys is not None:
            if len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys):
                raise ValueError(
                    f"algorithm.gdpo_reward_weights has {len(self.gdpo_reward_weights)} entries but "
                    f"algorithm.gdpo_reward_keys has {len(self.gdpo_reward_keys)}; they must match"
                )
