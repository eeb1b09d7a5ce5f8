"""What a run needs, read off the registries: which roles run and what the step must compute.

``resolve_run(config)`` checks the algorithm names of a ``RunConfig`` against the
registries (a miss lists the valid names and the nearest), asks the advantage estimator's
registry entry what it reads (``EstimatorNeeds``: critic values, a greedy baseline, reference
log-probs), combines that with the config's own switches (KL loss / KL-in-reward, reward model,
distillation) and has the config check the layouts and batch sizes of exactly the roles that
run (``RunConfig.check_roles``). The trainer and the planner both start from its answer,
so neither tests an estimator's name.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.algos.algo_registry import ADV_ESTIMATORS, POLICY_LOSSES, EstimatorNeeds, plugins
from megatron_rl.config.base_config import suggest
from megatron_rl.config.run_config import RunConfig

__all__ = ["RunNeeds", "resolve_run", "with_plugins"]


@dataclasses.dataclass(frozen=True)
class RunNeeds:
    """The roles a run creates and the extra work of its step."""

    critic: bool
    """A critic is trained and its values feed the estimator."""
    reference: bool
    """A frozen reference policy computes ``ref_log_prob``."""
    reward_model: bool
    """A reward-model worker scores the responses."""
    teacher: bool
    """A distillation teacher computes its log-probs (or top-k) for the student."""
    baseline: bool
    """One greedy response per prompt is generated and scored as ``reward_baselines`` (ReMax)."""
    estimator: EstimatorNeeds
    """What the advantage estimator declared."""
    old_log_prob: bool = True
    """The actor's old-log-prob pass runs. Always in decoupled mode; in bypass mode
    (``algorithm.rollout_correction.bypass_mode``, forced by ``separate_async``) the rollout's log-probs are
    the old ones and the pass is skipped, as verl's ``apply_bypass_mode`` skips it, unless the step needs a
    product of it: sum_v pi_v^2 (the estimator's or ``actor.calculate_sum_pi_squared``) or router replay's
    routing (``actor.megatron.router_replay``: R2's record, R3's agreement with the rollout)."""


def _check_name(field_name: str, value: object, registry, what: str) -> None:
    if value not in registry:
        names = sorted(registry)
        raise ValueError(
            f"{field_name}={value!r} is not a registered {what}; choose one of {names}{suggest(value, names)}"
        )


def resolve_run(config: RunConfig) -> RunNeeds:
    """Check ``config``'s algorithm names and role layouts; return what the run needs.

    Raises ``ValueError`` naming the field for an unregistered estimator or policy loss, an
    estimator that needs a critic with ``critic.enable=False``, and every layout / batch-size
    misfit of a role that runs (``with_plugins`` carries the driver's own entries to the workers).
    """
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    _check_name("algorithm.adv_estimator", algo.adv_estimator, ADV_ESTIMATORS, "advantage estimator")
    _check_name(
        "actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, POLICY_LOSSES, "policy loss"
    )
    estimator = ADV_ESTIMATORS.traits_of(algo.adv_estimator)
    if config.critic.enable is False and estimator.values:
        raise ValueError(f"algorithm.adv_estimator={algo.adv_estimator!r} needs a critic, but critic.enable=False")
    needs = RunNeeds(
        critic=estimator.values if config.critic.enable is None else bool(config.critic.enable),
        reference=bool(actor.use_kl_loss or algo.use_kl_in_reward or estimator.ref),
        reward_model=bool(config.reward.reward_model.enable),
        teacher=bool(config.distillation.enabled),
        baseline=estimator.baseline,
        estimator=estimator,
        old_log_prob=_old_log_prob_pass(config, estimator),
    )
    config.check_roles(
        critic=needs.critic, reference=needs.reference, reward_model=needs.reward_model, teacher=needs.teacher
    )
    return needs


def _old_log_prob_pass(config: RunConfig, estimator: EstimatorNeeds) -> bool:
    """``RunNeeds.old_log_prob``."""
    rc, actor = config.algorithm.rollout_correction, config.actor_rollout_ref.actor
    bypass = config.trainer.v1.trainer_mode == "separate_async" or bool(rc is not None and rc.bypass_mode)
    if not bypass:
        return True
    return bool(estimator.sum_pi_squared or actor.calculate_sum_pi_squared or actor.megatron.router_replay.enabled)


def with_plugins(config: RunConfig) -> RunConfig:
    """``config`` with the entries registered from user code (``register_adv_est`` / ``register_policy_loss``
    in the driver's script) in ``actor_rollout_ref.actor.policy_loss.plugins``, so that the workers that
    receive the actor's config register them too (unpickling it does); ``config`` itself without any."""
    snapshot = plugins()
    if snapshot is None:
        return config
    return config.with_values({"actor_rollout_ref.actor.policy_loss.plugins": snapshot})
