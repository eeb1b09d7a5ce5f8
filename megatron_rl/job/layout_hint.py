"""The nearest valid layout, named when a configuration's parallel layout is refused.

A layout that does not fit the memory gets the planner's nearest fitting layout; one that is
invalid (TP that does not divide the world size, a micro-batch the mini-batch cannot be split
into, ...) is refused while the config is built. ``with_layout_hint(raw)`` adds to such a refusal
the valid layout closest to the one asked for -- fewest doublings/halvings of TP, PP, EP and the
micro-batch of the refused section -- that also fits the planner's memory estimate.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import re
import warnings
from typing import Any, Callable, Iterator, Optional

__all__ = ["with_layout_hint", "nearest_valid_layout"]

_SECTION = re.compile(
    r"\b(actor_rollout_ref\.actor|actor_rollout_ref\.ref|critic|reward\.reward_model|"
    r"distillation\.teacher_model)\.megatron\b"
)
_LAYOUT_WORDS = ("parallel_size", "divisible", "micro_batch", "world_size")
_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "ep": "expert_model_parallel_size"}
_MICRO = {"actor_rollout_ref.actor": "ppo_micro_batch_size_per_gpu", "critic": "ppo_micro_batch_size_per_gpu"}


def _get(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part, {}) if isinstance(data, dict) else {}
    return data


def _section_of(message: str) -> str:
    match = _SECTION.search(message)
    if match:
        return match.group(1)
    return "critic" if message.startswith("critic") else "actor_rollout_ref.actor"


_ROLES = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.ref": "ref",
    "critic": "critic",
    "reward.reward_model": "reward",
    "distillation.teacher_model": "teacher",
}
"""A refused section -> the planner's name of its role (``Plan.role_models``)."""


def _built(raw: dict, suggest: bool = False):
    """``(config, plan)`` of ``raw`` when it builds and its roles check (``plan.fits`` says if it fits), else None."""
    from megatron_rl.algos.needs import resolve_run
    from megatron_rl.config import RunConfig
    from megatron_rl.planner import plan_run

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = RunConfig.from_dict(raw, warn=False)  # warnings are not shown here
            resolve_run(config)
            return config, plan_run(config, suggest=suggest)
    except (ValueError, KeyError, TypeError):
        return None


def _planned(raw: dict, suggest: bool = False):
    """The plan of ``raw`` when it builds and its roles check (``plan.fits`` says if it fits), else None."""
    built = _built(raw, suggest)
    return None if built is None else built[1]


def _model_refuses(config, plan, section: str) -> Optional[Callable[[dict], bool]]:
    """From one planned variant of the config: a test, cheap beside building the config, for candidate
    layouts (``tp``, ``pp``, ``ep``; VPP dropped) of ``section`` that ``plan_run`` is sure to refuse:
    ``ParallelConfig.validate`` of the layout against the section's model on the plan's world (a subset
    of the checks the planner makes of every role it evaluates, so the search's answers do not change).
    None when the planner does not evaluate the section's role."""
    from parallel.config import uneven_pipeline_fields

    model = plan.role_models.get(_ROLES.get(section, ""))
    if model is None:
        return None
    megatron = config
    for part in f"{section}.megatron".split("."):
        megatron = getattr(megatron, part)
    base, world = megatron.parallel(), plan.nodes * plan.gpus_per_node
    dims = dict(
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        num_experts=model.num_moe_experts,
        **uneven_pipeline_fields(megatron.override_transformer_config),
    )

    def refuses(cand: dict) -> bool:
        try:
            dataclasses.replace(
                base, virtual_pipeline_model_parallel_size=None, **{name: cand[k] for k, name in _KEYS.items()}
            ).validate(world, **dims)
        except ValueError:
            return True
        return False

    return refuses


def _peak(plan) -> str:
    return f"peak {plan.peak_bytes / 2**30:.1f} GiB in '{plan.peak_phase}'"


def nearest_valid_layout(raw: dict, section: str = "actor_rollout_ref.actor") -> Optional[str]:
    """``key=value`` overrides of the valid, fitting layout of ``section`` nearest to ``raw``'s; where valid
    layouts exist but none fits, the one with the lowest peak, said not to fit; None where none is valid."""
    megatron = _get(raw, f"{section}.megatron") or {}
    trainer = raw.get("trainer", {})
    world = int(trainer.get("nnodes", 1)) * int(trainer.get("n_gpus_per_node", 8))
    micro_key = _MICRO.get(section)
    current = {k: int(megatron.get(name) or 1) for k, name in _KEYS.items()}
    if micro_key:
        current["micro"] = int(_get(raw, f"{section}.{micro_key}") or 1)
    pow2 = [2**i for i in range(0, 8)]
    options = {
        "tp": [t for t in pow2 if t <= world],
        "pp": [p for p in pow2 if p <= world],
        "ep": [e for e in pow2 if e <= world],
    }
    if micro_key:
        options["micro"] = sorted({m for m in pow2 + [current["micro"]] if m <= max(current["micro"], 1)})
    names = list(options)
    candidates = []
    for values in itertools.product(*(options[k] for k in names)):
        cand = dict(zip(names, values))
        distance = sum(abs(math.log2(cand[k] / max(current[k], 1))) for k in names)
        if distance > 0:
            candidates.append((distance, cand))
    lowest = None  # (peak bytes, changes, plan) of the valid layout with the lowest peak
    refuses = None  # known once one candidate plans: skips those the planner's layout check refuses
    for _, cand in sorted(candidates, key=lambda c: c[0])[:200]:
        if refuses is not None and refuses(cand):
            continue
        trial = copy.deepcopy(raw)
        node = trial
        for part in f"{section}.megatron".split("."):
            node = node.setdefault(part, {})
        for k, name in _KEYS.items():
            node[name] = cand[k]
        node.pop("virtual_pipeline_model_parallel_size", None)
        if micro_key:
            _get(trial, section)[micro_key] = cand["micro"]
        built = _built(trial)
        if built is None:
            continue
        plan = built[1]
        if refuses is None:
            refuses = _model_refuses(*built, section) or (lambda cand: False)
        changes = [f"{section}.megatron.{name}={cand[k]}" for k, name in _KEYS.items() if cand[k] != current[k]]
        if micro_key and cand["micro"] != current["micro"]:
            changes.append(f"{section}.{micro_key}={cand['micro']}")
        if plan.fits:
            return " ".join(changes) + f" ({_peak(plan)})"
        if lowest is None or plan.peak_bytes < lowest[0]:
            lowest = (plan.peak_bytes, changes, trial)
    if lowest is None:
        return None
    _, changes, trial = lowest
    plan = _planned(trial, suggest=True)  # the planner's own offload suggestion, where offload fits it
    remedy = plan.suggestion if plan.suggestion else "more nodes"
    return (
        f"none of the valid layouts fits {world} GPUs of {plan.memory_budget_bytes / 2**30:.0f} GiB; the one "
        f"with the lowest peak is {' '.join(changes) or 'the layout asked for'} ({_peak(plan)}); {remedy}"
    )


@contextlib.contextmanager
def with_layout_hint(raw: dict) -> Iterator[None]:
    """Re-raise a layout ``ValueError`` of the block with the nearest valid layout appended."""
    try:
        yield
    except ValueError as err:
        message = str(err)
        if (
            not any(word in message for word in _LAYOUT_WORDS)
            or "Nearest layout" in message
            or "No layout" in message
            or "nearest valid layout" in message
        ):
            raise
        hint = nearest_valid_layout(raw, _section_of(message))
        if hint is None:
            raise
        raise ValueError(f"{message}; nearest valid layout: {hint}") from None
