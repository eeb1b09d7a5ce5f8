"""Name -> function registries that turn "change the algorithm" into "change a string"."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Callable, TypeVar

from megatron_rl.utils.registry import Registry, UnknownNameError

__all__ = [
    "Registry",
    "UnknownNameError",
    "EstimatorNeeds",
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "register_adv_est",
    "register_policy_loss",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "estimator_needs",
]

F = TypeVar("F", bound=Callable)


@dataclasses.dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator reads beyond rewards, mask and group ids; declared when it is
    registered, so the trainer asks the entry instead of testing names."""

    values: bool = False
    """Critic values (GAE): a critic is trained."""
    baseline: bool = False
    """``reward_baselines`` [batch]: the reward of one greedy response per prompt (ReMax)."""
    ref: bool = False
    """Reference-policy log-probs: a reference model runs."""
    reward_fields: bool = False
    """The reward's per-sample fields (``non_tensor_batch``), e.g. GDPO's separate reward components."""


ADV_ESTIMATORS = Registry("advantage estimator", traits=EstimatorNeeds)
"""``algorithm.adv_estimator`` name -> ``fn(**kwargs) -> (advantages, returns)``; each entry
declares its ``EstimatorNeeds`` (``ADV_ESTIMATORS.traits_of(name)``)."""

POLICY_LOSSES = Registry("policy loss")
"""``actor.policy_loss.loss_mode`` name -> ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``."""


def register_adv_est(name: str | Enum, *, needs_values: bool = False, needs_baseline: bool = False,
                     needs_ref: bool = False, needs_reward_fields: bool = False) -> Callable[[F], F]:
    """Register an advantage estimator (verl's decorator name) with what it needs (``EstimatorNeeds``)."""
    return ADV_ESTIMATORS.register(name, values=needs_values, baseline=needs_baseline, ref=needs_ref,
                                   reward_fields=needs_reward_fields)


def register_policy_loss(name: str | Enum) -> Callable[[F], F]:
    """Register a policy loss (verl's decorator name)."""
    return POLICY_LOSSES.register(name)


def get_adv_estimator_fn(name: str | Enum) -> Callable:
    """Look up an advantage estimator; an unknown name raises ValueError listing valid names."""
    return ADV_ESTIMATORS[name]


def get_policy_loss_fn(name: str | Enum) -> Callable:
    """Look up a policy loss; an unknown name raises ValueError listing valid names."""
    return POLICY_LOSSES[name]


def estimator_needs(name: str | Enum) -> EstimatorNeeds:
    """What the advantage estimator ``name`` needs (unknown names list the valid ones)."""
    return ADV_ESTIMATORS.traits_of(name)
