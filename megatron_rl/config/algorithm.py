"""Typed configs for the algorithm layer, with verl's key names and defaults.

A verl user's Hydra/OmegaConf config (``algorithm.*`` and ``actor_rollout_ref.actor.*``) maps
onto these one to one, so ``AlgoConfig.from_dict(cfg.algorithm)`` and
``ActorConfig.from_dict(cfg.actor)`` accept it; the algorithm functions accept either form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from collections.abc import Mapping
from typing import Any, Optional

from megatron_rl.config.base_config import INTERNAL, BaseConfig, check_choice, check_range

__all__ = [
    "KLControlConfig",
    "FilterGroupsConfig",
    "RolloutCorrectionConfig",
    "AlgoConfig",
    "PolicyLossConfig",
    "ActorConfig",
    "CriticConfig",
    "OptimConfig",
    "LOSS_AGG_MODES",
    "KL_PENALTY_TYPES",
    "ROLLOUT_CORRECTION_PRESETS",
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
    plugins: Any = field(default=None, metadata=INTERNAL)
    """Estimators and policy losses registered from user code (``megatron_rl.algos.algo_registry.Plugins``),
    set by ``resolve_run``; unpickling it in a worker registers them there."""


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


@dataclasses.dataclass
class ActorConfig(BaseConfig):
    """``actor.*``: policy loss, batch sizes and optimizer of the actor (verl's keys)."""

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
    """Training backend (verl's key); only ``megatron``."""

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

    def __post_init__(self) -> None:
        check_choice("actor.strategy", self.strategy, ("megatron",))
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
        _check_kl_type("actor.kl_loss_type", self.kl_loss_type)

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
class CriticConfig(BaseConfig):
    """``critic.*``: value-function training (verl's keys)."""

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
    """Training backend (verl's key); only ``megatron``."""

    def __post_init__(self) -> None:
        check_choice("critic.strategy", self.strategy, ("megatron",))
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
