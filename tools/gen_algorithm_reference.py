"""The algorithms page's reference part, from the registries of ``megatron_rl.algos`` (never by hand).

Every advantage estimator, policy loss, KL estimator, distillation loss and loss-aggregation mode, each
with its registry name (the config value that picks it), what it declares it needs, and its docstring
(where the formula lives). The docs build (``tools/gen_docs_hooks.py``) puts ``render()`` where
``docs/algorithms.md`` says ``<!-- generated: algorithms -->``.

    python tools/gen_algorithm_reference.py      # print it
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

__all__ = ["render"]


def _doc(fn) -> str:
    doc = inspect.getdoc(fn) or "(no docstring)"
    return "\n".join(line.rstrip() for line in doc.splitlines())


def _needs(traits) -> str:
    if traits is None or not dataclasses.is_dataclass(traits):
        return ""
    on = [f.name for f in dataclasses.fields(traits) if getattr(traits, f.name)]
    return f" -- needs: {', '.join(on)}" if on else ""


def _registry_section(title: str, key: str, registry, lead: str) -> list[str]:
    lines = [f"### {title}", "", lead, ""]
    for name in registry:
        try:
            traits = registry.traits_of(name)
        except Exception:  # a registry without declared traits
            traits = None
        fn = registry[name]
        lines += [
            f"#### `{name}`",
            "",
            f"`{key}: {name}` -- `{fn.__module__}.{fn.__name__}`{_needs(traits)}",
            "",
            _doc(fn),
            "",
        ]
    return lines


def render() -> str:
    """The reference sections (Markdown, ``###`` and below)."""
    from megatron_rl.algos import ADV_ESTIMATORS, POLICY_LOSSES
    from megatron_rl.algos.distillation_loss import DISTILLATION_LOSSES
    from megatron_rl.algos.kl import KL_ESTIMATORS
    from megatron_rl.algos.loss_agg import LOSS_AGG_MODES, agg_loss

    lines = _registry_section(
        f"Advantage estimators ({len(ADV_ESTIMATORS)})",
        "algorithm.adv_estimator",
        ADV_ESTIMATORS,
        "Registered with `register_adv_est(name, **needs)`; the trainer asks an entry what it needs (a critic, a "
        "greedy baseline, the reference, the reward's fields, sum pi^2), never its name.",
    )
    lines += _registry_section(
        f"Policy losses ({len(POLICY_LOSSES)})",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        POLICY_LOSSES,
        "Registered with `register_policy_loss(name)`; each takes `(old_log_prob, log_prob, advantages, "
        "response_mask, loss_agg_mode, config, rollout_is_weights)` and returns `(loss, metrics)`, as in verl.",
    )
    lines += _registry_section(
        f"KL estimators ({len(KL_ESTIMATORS)})",
        "actor_rollout_ref.actor.kl_loss_type` / `algorithm.kl_penalty",
        KL_ESTIMATORS,
        "The per-token KL between the policy and the reference, for the KL loss and the KL-in-reward penalty.",
    )
    lines += _registry_section(
        f"Distillation losses ({len(DISTILLATION_LOSSES)})",
        "distillation.distillation_loss.loss_mode",
        DISTILLATION_LOSSES,
        "On-policy distillation against `distillation.teacher_model`.",
    )
    lines += [
        f"### Loss aggregation ({len(LOSS_AGG_MODES)})",
        "",
        f"`actor_rollout_ref.actor.loss_agg_mode`: one of {', '.join(f'`{m}`' for m in LOSS_AGG_MODES)}.",
        "",
        _doc(agg_loss),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
