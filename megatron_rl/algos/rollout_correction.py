"""Rollout correction: importance weights, rejection sampling and off-policy diagnostics.

The rollout engine (vLLM/SGLang, often bf16) and the trainer (Megatron) give slightly different
probabilities to the same tokens, and asynchronous rollouts may come from an older policy. With
``log_ratio = old_log_prob - rollout_log_prob`` (``log pi_train / pi_rollout``) this module, with
the semantics and metric names of verl's ``rollout_corr_helper``:

- computes IS weights per token or per sequence (``exp`` of the summed log-ratio), truncated at
  a threshold (TIS, ``rollout_is_threshold=2.0``) or zeroed outside ``[low, high]`` (IcePop,
  ``rollout_is_threshold="0.5_2.0"``), optionally normalised to mean 1 over the batch;
- rejects tokens/sequences whose divergence estimate is out of bounds (``rollout_rs``:
  ``token_k1``, ``seq_sum_k3``, ``seq_mean_k1``, ``seq_max_k2`` ..., comma separated, all must
  pass) by zeroing them in the response mask;
- reports diagnostics: IS mean/min/max/std, effective sample size, out-of-bounds fractions,
  KL (k1, k3), perplexities and their log difference, token/sequence chi-square.

Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (``SAFETY_BOUND``). Sequence-level
quantities are computed on ``[bs]`` vectors (with token counts as weights) rather than on
broadcast ``[bs, T]`` tensors, and chi-square uses ``logsumexp``.

Two operating modes (``rollout_correction.bypass_mode``): *decoupled* (three policies; the trainer
recomputes ``old_log_probs`` and ``compute_rollout_correction_and_add_to_batch`` runs once per
batch) and *bypass* (two policies; ``old_log_probs := rollout_log_probs`` via ``apply_bypass_mode``,
and the loss calls ``compute_bypass_mode_correction`` with the current ``log_prob`` each step).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import MutableMapping
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from megatron_rl.algos.rollout_correction_core import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
    SAFETY_BOUND,
    compute_offpolicy_metrics,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    parse_rollout_is_threshold,
    parse_rollout_rs_thresholds,
    _require_valid_token,
)
from megatron_rl.algos.utils import check_same_shape
from megatron_rl.config.algorithm import RolloutCorrectionConfig
from megatron_rl.config.verl import verl_section
from megatron_rl.data.batch import Batch

__all__ = [
    "SAFETY_BOUND",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "parse_rollout_is_threshold",
    "parse_rollout_rs_thresholds",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "is_weights_of",
    "compute_rollout_correction_and_add_to_batch",
    "rollout_correction_kwargs",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_bypass_mode_correction",
    "apply_bypass_mode",
    "bypass_policy_loss_config",
]


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[str | float] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[str | float] = None,
    group: Optional[torch.distributed.ProcessGroup] = None,
) -> tuple[Optional[Batch], torch.Tensor, dict[str, float]]:
    """IS weights + rejection mask + diagnostics in one call (verl's main entry point).

    Args:
        old_log_prob: ``[bs, T]`` training-policy log-probs (``pi_old``; the current policy in bypass mode).
        rollout_log_prob: ``[bs, T]`` rollout-engine log-probs of the same tokens.
        response_mask: ``[bs, T]`` 1 on valid tokens; needs at least one.
        rollout_is / rollout_is_threshold / rollout_is_batch_normalize: see
            ``compute_rollout_correction_weights``; ``rollout_is=None`` (or a None threshold) = no weights.
        rollout_rs / rollout_rs_threshold: see ``compute_rollout_rejection_mask``; None = no rejection.
        group: process group for the batch normalisation mean.

    Returns:
        ``(weights, modified_response_mask [bs, T], metrics)`` as verl returns them: ``weights`` is a
        ``DataProto`` (``megatron_rl.data.batch.Batch``) holding ``rollout_is_weights [bs, T]``, or None
        without IS weights; every metric is prefixed ``rollout_corr/``.
    """
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    _require_valid_token(response_mask)
    log_ratio = old_log_prob.detach() - rollout_log_prob.detach()  # [bs, T] log(pi_train / pi_rollout)
    metrics: dict[str, float] = {}

    weights: Optional[torch.Tensor] = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize, group
        )
        metrics.update(is_metrics)

    modified_mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold; it is None")
        modified_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold
        )
        metrics.update(rs_metrics)

    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    proto = None if weights is None else Batch({"rollout_is_weights": weights})
    return proto, modified_mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}


def is_weights_of(proto: Optional[Batch]) -> Optional[torch.Tensor]:
    """The ``rollout_is_weights`` tensor of the first value ``compute_rollout_correction_and_rejection_mask``
    returns (None stays None)."""
    return None if proto is None else proto.batch["rollout_is_weights"]


def rollout_correction_kwargs(config: Any) -> dict[str, Any]:
    """The five correction keys of a ``rollout_correction`` config (typed, DictConfig or dict).

    Read with ``.get`` and verl's defaults so an explicit ``None`` (= disabled) is kept.
    """
    config = {} if config is None else config
    return {
        "rollout_is": config.get("rollout_is", None),
        "rollout_is_threshold": config.get("rollout_is_threshold", 2.0),
        "rollout_is_batch_normalize": config.get("rollout_is_batch_normalize", False),
        "rollout_rs": config.get("rollout_rs", None),
        "rollout_rs_threshold": config.get("rollout_rs_threshold", None),
    }


def compute_rollout_correction_and_add_to_batch(
    batch: MutableMapping[str, torch.Tensor],
    rollout_corr_config: Any,
    group: Optional[torch.distributed.ProcessGroup] = None,
) -> tuple[MutableMapping[str, torch.Tensor], dict[str, float]]:
    """Decoupled mode, once per batch: read ``old_log_probs``/``rollout_log_probs``/``response_mask``
    from ``batch`` (a dict or TensorDict), always replace ``response_mask`` by the rejection-masked
    one, and add ``rollout_is_weights`` when ``rollout_is`` is set. Returns ``(batch, metrics)``.
    """
    for key in ("old_log_probs", "rollout_log_probs", "response_mask"):
        if key not in batch.keys():
            raise ValueError(f"rollout correction needs batch[{key!r}]; the batch has {sorted(batch.keys())}")
    weights, modified_mask, metrics = compute_rollout_correction_and_rejection_mask(
        batch["old_log_probs"],
        batch["rollout_log_probs"],
        batch["response_mask"],
        group=group,
        **rollout_correction_kwargs(rollout_corr_config),
    )
    batch["response_mask"] = modified_mask
    if weights is not None:
        if isinstance(batch, Batch):
            batch = batch.union(weights)  # verl's DataProto path
        else:
            batch["rollout_is_weights"] = is_weights_of(weights)
    return batch, metrics


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Off-policy diagnostics of the *current* policy vs the rollout policy, ``rollout_corr/``-prefixed."""
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask)
    return {f"rollout_corr/{key}": value for key, value in metrics.items()}


def compute_bypass_mode_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_corr_config: Any,
    group: Optional[torch.distributed.ProcessGroup] = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """Bypass mode, inside the loss: weights/mask of the *current* policy ``pi_theta`` vs ``pi_rollout``.

    In bypass mode ``old_log_prob`` is the rollout log-prob, so the IS ratio is
    ``exp(log_prob - rollout_log_prob)``; it is computed without gradient. The loss then uses the
    mask always, and the weights only for ``loss_type="reinforce"`` (PPO-clip's ratio already is
    the IS ratio). Returns ``(weights or None, modified_response_mask, rollout_corr/ metrics)``.
    """
    if rollout_corr_config is None:
        raise ValueError("bypass mode needs policy_loss.rollout_correction; it is None")
    with torch.no_grad():
        weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
            log_prob, rollout_log_prob, response_mask, group=group, **rollout_correction_kwargs(rollout_corr_config)
        )
    return is_weights_of(weights), mask, metrics


def apply_bypass_mode(
    batch: MutableMapping[str, torch.Tensor], rollout_corr_config: Any, policy_loss_config: Any
) -> Any:
    """Set up bypass mode: ``batch["old_log_probs"] = batch["rollout_log_probs"]`` (no recompute of pi_old).

    Returns a *copy* of ``policy_loss_config`` with ``loss_mode="bypass_mode"`` and
    ``rollout_correction=rollout_corr_config`` (verl mutates the actor config in place; a copy keeps
    the caller's config unchanged). Works with a typed ``PolicyLossConfig``, a DictConfig or a dict.
    """
    if "rollout_log_probs" not in batch.keys():
        raise ValueError(
            "rollout_correction.bypass_mode=True needs batch['rollout_log_probs']; "
            "configure the rollout engine to return log-probs (calculate_log_probs=True)"
        )
    if rollout_corr_config is None:
        raise ValueError("apply_bypass_mode needs the rollout_correction config; it is None")
    batch["old_log_probs"] = batch["rollout_log_probs"]
    return bypass_policy_loss_config(policy_loss_config, rollout_corr_config)


def bypass_policy_loss_config(policy_loss_config: Any, rollout_corr_config: Any) -> Any:
    """A copy of ``policy_loss_config`` with ``loss_mode="bypass_mode"`` and ``rollout_correction``
    set (typed ``PolicyLossConfig``, DictConfig or dict alike); the config half of ``apply_bypass_mode``."""
    if dataclasses.is_dataclass(policy_loss_config):
        typed = verl_section(RolloutCorrectionConfig, rollout_corr_config)  # verl's section, or ours
        replace = getattr(policy_loss_config, "replace", None) or (
            lambda **kw: dataclasses.replace(policy_loss_config, **kw)
        )
        return replace(loss_mode="bypass_mode", rollout_correction=typed)
    if isinstance(policy_loss_config, DictConfig):
        updated = copy.deepcopy(policy_loss_config)
        with open_dict(updated):
            updated["loss_mode"] = "bypass_mode"
            updated["rollout_correction"] = (
                OmegaConf.structured(rollout_corr_config)
                if dataclasses.is_dataclass(rollout_corr_config)
                else rollout_corr_config
            )
        return updated
    return {**dict(policy_loss_config or {}), "loss_mode": "bypass_mode", "rollout_correction": rollout_corr_config}
