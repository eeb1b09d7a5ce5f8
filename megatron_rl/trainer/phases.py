"""``PhaseRunner``: the trainer's executor of the colocated ``StepSchedule`` (``trainer.schedule``).

``enter(phase, metrics)`` performs the transitions ``StepSchedule.transitions`` lists between the
devices' current state and the phase -- offload / onload of role parts on every rank of the role's
worker group (``MegatronWorker.offload`` / ``onload``), ``sleep`` / ``wake_up`` of the rollout
engine -- then logs, for every role, the bytes it keeps on its compute device
(``memory/<role>/resident_gb@<phase>``, the maximum over its ranks). Phases must come in the
schedule's order (``gen`` starts a new cycle; phases a step skips, such as the actor update during
``trainer.critic_warmup``, may be left out). ``memory_metrics()`` adds verl's
``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb`` and ``perf/cpu_memory_used_gb``.

``stage(name, timing, metrics)`` is one stage of the step under one name: timed as ``timing_s/<name>``,
watched by the hang watchdog as ``<name>``, and -- where the schedule has a phase of that name -- entered
first (a stage without one, ``adv``, or the LoRA reference that runs on the actor, is timed only).

Without worker groups (``dry=True``) the runner only records: ``history`` (phases entered),
``actions`` (the transitions) and ``state`` (what is on the devices after applying them), which
is how the tests compare the run's phases with the planner's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from megatron_rl.trainer.schedule import StepSchedule, Transition
from megatron_rl.trainer.watchdog import phase as watched

__all__ = ["PhaseRunner"]

GB = 1024**3


class PhaseRunner:
    """Executes (or, ``dry``, records) a ``StepSchedule``'s transitions between phases."""

    def __init__(
        self, schedule: StepSchedule, groups: Optional[dict[str, Any]] = None, rollout: Any = None, *, dry: bool = False
    ):
        self.schedule, self.groups, self.rollout, self.dry = schedule, dict(groups or {}), rollout, dry
        self.state = schedule.initial()
        self.history: list[str] = []
        self.actions: list[tuple[str, Transition]] = []
        self._resident: dict[str, float] = {}  # role -> bytes its fullest rank keeps on device, as last read

    @contextlib.contextmanager
    def stage(self, name: str, timing: dict[str, float], metrics: Optional[dict] = None) -> Iterator[None]:
        """The stage ``name`` of the step: timed into ``timing[name]`` and named to the hang watchdog (the
        moves into its phase included), the devices moved into the phase ``name`` when the schedule has one."""
        with watched(name, timing):
            if name in self.schedule.names:
                self.enter(name, metrics)
            yield

    def enter(self, name: str, metrics: Optional[dict] = None) -> None:
        """Move the devices into phase ``name``; with ``metrics``, log every role's resident bytes."""
        names = self.schedule.names
        if name not in names:
            raise KeyError(f"no phase {name!r} in this step; phases: {names}")
        if self.history and name != "gen" and names.index(name) <= names.index(self.history[-1]):
            raise RuntimeError(f"phase {name!r} entered after {self.history[-1]!r}: the schedule is {names}")
        for transition in self.schedule.transitions(self.state, name):
            self._apply(transition)
            self.actions.append((name, transition))
            have = set(self.state[transition.target])
            have = (
                have - set(transition.parts)
                if transition.action in ("offload", "sleep")
                else have | set(transition.parts)
            )
            self.state[transition.target] = tuple(sorted(have))
        self.history.append(name)
        if metrics is not None and not self.dry:
            metrics.update(self.resident_metrics(name))

    def restore(self) -> None:
        """Bring every role's parts back on device and wake the rollout (end of training: exports,
        checkpoints and callers after ``fit`` see the models whole)."""
        initial = self.schedule.initial()
        for target, parts in initial.items():
            missing = tuple(p for p in parts if p not in self.state.get(target, ()))
            if missing:
                self._apply(Transition(target, "wake_up" if target == "rollout" else "onload", missing))
        self.state = initial
        self.history.append("restore")

    def _apply(self, t: Transition) -> None:
        if self.dry:
            return
        import ray

        if t.target == "rollout":
            if self.rollout is None:
                return
            if hasattr(self.rollout, "sleep_refs"):  # a RolloutRouter: every replica
                calls = (
                    self.rollout.sleep_refs(self.schedule.sleep_level)
                    if t.action == "sleep"
                    else self.rollout.wake_up_refs(list(t.parts))
                )
            else:
                calls = [
                    self.rollout.sleep.remote(self.schedule.sleep_level)
                    if t.action == "sleep"
                    else self.rollout.wake_up.remote(list(t.parts))
                ]
            ray.get(calls)
            return
        group = self.groups.get(t.target)
        if group is None:
            return
        ray.get([getattr(w, t.action).remote(list(t.parts)) for w in group.workers])
        self._resident.pop(t.target, None)  # moved: read it again

    def _stats(self, roles: Optional[list[str]] = None) -> dict[str, list[dict]]:
        import ray

        stats = {
            role: ray.get([w.memory_stats.remote() for w in self.groups[role].workers])
            for role in (self.groups if roles is None else roles)
        }
        for role, per_rank in stats.items():
            self._resident[role] = max(sum(s["resident"].values()) for s in per_rank)
        return stats

    def resident_metrics(self, phase: str) -> dict[str, float]:
        """``memory/<role>/resident_gb@<phase>``: the most a rank of each role keeps on its device.

        Only roles moved since their last reading (or never read) are asked again: a role nothing
        moved keeps what it had at the last reading (``memory_metrics`` reads every role at the
        end of each step), so a phase without moves makes no worker call before its own work --
        a hung worker is then found in the phase's call, where the watchdog names it."""
        stale = [role for role in self.groups if role not in self._resident]
        if stale:
            self._stats(stale)
        return {f"memory/{role}/resident_gb@{phase}": self._resident[role] / GB for role in self.groups}

    def memory_metrics(self) -> dict[str, float]:
        """verl's ``perf/max_memory_allocated_gb`` / ``perf/max_memory_reserved_gb`` (the largest over all
        ranks; on CPU the peak RSS of a rank, the compute device being the host) and ``perf/cpu_memory_used_gb``."""
        if self.dry or not self.groups:
            return {}
        stats = [s for per_role in self._stats().values() for s in per_role]
        return {
            "perf/max_memory_allocated_gb": max(s["max_allocated"] for s in stats) / GB,
            "perf/max_memory_reserved_gb": max(s["max_reserved"] for s in stats) / GB,
            "perf/cpu_memory_used_gb": max(s["cpu_used"] for s in stats) / GB,
        }
