"""KL estimators, KL coefficient controllers and KL-in-reward (verl's ``kl_penalty`` family).

KL between the actor ``pi`` and a reference ``ref`` is estimated per token from the log-probs
of the sampled token only (J. Schulman, "Approximating KL divergence", 2020), with
``delta = logprob - ref_logprob``:

- ``kl`` / ``k1``: ``delta`` (unbiased, high variance, can be negative);
- ``abs``: ``|delta|``;
- ``mse`` / ``k2``: ``0.5 * delta**2`` (biased value, but its gradient is the unbiased KL gradient);
- ``low_var_kl`` / ``k3``: ``exp(-delta) + delta - 1`` (unbiased, >= 0, low variance); ``-delta`` is
  clamped to [-20, 20] before ``exp`` and the result to [-10, 10], as in verl.

A trailing ``+`` (``k1+``, ``k3+``, ``low_var_kl+`` ...) is verl's straight-through variant: the
*value* of the named estimator with the *gradient* of ``k2`` (the unbiased KL gradient).

KL can enter training in two places: in the reward (``algorithm.use_kl_in_reward``, see
``apply_kl_penalty``, coefficient from a ``FixedKLController``/``AdaptiveKLController``) or in the
actor loss (``actor.use_kl_loss``, the policy-loss code calls ``kl_penalty`` directly).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_rl.algos.algo_registry import Registry
from megatron_rl.algos.utils import cfg_get, check_same_shape, masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "kl_penalty",
    "kl_penalty_forward",
    "valid_kl_penalty_names",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "apply_kl_penalty",
]

KL_ESTIMATORS = Registry("KL estimator")
"""Base estimator name -> ``fn(logprob, ref_logprob) -> per-token estimate`` (same shape)."""

# exp() of a log-ratio beyond this overflows float16/bfloat16 soon after; verl clamps here.
_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


@KL_ESTIMATORS.register("kl")
@KL_ESTIMATORS.register("k1")
def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("mse")
@KL_ESTIMATORS.register("k2")
def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("low_var_kl")
@KL_ESTIMATORS.register("k3")
def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_logprob - logprob, min=-_K3_LOG_RATIO_BOUND, max=_K3_LOG_RATIO_BOUND)
    kld = (torch.exp(log_ratio) - log_ratio - 1).contiguous()
    return torch.clamp(kld, min=-_K3_VALUE_BOUND, max=_K3_VALUE_BOUND)


def valid_kl_penalty_names() -> list[str]:
    """Every accepted ``kl_penalty`` string: the base estimators and their ``+`` variants."""
    bases = sorted(KL_ESTIMATORS)
    return bases + [name + "+" for name in bases]


def _lookup(kl_penalty: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if kl_penalty in ("full", "full+"):
        # verl reserves the name but raises too: it needs full-vocabulary distributions.
        raise NotImplementedError(
            f"kl_penalty={kl_penalty!r} needs full-vocabulary log-probs and is not implemented "
            f"(as in verl); choose one of {valid_kl_penalty_names()}"
        )
    base = kl_penalty[:-1] if isinstance(kl_penalty, str) and kl_penalty.endswith("+") else kl_penalty
    if not isinstance(base, str) or base not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty={kl_penalty!r} is not allowed; choose one of {valid_kl_penalty_names()}")
    return KL_ESTIMATORS[base]


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The plain estimate named by ``kl_penalty`` (a base name, no ``+``), same shape as the inputs."""
    if isinstance(kl_penalty, str) and kl_penalty.endswith("+"):
        raise ValueError(f"kl_penalty_forward takes a base estimator name, got {kl_penalty!r}; use kl_penalty()")
    return _lookup(kl_penalty)(logprob, ref_logprob)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate of ``KL(pi || ref)`` from sampled-token log-probs (verl's ``kl_penalty``).

    Args:
        logprob: ``[bs, T]`` log-probs of the sampled tokens under the actor.
        ref_logprob: ``[bs, T]`` log-probs of the same tokens under the reference policy.
        kl_penalty: estimator name (see the module docstring); a trailing ``+`` selects the
            straight-through variant whose value is that estimator and whose gradient is ``k2``'s.

    Returns:
        ``[bs, T]`` estimate (not masked). Unknown names raise ``ValueError`` listing valid ones.
    """
    estimator = _lookup(kl_penalty)
    forward_score = estimator(logprob, ref_logprob)
    if not kl_penalty.endswith("+"):
        return forward_score
    # k1 and k3 are unbiased in value but their expected gradient is not the KL gradient; k2's is.
    # b - b.detach() is exactly 0 in value, so the result equals forward_score bit for bit.
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    After each batch ``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``:
    the coefficient grows when KL exceeds the target and shrinks when it is below.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon={horizon!r} must be > 0 for the adaptive KL controller")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards keeping ``current_kl`` at ``target`` (``n_steps`` = samples seen)."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep ``value`` unchanged (the signature matches ``AdaptiveKLController.update``)."""


def get_kl_controller(kl_ctrl_config: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller of ``algorithm.kl_ctrl`` (a ``KLControlConfig``, DictConfig or dict).

    Keys: ``type`` (``fixed``/``adaptive``), ``kl_coef``, and for ``adaptive`` ``target_kl``, ``horizon``.
    """
    ctrl_type = cfg_get(kl_ctrl_config, "type", "fixed")
    kl_coef = cfg_get(kl_ctrl_config, "kl_coef", 0.001)
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if ctrl_type == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=kl_coef,
            target_kl=cfg_get(kl_ctrl_config, "target_kl", 0.1),
            horizon=cfg_get(kl_ctrl_config, "horizon", 10000),
        )
    raise ValueError(f"kl_ctrl.type={ctrl_type!r} is not allowed; choose one of ['adaptive', 'fixed']")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward: ``token_level_rewards = token_level_scores - beta * KL`` (verl's ``apply_kl_penalty``).

    Args:
        token_level_scores: ``[bs, T]`` task rewards per token (usually only the last token is set).
        old_log_probs: ``[bs, T]`` actor log-probs of the sampled tokens.
        ref_log_prob: ``[bs, T]`` reference log-probs of the same tokens.
        response_mask: ``[bs, T]`` 1 on response tokens.
        kl_ctrl: controller holding ``beta`` (``value``); it is updated in place with the batch KL,
            the batch mean of the per-sequence token-mean KL, and ``n_steps = bs``.
        kl_penalty: estimator name (see ``kl_penalty``).

    Returns:
        ``(token_level_rewards [bs, T], metrics)`` with ``actor/reward_kl_penalty`` (the batch KL) and
        ``actor/reward_kl_penalty_coeff`` (the ``beta`` used, i.e. before the update).
    """
    check_same_shape(
        token_level_scores=token_level_scores,
        old_log_probs=old_log_probs,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    kld = kl_penalty_fn(old_log_probs, ref_log_prob, kl_penalty) * response_mask  # [bs, T]
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld

    current_kl = torch.mean(masked_mean(kld, response_mask, axis=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])

    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


# ``apply_kl_penalty`` has an argument called ``kl_penalty`` (verl's signature) that shadows the function.
kl_penalty_fn = kl_penalty
