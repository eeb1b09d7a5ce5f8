"""On-policy distillation losses (verl's ``trainer/distillation``): the student samples, a teacher scores.

Two families, selected by ``distillation_loss.loss_mode`` in ``DISTILLATION_LOSSES``:

- ``forward_kl_topk``: ``KL(teacher || student)`` restricted to the teacher's top-k tokens per
  position, ``sum_k q_k (log q_k - log p_k)`` with ``q`` = teacher and ``p`` = student
  probabilities at the teacher's top-k ids. Needs the student's full logits, so it runs where the
  logits exist (``compute_forward_kl_topk``, the engine's logits processor) and the loss entry
  only reads its outputs. The truncated distributions do not sum to 1, so the loss is clamped at 0.
- Single-sample estimators ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``: the KL
  estimate ``kl_penalty(student_logp, teacher_logp)`` from the sampled token's log-probs only, i.e.
  a reverse-KL ``KL(student || teacher)`` estimate.

The per-token loss is then either back-propagated directly (``use_policy_gradient=False``,
aggregated with ``agg_loss``; arXiv:2306.13649) or used as a reward: ``-loss`` (detached) becomes
the per-token advantage of a policy loss (``use_policy_gradient=True``, the default; Thinking
Machines' on-policy distillation). ``k1`` cannot be back-propagated directly: its gradient does not
depend on the teacher.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from megatron_rl.algos.kl import kl_penalty
from megatron_rl.algos.loss_agg import agg_loss
from megatron_rl.algos.algo_registry import POLICY_LOSSES, Registry
from megatron_rl.algos.utils import cfg_get, check_same_shape
from megatron_rl.config.verl import verl_section
from megatron_rl.config.distillation import (
    ESTIMATOR_LOSS_MODES,
    TOPK_LOSS_MODES,
    DistillationLossConfig,
    validate_modes,
)

__all__ = [
    "DISTILLATION_LOSSES",
    "TOPK_LOSS_MODES",
    "ESTIMATOR_LOSS_MODES",
    "DistillationLossConfig",
    "DistillationInputs",
    "TopKDistillation",
    "compute_forward_kl_topk",
    "compute_distillation_loss",
    "combine_with_policy_loss",
    "topk_distillation_from_log_probs",
    "resolve_distillation_config",
    "distillation_ppo_loss",
]

DISTILLATION_LOSSES = Registry("distillation loss")
"""``distillation_loss.loss_mode`` -> ``fn(inputs: DistillationInputs, config) -> (per-token loss [bs, T], metrics)``."""


@dataclasses.dataclass
class TopKDistillation:
    """Per-token outputs of ``compute_forward_kl_topk`` (all ``[bs, T]``)."""

    distillation_losses: torch.Tensor
    """Top-k forward KL (differentiable w.r.t. the student logits)."""
    student_mass: torch.Tensor
    """Student probability mass on the teacher's top-k ids."""
    teacher_mass: torch.Tensor
    """Teacher probability mass in its top-k."""
    overlap_count: torch.Tensor
    """How many of the teacher's top-k ids are also in the student's top-k."""
    overlap_token_advantage: torch.Tensor
    """Mean of ``-q_k (log q_k - log p_k)`` over the overlapping ids (0 without overlap)."""
    topk: int
    """k."""


@dataclasses.dataclass
class DistillationInputs:
    """What every ``DISTILLATION_LOSSES`` entry receives (padded ``[bs, T]`` response layout)."""

    response_mask: torch.Tensor
    """``[bs, T]`` 1 on response tokens."""
    student_log_probs: Optional[torch.Tensor] = None
    """``[bs, T]`` student log-probs of the sampled tokens (estimators; policy-gradient mode)."""
    teacher_log_probs: Optional[torch.Tensor] = None
    """``[bs, T]`` teacher log-probs of the sampled tokens (estimators)."""
    topk: Optional[TopKDistillation] = None
    """Outputs of ``compute_forward_kl_topk`` (``forward_kl_topk``)."""
    old_log_probs: Optional[torch.Tensor] = None
    """``[bs, T]`` behaviour-policy log-probs (policy-gradient mode)."""
    rollout_is_weights: Optional[torch.Tensor] = None
    """``[bs, T]`` rollout-correction IS weights (policy-gradient mode)."""


def _topk_log_probs_chunked(logits: torch.Tensor, ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``log_softmax(logits).gather(ids)`` as ``logits.gather(ids) - logsumexp(logits)`` in float32
    chunks of tokens, so no ``[tokens, vocab]`` log-softmax is materialised."""
    vocab, k = logits.shape[-1], ids.shape[-1]
    flat_logits, flat_ids = logits.reshape(-1, vocab), ids.reshape(-1, k)
    chunks = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        chunk = flat_logits[start : start + chunk_size].float()
        log_z = torch.logsumexp(chunk, dim=-1, keepdim=True)
        chunks.append((torch.gather(chunk, -1, flat_ids[start : start + chunk_size]) - log_z).to(logits.dtype))
    if not chunks:
        return logits.new_empty(ids.shape)
    return torch.cat(chunks).reshape(ids.shape)


def compute_forward_kl_topk(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    log_prob_min_clamp: Optional[float] = -10.0,
    chunk_size: Optional[int] = None,
) -> TopKDistillation:
    """Top-k forward KL ``sum_k q_k (log q_k - log p_k)`` over the teacher's top-k ids (single rank).

    Args:
        student_logits: ``[bs, T, V]`` student logits (the full vocabulary; a vocab-parallel
            version belongs with the other TP ops in ``parallel/``).
        teacher_topk_log_probs: ``[bs, T, K]`` teacher log-probs of its top-k tokens.
        teacher_topk_ids: ``[bs, T, K]`` their token ids.
        log_prob_min_clamp: floor for both sides' top-k log-probs (the student's gradient is 0
            where it binds); None = no floor.
        chunk_size: None = ``log_softmax`` over the vocabulary (verl's default path); an int =
            float32 ``logsumexp`` over chunks of that many tokens (verl's ``use_chunked_topk``).

    Returns:
        ``TopKDistillation`` with ``[bs, T]`` loss, masses and overlap diagnostics (arXiv:2604.13016).
    """
    if (
        teacher_topk_log_probs.shape != teacher_topk_ids.shape
        or student_logits.shape[:-1] != teacher_topk_ids.shape[:-1]
    ):
        raise ValueError(
            f"shape mismatch: student_logits{list(student_logits.shape)} must be [bs, T, V] and "
            f"teacher_topk_log_probs{list(teacher_topk_log_probs.shape)}, teacher_topk_ids"
            f"{list(teacher_topk_ids.shape)} both [bs, T, K]"
        )
    k = teacher_topk_ids.shape[-1]
    if chunk_size is None:
        student_log_probs = F.log_softmax(student_logits, dim=-1)
        student_topk_ids = torch.topk(student_log_probs, k=k, dim=-1).indices
        student_topk_log_probs = torch.gather(student_log_probs, dim=-1, index=teacher_topk_ids)
    else:
        # log_softmax is monotonic: the student's top-k of logits and of log-probs agree.
        student_topk_ids = torch.topk(student_logits, k=k, dim=-1).indices
        student_topk_log_probs = _topk_log_probs_chunked(student_logits, teacher_topk_ids, chunk_size)
    return topk_distillation_from_log_probs(
        student_topk_log_probs, student_topk_ids, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp
    )


def topk_distillation_from_log_probs(
    student_topk_log_probs: torch.Tensor,
    student_topk_ids: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    log_prob_min_clamp: Optional[float] = -10.0,
) -> TopKDistillation:
    """The top-k forward KL from log-probs already gathered (all ``[bs, T, K]``): the student's
    log-probs *at the teacher's top-k ids* (differentiable), the student's own top-k ids, and the
    teacher's top-k log-probs / ids. ``compute_forward_kl_topk`` on full logits and the Megatron
    engine on vocab-parallel logits (``parallel.vocab_parallel_topk``) share this math."""
    k = teacher_topk_ids.shape[-1]
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(log_prob_min_clamp)
    # At least float32 for the KL sum (bf16 logits); verl's .float() would also demote float64.
    kl_dtype = torch.promote_types(student_topk_log_probs.dtype, torch.float32)
    teacher_lp, student_lp = teacher_topk_log_probs.to(kl_dtype), student_topk_log_probs.to(kl_dtype)
    losses = (teacher_lp.exp() * (teacher_lp - student_lp)).sum(dim=-1)

    overlap = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)  # [bs, T, K]
    overlap_count = overlap.sum(dim=-1)
    token_kl = teacher_topk_log_probs.exp() * (teacher_topk_log_probs - student_topk_log_probs)
    overlap_advantage = (-token_kl * overlap).sum(dim=-1) / overlap_count.clamp_min(1)
    overlap_advantage = torch.where(overlap_count > 0, overlap_advantage, torch.zeros_like(overlap_advantage))
    return TopKDistillation(losses, student_mass, teacher_mass, overlap_count, overlap_advantage, k)


@DISTILLATION_LOSSES.register("forward_kl_topk")
def forward_kl_topk_loss(inputs: DistillationInputs, config: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token top-k forward KL from precomputed ``inputs.topk``, clamped at 0, plus mass/overlap metrics."""
    topk = inputs.topk
    if topk is None:
        raise ValueError("loss_mode='forward_kl_topk' needs inputs.topk (the output of compute_forward_kl_topk)")
    mask = inputs.response_mask.bool()
    check_same_shape(distillation_losses=topk.distillation_losses, response_mask=inputs.response_mask)
    student_mass, teacher_mass = topk.student_mass[mask], topk.teacher_mass[mask]
    metrics = {
        "distillation/student_mass": student_mass.mean().item(),
        "distillation/student_mass_min": student_mass.min().item(),
        "distillation/student_mass_max": student_mass.max().item(),
        "distillation/teacher_mass": teacher_mass.mean().item(),
        "distillation/teacher_mass_min": teacher_mass.min().item(),
        "distillation/teacher_mass_max": teacher_mass.max().item(),
        "distillation/overlap_ratio": (topk.overlap_count[mask].float().mean() / topk.topk).item(),
    }
    overlapping = mask & (topk.overlap_count > 0)
    metrics["distillation/overlap_token_advantage"] = (
        topk.overlap_token_advantage[overlapping].mean().item() if overlapping.any() else 0.0
    )
    # Truncated distributions do not sum to 1, so the "KL" can dip below 0.
    return topk.distillation_losses.clamp_min(0.0), metrics


def _estimator_loss(inputs: DistillationInputs, config: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Single-sample KL estimate ``kl_penalty(student, teacher, loss_mode)`` per token."""
    if inputs.student_log_probs is None or inputs.teacher_log_probs is None:
        raise ValueError("single-sample distillation losses need inputs.student_log_probs and inputs.teacher_log_probs")
    check_same_shape(
        student_log_probs=inputs.student_log_probs,
        teacher_log_probs=inputs.teacher_log_probs,
        response_mask=inputs.response_mask,
    )
    losses = kl_penalty(inputs.student_log_probs, inputs.teacher_log_probs, cfg_get(config, "loss_mode", "k3"))
    # k1 can be negative: report the mean absolute loss.
    abs_loss = losses.detach()[inputs.response_mask.bool()].abs().mean().item()
    return losses, {"distillation/abs_loss": abs_loss}


for _name in ESTIMATOR_LOSS_MODES:
    DISTILLATION_LOSSES.register(_name)(_estimator_loss)


def compute_distillation_loss(
    inputs: DistillationInputs,
    config: Any,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Optional[dict] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar distillation loss and its metrics (verl's ``distillation_loss``).

    Args:
        inputs: tensors for the selected loss (see ``DistillationInputs``).
        config: ``distillation_loss`` settings (``DistillationLossConfig``, DictConfig or dict).
        loss_agg_mode: the actor's aggregation mode.
        global_batch_info: ``dp_size``/``batch_num_tokens``/``global_batch_size``/``loss_scale_factor``
            of the global batch (see ``megatron_rl.algos.loss_agg.global_batch_info``).

    Returns:
        ``(loss, metrics)``: metrics have ``distillation/loss_min``/``loss_max`` (before the clamp),
        the loss entry's own metrics and, in policy-gradient mode, the policy loss's ``actor/x``
        metrics renamed ``distillation/x``.
    """
    loss_mode = cfg_get(config, "loss_mode", "k3")
    use_policy_gradient = cfg_get(config, "use_policy_gradient", True)
    validate_modes(loss_mode, use_policy_gradient)
    losses, metrics = DISTILLATION_LOSSES[loss_mode](inputs, config)
    valid = losses.detach()[inputs.response_mask.bool()]
    metrics["distillation/loss_min"] = valid.min().item()
    metrics["distillation/loss_max"] = valid.max().item()
    max_clamp = cfg_get(config, "loss_max_clamp", None)
    if max_clamp is not None:
        losses = losses.clamp(min=-max_clamp, max=max_clamp)  # the lower side is for k1
    batch_info = dict(global_batch_info or {})

    if not use_policy_gradient:
        return agg_loss(losses, inputs.response_mask, loss_agg_mode, **batch_info), metrics

    if inputs.old_log_probs is None or inputs.student_log_probs is None:
        raise ValueError("use_policy_gradient=True needs inputs.old_log_probs and inputs.student_log_probs")
    policy_loss_fn = POLICY_LOSSES[cfg_get(config, "policy_loss_mode", "vanilla")]
    clip_ratio = cfg_get(config, "clip_ratio", 0.2)
    pg_config = {
        "clip_ratio": clip_ratio,
        "clip_ratio_low": cfg_get(config, "clip_ratio_low", clip_ratio),
        "clip_ratio_high": cfg_get(config, "clip_ratio_high", clip_ratio),
        "global_batch_info": batch_info,
    }
    loss, pg_metrics = policy_loss_fn(
        old_log_prob=inputs.old_log_probs,
        log_prob=inputs.student_log_probs,
        advantages=-losses.detach(),  # the distillation loss as a per-token negative reward
        response_mask=inputs.response_mask,
        loss_agg_mode=loss_agg_mode,
        config=pg_config,
        rollout_is_weights=inputs.rollout_is_weights,
    )
    metrics.update({f"distillation/{key.removeprefix('actor/')}": value for key, value in pg_metrics.items()})
    return loss, metrics


def combine_with_policy_loss(
    distillation_loss: torch.Tensor,
    distillation_metrics: dict[str, float],
    config: Any,
    policy_loss: Optional[torch.Tensor] = None,
    policy_metrics: Optional[dict[str, float]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's total loss (verl's ``distillation_ppo_loss``).

    With ``use_task_rewards``: ``policy_loss + distillation_loss_coef * distillation_loss`` (the task
    policy loss is required). Without: the distillation loss alone; a given ``policy_loss`` only
    contributes its metrics. Adds ``distillation/loss``.
    """
    metrics = dict(policy_metrics or {})
    metrics.update(distillation_metrics)
    metrics["distillation/loss"] = distillation_loss.detach().item()
    if not cfg_get(config, "use_task_rewards", True):
        return distillation_loss * 1.0, metrics
    if policy_loss is None:
        raise ValueError("distillation_loss.use_task_rewards=True needs the task policy_loss; it is None")
    return policy_loss + distillation_loss * cfg_get(config, "distillation_loss_coef", 1.0), metrics


def resolve_distillation_config(config: Any):
    """``DistillationLossConfig`` from verl's ``distillation`` section, its ``distillation_loss``
    part (typed, DictConfig or dict) or None; None when off."""
    if config is None:
        return None
    section = cfg_get(config, "distillation_loss", None)
    if section is not None:  # the whole ``distillation`` section
        if not cfg_get(config, "enabled", True):
            return None
        config = section
    return verl_section(DistillationLossConfig, config)  # verl's section or ours; validates loss_mode


def distillation_ppo_loss(
    mb: Mapping[str, torch.Tensor],
    lp: torch.Tensor,
    task_loss: Optional[torch.Tensor],
    dcfg: Any,
    loss_agg_mode: str,
    gbi: dict,
    topk: Optional[TopKDistillation] = None,
) -> tuple[torch.Tensor, dict, dict]:
    """verl's ``distillation_ppo_loss`` for one micro-batch of the engine: ``(total loss, metrics,
    {"min"|"max": metrics})``. ``mb`` holds ``response_mask``, ``teacher_log_probs`` and (policy-gradient
    mode) ``old_log_probs`` / ``rollout_is_weights``; ``lp`` the student's log-probs; ``topk`` the
    ``forward_kl_topk`` terms (``topk_distillation_from_log_probs``).

    ``task_loss`` is the policy (+ entropy + KL) loss, or None where it was not computed.
    """
    mask = mb["response_mask"]
    if mask.any():
        inputs = DistillationInputs(
            response_mask=mask,
            student_log_probs=lp,
            teacher_log_probs=mb.get("teacher_log_probs"),
            topk=topk,
            old_log_probs=mb.get("old_log_probs"),
            rollout_is_weights=mb.get("rollout_is_weights"),
        )
        distill, metrics = compute_distillation_loss(inputs, dcfg, loss_agg_mode, gbi)
    else:  # no response token: every aggregation of this micro-batch is 0 (and min/max are undefined)
        distill, metrics = lp.sum() * 0.0, {}
    extremes = {"min": {}, "max": {}}
    for kind in ("min", "max"):
        key = f"distillation/loss_{kind}"
        if key in metrics:
            extremes[kind][key] = metrics.pop(key)
    total, metrics = combine_with_policy_loss(distill, metrics, dcfg, policy_loss=task_loss)
    return total, metrics, extremes
