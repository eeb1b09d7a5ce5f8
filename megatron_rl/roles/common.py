"""Pieces every role shares: the PPO-style update loop, the step's batch info, field and config checks.

``update_in_mini_batches`` follows verl's ``ppo_epochs`` / ``ppo_mini_batch_size`` / ``shuffle``
semantics: a rank's share of the step's batch is cut into local mini-batches of
``ppo_mini_batch_size * rollout_n / dp`` samples (reshuffled every epoch with a seeded generator
when ``shuffle``); each mini-batch is one ``MegatronEngine.train_step``, its micro-batches
``ppo_micro_batch_size_per_gpu`` samples or, with ``use_dynamic_bsz``, a
``ppo_max_token_len_per_gpu`` token budget. The returned metrics are
the means over all optimizer steps, with the engine's ``grad_norm`` / ``lr`` under the role's
section prefix.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

import torch

from megatron_rl.data.batch import BatchFields, check_fields
from megatron_rl.engine import LossFn, MegatronEngine, StepInfo

__all__ = ["update_in_mini_batches", "with_batch_info", "require_fields", "token_weighted", "check_config"]

_SECTIONS = {"actor": "actor_rollout_ref.actor", "critic": "critic"}


def check_config(role: str, config: Any, config_type: type) -> None:
    """TypeError unless ``config`` is a ``config_type`` (roles read typed configs by attribute)."""
    if not isinstance(config, config_type):
        raise TypeError(f"{role}: expected a {config_type.__name__}, got {type(config).__name__}")


def require_fields(batch: Mapping[str, Any], *keys: str) -> None:
    """ValueError naming the ``keys`` that ``batch`` lacks (fields a method needs only in some modes)."""
    check_fields(batch, BatchFields(keys))


def with_batch_info(config: Any, step: StepInfo) -> Any:
    """``config`` (an ``ActorConfig`` / ``CriticConfig``) with this step's ``global_batch_info``, so
    ``agg_loss`` and the policy losses normalise by the global batch (``loss_scale_factor`` too)."""
    gbi = step.global_batch_info()
    if config.loss_scale_factor is not None:
        gbi["loss_scale_factor"] = config.loss_scale_factor
    return config.replace(global_batch_info=gbi)


def token_weighted(metrics: Mapping[str, Any], tokens: torch.Tensor) -> dict[str, float]:
    """Per-micro-batch ratios times its token count, so the global value is their token-weighted mean."""
    return {k: float(v) * float(tokens) for k, v in metrics.items()}


def update_in_mini_batches(
    engine: MegatronEngine, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, config: Any, *, section: str
) -> dict[str, float]:
    """``config.ppo_epochs`` passes over ``batch`` in mini-batches, one optimizer step each.

    ``config`` is the role's ``ActorConfig`` / ``CriticConfig`` (batch sizes, epochs, shuffle);
    ``section`` (``actor`` / ``critic``) names it in errors and prefixes ``grad_norm`` / ``lr``.
    """
    engine.ensure_trainable()
    n = int(batch["input_ids"].shape[0])
    dp_size = engine.mesh.size("dp")
    mini = config.ppo_mini_batch_size * config.rollout_n
    if mini % dp_size:
        raise ValueError(
            f"{section}.ppo_mini_batch_size * rollout_n = {mini} is not divisible by the data-parallel size {dp_size}"
        )
    local_mini = min(mini // dp_size, n)
    if n % local_mini:
        raise ValueError(f"{section}: local batch of {n} samples is not a multiple of the mini-batch {local_mini}")
    budget = config.train_token_budget()
    budget_key = f"{_SECTIONS.get(section, section)}.ppo_max_token_len_per_gpu"
    history: dict[str, list[float]] = defaultdict(list)
    generator = torch.Generator().manual_seed(config.data_loader_seed)
    for _epoch in range(config.ppo_epochs):
        order = torch.randperm(n, generator=generator) if config.shuffle else torch.arange(n)
        for start in range(0, n, local_mini):
            idx = order[start : start + local_mini]
            mini_batch = {k: v[idx] for k, v in batch.items()}
            metrics = engine.train_step(
                mini_batch,
                loss_fn,
                micro_batch_size=config.ppo_micro_batch_size_per_gpu,
                max_token_len=budget,
                budget_key=budget_key,
            )
            metrics[f"{section}/grad_norm"] = metrics.pop("grad_norm")
            metrics[f"{section}/lr"] = metrics.pop("lr")
            for key, value in metrics.items():
                history[key].append(value)
    return {k: sum(v) / len(v) for k, v in history.items()}
