"""The language-model roles: ``actor`` (trainable policy), ``ref`` and ``teacher`` (frozen).

One class serves all three -- they differ only in whether their engine is trainable. Forward
methods run a head (``megatron_rl.roles.lm_head``) through ``MegatronEngine.forward``;
``update_policy`` builds ``PolicyLossInputs`` per micro-batch and runs the ``PolicyObjective``
through ``update_in_mini_batches``. Every method that takes a batch declares its fields with
``batch_fields`` (the worker group ships exactly those).

Router replay (an MoE engine built with ``routing_replay``, ``megatron.router_replay.mode`` R2 /
R3): ``compute_log_prob(routing="record")`` adds the routers' choices (``routed_experts``),
``routing="replay"`` routes by the batch's; ``update_policy`` always replays the batch's
``routed_experts`` in every micro-batch and reports ``actor/router_agreement/<source>_vs_update``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron_rl.algos import get_policy_loss_fn
from megatron_rl.algos.distillation_loss import TOPK_LOSS_MODES, resolve_distillation_config
from megatron_rl.config import ActorConfig
from megatron_rl.data.batch import batch_fields
from megatron_rl.engine import MegatronEngine, ModelOutput, StepInfo
from megatron_rl.engine.router_replay import ROUTED_EXPERTS
from megatron_rl.roles.lm_head import response_log_probs, topk_distillation_terms, topk_log_probs
from megatron_rl.roles.actor_loss import PolicyLossInputs, PolicyObjective
from megatron_rl.roles.common import check_config, require_fields, update_in_mini_batches, with_batch_info

__all__ = ["Actor"]

Batch = Mapping[str, torch.Tensor]
_SECTIONS = {
    "actor": "actor_rollout_ref.actor",
    "ref": "actor_rollout_ref.ref",
    "teacher": "distillation.teacher_model",
}
"""Where each LM role's keys live (named in token-budget errors)."""


class Actor:
    """An LM engine with the actor's methods (``ref`` / ``teacher``: the same over a frozen engine).

    Args:
        engine: an ``lm``-head ``MegatronEngine`` (trainable for the actor).
        config: the actor config (loss, batch sizes; ``ppo_micro_batch_size_per_gpu`` is also the
            default forward micro-batch).
    """

    head = "lm"
    config_type = ActorConfig

    def __init__(self, engine: MegatronEngine, config: ActorConfig):
        if engine.head != self.head:
            raise ValueError(
                f"the {engine.name!r} role needs a language-model head; its engine has head {engine.head!r}"
            )
        check_config(engine.name, config, self.config_type)
        self.engine, self.config = engine, config

    def _forward_batching(self, micro_batch_size: Optional[int]) -> dict[str, Any]:
        """How ``engine.forward`` cuts a batch: a token budget (``log_prob_use_dynamic_bsz``), else
        ``micro_batch_size`` rows (default ``ppo_micro_batch_size_per_gpu``)."""
        budget = self.config.forward_token_budget()
        if budget is None:
            return {"micro_batch_size": micro_batch_size or self.config.ppo_micro_batch_size_per_gpu}
        return {
            "max_token_len": budget,
            "budget_key": f"{_SECTIONS.get(self.engine.name, self.engine.name)}.log_prob_max_token_len_per_gpu",
        }

    # -- forward --------------------------------------------------------------------------------
    @batch_fields("input_ids", "attention_mask", "responses", optional=(ROUTED_EXPERTS,))
    def compute_log_prob(
        self,
        batch: Batch,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        micro_batch_size: Optional[int] = None,
        calculate_sum_pi_squared: bool = False,
        routing: Optional[str] = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs ``[b, r]`` (and ``entropys``; ``sum_pi_squared``, sum_v pi_v^2, when asked) of
        ``batch["responses"]``; forward only, one fused vocab-parallel pass. ``routing="record"`` adds
        ``routed_experts [b, s, layers, topk]``; ``"replay"`` routes by ``batch["routed_experts"]`` and
        adds ``router_agreement [b]``: the fraction of all router decisions (every rank) that the
        routers would have made themselves, repeated per row."""
        chunk_size = self.config.logprob_chunk_size

        def head(mb: dict, out: ModelOutput) -> dict[str, torch.Tensor]:
            lp, ent, *spsq = response_log_probs(
                out,
                mb["responses"],
                temperature=temperature,
                entropy=calculate_entropy,
                chunk_size=chunk_size,
                sum_pi_squared=calculate_sum_pi_squared,
            )
            extra = {"sum_pi_squared": spsq[0]} if spsq else {}
            return {"log_probs": lp, **extra} if ent is None else {"log_probs": lp, "entropys": ent, **extra}

        if routing == "replay":
            require_fields(batch, ROUTED_EXPERTS)
        out = self.engine.forward(batch, head, routing=routing, **self._forward_batching(micro_batch_size))
        if routing == "replay":
            n = int(batch["input_ids"].shape[0])
            out["router_agreement"] = torch.full((n,), self.engine.routing_agreement["natural"], dtype=torch.float64)
        return out

    @batch_fields("input_ids", "attention_mask", "responses", optional=(ROUTED_EXPERTS,))
    def compute_ref_log_prob(self, batch: Batch, **kwargs: Any) -> dict[str, torch.Tensor]:
        """``compute_log_prob`` of the base model: a LoRA actor with its adapters off is the reference
        policy (as in verl, no reference worker or second copy of the weights is built). Without LoRA
        this is ``compute_log_prob`` (the trainer asks a reference role then)."""
        with self.engine.adapters_disabled():
            return self.compute_log_prob(batch, **kwargs)

    @batch_fields("input_ids", "attention_mask", "responses")
    def compute_topk_log_probs(
        self, batch: Batch, *, k: int, temperature: float = 1.0, micro_batch_size: Optional[int] = None
    ) -> dict[str, torch.Tensor]:
        """The ``k`` largest log-probs of every response position and their ids (``topk_log_probs``,
        ``topk_ids``, both ``[b, r, k]``) -- a distillation teacher's side of ``forward_kl_topk``."""

        def head(mb: dict, out: ModelOutput) -> dict[str, torch.Tensor]:
            values, ids = topk_log_probs(out, k, temperature=temperature)
            return {"topk_log_probs": values.float(), "topk_ids": ids}

        return self.engine.forward(batch, head, **self._forward_batching(micro_batch_size))

    # -- update ---------------------------------------------------------------------------------
    @batch_fields(
        "input_ids",
        "attention_mask",
        "responses",
        "response_mask",
        optional=(
            "old_log_probs",
            "advantages",
            "ref_log_prob",
            "rollout_is_weights",
            "teacher_log_probs",
            "teacher_topk_log_probs",
            "teacher_topk_ids",
            ROUTED_EXPERTS,
        ),
    )
    def update_policy(
        self, batch: Batch, *, temperature: float = 1.0, distillation_loss: Any = None, routing_source: str = "old"
    ) -> dict[str, float]:
        """PPO-style update of the actor on this rank's share of the batch; returns verl's metrics.

        With ``distillation_loss`` (a ``DistillationLossConfig``, verl's ``distillation`` section or
        its ``distillation_loss`` part; a section with ``enabled=False`` is off) the loss is verl's
        ``distillation_ppo_loss``: the distillation loss from the student's log-probs and the
        batch's ``teacher_log_probs [b, r]`` -- for ``forward_kl_topk`` the teacher's
        ``teacher_topk_log_probs`` / ``teacher_topk_ids [b, r, k]`` against the student's vocab-parallel
        logits -- (back-propagated, or as advantages ``-loss`` of a
        policy loss with ``use_policy_gradient``). With ``use_task_rewards`` it is added, times
        ``distillation_loss_coef``, to the task loss (policy loss - entropy bonus + KL loss); without,
        it is the whole loss. Adds ``distillation/*`` metrics (``loss_min``/``loss_max`` reduced by
        min/max over all tokens, the others like the ``actor/*`` metrics).

        With router replay (an engine built with ``routing_replay``) every micro-batch routes by the
        batch's ``routed_experts`` (``routing_source`` names where they came from: ``old``, the
        old-log-prob pass, R2; ``rollout``, R3) and the metrics gain
        ``actor/router_agreement/<source>_vs_update`` (the fraction of the update's router decisions
        that equal the replayed ones: 1.0 unless replay failed) and ``..._vs_update_natural`` (the
        fraction the update's routers would have chosen themselves: the drift replay removed)."""
        cfg = self.config
        if self.engine.routing is not None:
            require_fields(batch, ROUTED_EXPERTS)
        dcfg = resolve_distillation_config(distillation_loss)
        # verl still evaluates the task loss for its metrics in policy-gradient distillation.
        run_task = dcfg is None or dcfg.use_task_rewards or (dcfg.use_policy_gradient and "advantages" in batch)
        if run_task:
            require_fields(batch, "old_log_probs", "advantages")
        topk = dcfg is not None and dcfg.loss_mode in TOPK_LOSS_MODES
        if dcfg is not None:
            teacher_keys = ("teacher_topk_log_probs", "teacher_topk_ids") if topk else ("teacher_log_probs",)
            require_fields(batch, *teacher_keys, *(("old_log_probs",) if dcfg.use_policy_gradient else ()))
        if cfg.use_kl_loss and run_task:
            require_fields(batch, "ref_log_prob")
        policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        need_entropy = cfg.entropy_coeff != 0 or cfg.calculate_entropy

        def loss_fn(mb: dict, out: ModelOutput, step: StepInfo):
            objective = PolicyObjective(with_batch_info(cfg, step), policy_loss_fn, run_task, dcfg)
            lp, ent = response_log_probs(
                out, mb["responses"], temperature=temperature, entropy=need_entropy, chunk_size=cfg.logprob_chunk_size
            )
            inputs = PolicyLossInputs.from_micro_batch(mb, lp, ent)
            terms = (
                (
                    lambda inp: topk_distillation_terms(
                        out,
                        inp.teacher_topk_log_probs,
                        inp.teacher_topk_ids,
                        temperature=temperature,
                        log_prob_min_clamp=dcfg.log_prob_min_clamp,
                    )
                )
                if topk
                else None
            )
            return objective(inputs, topk=terms)

        metrics = update_in_mini_batches(self.engine, batch, loss_fn, cfg, section="actor")
        for key, suffix in (("used", ""), ("natural", "_natural")):
            if f"router_agreement/{key}" in metrics:
                metrics[f"actor/router_agreement/{routing_source}_vs_update{suffix}"] = metrics.pop(
                    f"router_agreement/{key}"
                )
        return metrics
