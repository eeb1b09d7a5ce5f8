"""The RL algorithm layer: pure tensor math and registries, with verl's names and semantics.

No Megatron, no Ray, no process groups here. ``ADV_ESTIMATORS`` and ``POLICY_LOSSES`` map
the strings in a recipe (``algorithm.adv_estimator``, ``actor.policy_loss.loss_mode``) to
functions; importing this package fills them.

A verl user changes one import line: every name below that verl 0.9.1 has
(``verl.trainer.ppo.core_algos``, ``verl.trainer.ppo.rollout_corr_helper``, ``group_mean_std``
from ``verl.utils``) is here with verl's signature and return type, e.g.
``ADV_ESTIMATOR_REGISTRY``, ``register_policy_loss``, ``AdvantageEstimator``,
``compute_policy_loss``, ``compute_rollout_correction_and_rejection_mask`` (a ``DataProto`` first).
"""

from megatron_rl.algos.algo_registry import (
    ADV_ESTIMATOR_REGISTRY,
    ADV_ESTIMATORS,
    POLICY_LOSS_REGISTRY,
    POLICY_LOSSES,
    AdvantageEstimator,
    Registry,
    UnknownNameError,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from megatron_rl.algos.loss_agg import LOSS_AGG_MODES, agg_loss, global_batch_info
from megatron_rl.algos.utils import (
    entropy_from_logits,
    expand_as_nested,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from megatron_rl.algos.value_loss import compute_entropy_loss, compute_value_loss
from megatron_rl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from megatron_rl.algos.rollout_correction import (
    SAFETY_BOUND,
    apply_bypass_mode,
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from megatron_rl.algos.dapo import apply_overlong_penalty, filter_groups, overlong_penalty
from megatron_rl.algos.distillation_loss import DISTILLATION_LOSSES, compute_distillation_loss

# Importing the implementation modules registers their entries.
from megatron_rl.algos import advantage  # noqa: E402,F401  isort:skip
from megatron_rl.algos import advantage_otb  # noqa: E402,F401  isort:skip
from megatron_rl.algos import policy_loss  # noqa: E402,F401  isort:skip
from megatron_rl.algos import policy_loss_variants  # noqa: E402,F401  isort:skip
from megatron_rl.algos.advantage import *  # noqa: E402,F401,F403  isort:skip  (verl's estimator function names)
from megatron_rl.algos.advantage_otb import *  # noqa: E402,F401,F403  isort:skip
from megatron_rl.algos.policy_loss import *  # noqa: E402,F401,F403  isort:skip  (verl's policy loss function names)
from megatron_rl.algos.policy_loss_variants import *  # noqa: E402,F401,F403  isort:skip
from megatron_rl.algos.multi_trajectory import compute_advantage_for_multi_trajectories  # noqa: E402  isort:skip
from megatron_rl.algos.verl_compat import (  # noqa: E402  isort:skip
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
    compute_is_metrics,
    compute_policy_loss,
    compute_rewards,
    compute_rs_metrics,
    group_mean_std,
)
from megatron_rl.algos.advantage import __all__ as _estimator_names  # noqa: E402  isort:skip
from megatron_rl.algos.advantage_otb import __all__ as _otb_names  # noqa: E402  isort:skip
from megatron_rl.algos.policy_loss import __all__ as _loss_names  # noqa: E402  isort:skip
from megatron_rl.algos.policy_loss_variants import __all__ as _variant_loss_names  # noqa: E402  isort:skip

__all__ = [
    *_estimator_names,
    *_otb_names,
    *_loss_names,
    *_variant_loss_names,
    "ADV_ESTIMATOR_REGISTRY",
    "ADV_ESTIMATORS",
    "AdvantageEstimator",
    "POLICY_LOSS_REGISTRY",
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "apply_bypass_mode",
    "compute_advantage_for_multi_trajectories",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_policy_loss",
    "compute_rewards",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
    "group_mean_std",
    "AdaptiveKLController",
    "DISTILLATION_LOSSES",
    "FixedKLController",
    "apply_kl_penalty",
    "apply_overlong_penalty",
    "compute_distillation_loss",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "filter_groups",
    "get_kl_controller",
    "kl_penalty",
    "overlong_penalty",
    "POLICY_LOSSES",
    "LOSS_AGG_MODES",
    "Registry",
    "UnknownNameError",
    "agg_loss",
    "compute_entropy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "global_batch_info",
    "masked_mean",
    "expand_as_nested",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]
