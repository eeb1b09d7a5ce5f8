"""The RL algorithm layer: pure tensor math and registries, with verl's names and semantics.

No Megatron, no Ray, no process groups here. ``ADV_ESTIMATORS`` and ``POLICY_LOSSES`` map
the strings in a recipe (``algorithm.adv_estimator``, ``actor.policy_loss.loss_mode``) to
functions; importing this package fills them.
"""

from megatron_rl.algos.registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from megatron_rl.algos.loss_agg import LOSS_AGG_MODES, agg_loss, global_batch_info
from megatron_rl.algos.utils import entropy_from_logits, masked_mean, masked_sum, masked_var, masked_whiten
from megatron_rl.algos.value_loss import compute_entropy_loss, compute_value_loss
from megatron_rl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from megatron_rl.algos.rollout_correction import (
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_and_rejection_mask,
)
from megatron_rl.algos.dapo import apply_overlong_penalty, filter_groups, overlong_penalty
from megatron_rl.algos.distillation import DISTILLATION_LOSSES, compute_distillation_loss

# Importing the implementation modules registers their entries.
from megatron_rl.algos import advantage  # noqa: E402,F401  isort:skip
from megatron_rl.algos import policy_loss  # noqa: E402,F401  isort:skip

__all__ = [
    "ADV_ESTIMATORS",
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
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]
