"""The actor's objective over typed loss inputs: policy loss, entropy bonus, KL loss, distillation.

``PolicyLossInputs`` is what one micro-batch gives the objective (prime-rl's ``LossInputs`` is the
model): the student's differentiable log-probs / entropy from the engine, and the batch's
``old_log_probs``, ``advantages``, ``ref_log_prob``, ``rollout_is_weights`` and teacher fields
(``None`` where absent). ``PolicyObjective`` holds what is fixed for an update -- the actor config,
the registered policy loss, the distillation config -- and turns inputs into ``(loss, metrics)``
the same way for every algorithm: the registry entries, not this code, differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch

from megatron_rl.algos import agg_loss
from megatron_rl.algos.distillation_loss import TopKDistillation, distillation_ppo_loss
from megatron_rl.algos.kl import kl_penalty
from megatron_rl.config import ActorConfig
from megatron_rl.engine import LossMetrics
from megatron_rl.roles.common import token_weighted

__all__ = ["PolicyLossInputs", "PolicyObjective"]


@dataclasses.dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch's tensors for the actor's loss (all ``[b, r]`` unless noted)."""

    response_mask: torch.Tensor
    """1 on response tokens."""
    log_probs: torch.Tensor
    """The student's log-probs of the responses (differentiable)."""
    entropy: Optional[torch.Tensor] = None
    """Its entropy per position (when the entropy bonus or metric is on)."""
    old_log_probs: Optional[torch.Tensor] = None
    """Behaviour-policy log-probs."""
    advantages: Optional[torch.Tensor] = None
    """Per-token advantages."""
    ref_log_prob: Optional[torch.Tensor] = None
    """Reference-policy log-probs (KL loss)."""
    rollout_is_weights: Optional[torch.Tensor] = None
    """Rollout-correction importance weights."""
    teacher_log_probs: Optional[torch.Tensor] = None
    """Distillation teacher's log-probs of the sampled tokens."""
    teacher_topk_log_probs: Optional[torch.Tensor] = None
    """``[b, r, k]`` the teacher's top-k log-probs (``forward_kl_topk``)."""
    teacher_topk_ids: Optional[torch.Tensor] = None
    """``[b, r, k]`` their token ids."""

    @classmethod
    def from_micro_batch(
        cls, mb: Mapping[str, torch.Tensor], log_probs: torch.Tensor, entropy: Optional[torch.Tensor]
    ) -> "PolicyLossInputs":
        """The inputs of micro-batch ``mb`` with the engine's ``log_probs`` / ``entropy``."""
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("response_mask", "log_probs", "entropy")]
        return cls(mb["response_mask"], log_probs, entropy, **{k: mb.get(k) for k in names})

    def as_mapping(self) -> dict[str, Optional[torch.Tensor]]:
        """The fields by name (no copies), for functions that read a batch-like mapping."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """The actor's loss for one update: task loss (policy loss - entropy bonus + KL loss) and/or
    on-policy distillation (verl's ``distillation_ppo_loss``)."""

    config: ActorConfig
    """The actor config with this step's ``global_batch_info``."""
    policy_loss_fn: Callable
    """The registered policy loss (``megatron_rl.algos.get_policy_loss_fn``)."""
    run_task: bool
    """Evaluate the task loss (always without distillation; for its metrics in policy-gradient distillation)."""
    distillation: Any = None
    """``DistillationLossConfig`` or None."""

    def task_loss(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict, dict]:
        """Policy loss - entropy bonus + KL loss: ``(loss, summed stats, ratio metrics)``."""
        cfg, mask = self.config, inputs.response_mask
        gbi = cfg.global_batch_info
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=inputs.old_log_probs,
            log_prob=inputs.log_probs,
            advantages=inputs.advantages,
            response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=cfg,
            rollout_is_weights=inputs.rollout_is_weights,
        )
        loss = pg_loss
        stats = {"actor/pg_loss": pg_loss.detach()}
        if inputs.entropy is not None:
            entropy_loss = agg_loss(inputs.entropy, mask, cfg.loss_agg_mode, **gbi)
            stats["actor/entropy"] = entropy_loss.detach()
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
        if cfg.use_kl_loss:
            kld = kl_penalty(inputs.log_probs, inputs.ref_log_prob, cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, **gbi)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss.detach()
            stats["actor/kl_coef"] = torch.tensor(cfg.kl_loss_coef)
        return loss, stats, dict(pg_metrics)

    def __call__(
        self, inputs: PolicyLossInputs, topk: Optional[Callable[[PolicyLossInputs], TopKDistillation]] = None
    ) -> tuple[torch.Tensor, LossMetrics]:
        """``(loss, metrics)`` of one micro-batch; ``topk(inputs)`` gives the ``forward_kl_topk`` terms.

        The top-k terms are computed after the task loss (a callable, not a field): the order the
        autograd graph is built in fixes the order gradients are summed in.
        """
        loss, stats, pg_metrics, extremes = None, {}, {}, {}
        if self.run_task:
            loss, stats, pg_metrics = self.task_loss(inputs)
        if self.distillation is not None:
            terms = topk(inputs) if topk is not None else None
            loss, distill_metrics, extremes = distillation_ppo_loss(
                inputs.as_mapping(),
                inputs.log_probs,
                loss,
                self.distillation,
                self.config.loss_agg_mode,
                self.config.global_batch_info,
                topk=terms,
            )
            stats["distillation/loss"] = distill_metrics.pop("distillation/loss")
            pg_metrics.update(distill_metrics)
        tokens = inputs.response_mask.sum()
        return loss, LossMetrics(
            sums={k: float(v) for k, v in stats.items()},
            weighted=token_weighted(pg_metrics, tokens),
            minima=extremes.get("min", {}),
            maxima=extremes.get("max", {}),
        )
