"""``RolloutRouter``: the driver's one handle on every rollout engine (replica) of a run.

Requests are whole prompt groups: a prompt's ``n`` samples go to one replica together (they share
its prefix cache). A batch is cut into contiguous runs of prompts, one per replica, sized so that
every replica ends with about the same outstanding tokens (prompt tokens + ``n`` x the response
budget); the replica with the fewest outstanding tokens gets the first run, so a replica still busy
with an earlier asynchronous submission gets less (``split_contiguous``). Runs are contiguous, so a
run starting at prompt ``i`` is seeded ``seed + i * n``: every prompt draws with the seed it has in a
one-replica run and the samples do not depend on the number of replicas. An agent session runs all
its turns inside the replica that got it (``AgentRunner`` on that engine), so it stays there; its
turns' seeds do not depend on the split either (``megatron_rl.rollout.agent.runner``).

Each replica's outputs come back with its own weight version (``policy_version``); a weight sync
goes to every replica (``megatron_rl.workers.weight_sync.WeightSync``) and all must acknowledge the
same version before the next generation. A replica that fails (its actor died, vLLM raised) stops
the call with ``ReplicaError`` (a ``RayError``) naming the replica, its node and GPUs (``RolloutReplica.where``).

``metrics()`` gives the last step's ``rollout/replicas``, ``rollout/replica_tokens_max_over_mean``
(load balance of generated tokens over replicas: the most loaded replica's tokens over the mean, a
replica given nothing counting 0, so one replica doing all the work reads ``replicas``) and
``rollout/replica_gen_seconds_max`` / ``_min`` (the slowest and fastest replica's generation time, as
the driver saw each one finish; replicas given work only). The figures are the last call's: with
asynchronous submissions a replica still busy with an earlier one may get nothing in this call.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

import ray
import torch

__all__ = ["RolloutRouter", "ReplicaError", "split_contiguous", "merge_outputs"]


class ReplicaError(ray.exceptions.RayError):
    """A rollout replica failed (its actor died or vLLM raised); the message names the replica, its
    nodes and GPUs. A ``RayError``, so the trainer's ``worker_failure`` stops the run with it and the
    last good checkpoint (exit 1)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def split_contiguous(costs: Sequence[float], outstanding: Sequence[float]) -> list[tuple[int, range]]:
    """``[(replica, prompt range), ...]``: contiguous runs of ``costs`` (tokens per prompt group) over
    replicas with ``outstanding`` tokens, each filled towards the common level ``(sum(costs) +
    sum(outstanding)) / replicas``; replicas in order of fewest outstanding tokens (ties: lower index)
    take the runs in prompt order; a replica already above the level gets none. A prompt joins a run
    while at least half of it fits under the level."""
    if not outstanding:
        raise ValueError("split_contiguous needs at least one replica")
    level = (sum(costs) + sum(outstanding)) / len(outstanding)
    order = sorted(range(len(outstanding)), key=lambda r: (outstanding[r], r))
    runs, start = [], 0
    for k, replica in enumerate(order):
        end, got, want = start, 0.0, level - outstanding[replica]
        if k == len(order) - 1:
            end = len(costs)
        else:
            while end < len(costs) and got + costs[end] / 2 < want:
                got += costs[end]
                end += 1
        if end > start:
            runs.append((replica, range(start, end)))
        start = end
    return runs


def merge_outputs(parts: Sequence[dict]) -> dict:
    """The replicas' output batches (in prompt order) as one: tensors concatenated on dim 0, lists joined."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.cat(values)
        elif isinstance(values[0], list):
            out[key] = [x for v in values for x in v]
        else:
            out[key] = values[0]
    return out


def _select(prompts: dict, rows: range) -> dict:
    """Rows ``rows`` of a prompt batch (tensors and per-prompt lists)."""
    return {
        k: (v[rows.start : rows.stop] if isinstance(v, (torch.Tensor, list, tuple)) else v) for k, v in prompts.items()
    }


class RolloutRouter:
    """Routes generation across ``replicas`` (``megatron_rl.workers.rollout_worker.RolloutReplica``).

    Args:
        replicas: the placement's engines, in replica order.
        response_length: the response budget per sample (``rollout.response_length``), for the cost.
    """

    def __init__(self, replicas: Sequence[Any], *, response_length: int):
        if not replicas:
            raise ValueError("RolloutRouter needs at least one replica")
        self.replicas = list(replicas)
        self.response_length = response_length
        self.outstanding = [0.0] * len(self.replicas)
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()  # the async rollouter thread and the driver both route

    @property
    def actors(self) -> list:
        """The replicas' ``RolloutWorker`` actors (weight sync, sleep / wake, stack dumps)."""
        return [r.actor for r in self.replicas]

    def __len__(self) -> int:
        return len(self.replicas)

    # -- routing ------------------------------------------------------------------------------
    def plan(self, prompts: dict, n: int) -> list[tuple[int, range]]:
        """Which replica generates which contiguous run of ``prompts`` (``split_contiguous``)."""
        mask = prompts.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            prompt_tokens = mask.sum(-1).tolist()
        else:
            prompt_tokens = [len(p) for p in prompts["input_ids"]]
        costs = [n * (int(t) + self.response_length) for t in prompt_tokens]
        return split_contiguous(costs, self.outstanding)

    def submit(
        self, method: str, prompts: dict, *, n: int, seed: Optional[int], uids: Sequence, pass_n: bool = True, **kwargs
    ) -> dict:
        """Start ``method`` (``generate`` / ``generate_tagged``) on every replica's run with ``n`` samples
        per prompt (``pass_n=False``: the worker's own, e.g. ``val_kwargs.n``; ``n`` only sizes the
        cost); returns the pending call for ``collect``."""
        with self._lock:
            return self._submit(method, prompts, n=n, seed=seed, uids=uids, pass_n=pass_n, **kwargs)

    def _submit(
        self, method: str, prompts: dict, *, n: int, seed: Optional[int], uids: Sequence, pass_n: bool, **kwargs
    ) -> dict:
        runs = self.plan(prompts, n)
        calls = []
        for replica, rows in runs:
            part = _select(prompts, rows)
            extra = dict(kwargs, n=n) if pass_n else dict(kwargs)
            if seed is not None:
                extra["seed"] = seed + rows.start * n
            cost = float(
                n
                * (
                    len(rows) * self.response_length
                    + sum(
                        int(x)
                        for x in (
                            part["attention_mask"].sum(-1).tolist()
                            if "attention_mask" in part
                            else [len(p) for p in part["input_ids"]]
                        )
                    )
                )
            )
            self.outstanding[replica] += cost
            ref = getattr(self.replicas[replica].actor, method).remote(
                part, uids=list(uids[rows.start : rows.stop]), **extra
            )
            calls.append((replica, ref, cost))
        return {"calls": calls, "start": time.time(), "method": method}

    def collect(self, pending: dict) -> dict:
        """The merged output of a ``submit`` (prompt order); records the replicas' figures for ``metrics``.
        ``ReplicaError`` naming the replica when one failed."""
        calls, start = pending["calls"], pending["start"]
        refs = [ref for _, ref, _ in calls]
        finished: dict = {}
        remaining = list(refs)
        while remaining:
            done, remaining = ray.wait(remaining, num_returns=1)
            finished[done[0]] = time.time() - start
        outs, seconds, tokens = [], [], []
        try:
            for replica, ref, cost in calls:
                try:
                    outs.append(ray.get(ref))
                except Exception as err:  # noqa: BLE001 - re-raised naming the replica
                    raise ReplicaError(
                        f"{self.replicas[replica].where()} failed while generating: "
                        f"{getattr(err, 'cause', None) or err}"
                    ) from err
                seconds.append(finished[ref])
        finally:
            with self._lock:
                for replica, _, cost in calls:
                    self.outstanding[replica] -= cost
        tagged = pending["method"] == "generate_tagged"
        batches = [o["batch"] if tagged else o for o in outs]
        for b in batches:
            mask = b.get("response_mask")
            tokens.append(float(mask.sum()) if isinstance(mask, torch.Tensor) else 0.0)
        self._record([replica for replica, _, _ in calls], tokens, seconds)
        merged = merge_outputs(batches)
        if not tagged:
            return merged
        return {
            "batch": merged,
            "policy_version": min(o["policy_version"] for o in outs),
            "replica_versions": [o["policy_version"] for o in outs],
            "start": min(o["start"] for o in outs),
            "end": max(o["end"] for o in outs),
        }

    def generate(self, prompts: dict, *, uids: Sequence, n: int = 1, seed: Optional[int] = None, **kwargs) -> dict:
        """``RolloutWorker.generate`` across the replicas (blocking); the merged rollout batch."""
        return self.collect(
            self.submit("generate", prompts, n=n, seed=seed, uids=uids, pass_n="validate" not in kwargs, **kwargs)
        )

    def run_agent_sessions(
        self, messages: list, *, uids: Sequence, n: int = 1, seed: Optional[int] = None, **kwargs
    ) -> dict:
        """``RolloutWorker.run_agent_sessions`` across the replicas: contiguous runs of prompts (each
        prompt's ``n`` sessions on one replica, where all their turns run), the run from prompt ``i``
        seeded ``seed + i * n``; ``AgentRunner`` seeds its session ``k``'s round ``r`` with that seed
        ``+ k + r * ROUND_SEED_STRIDE``, so every turn draws as in a one-replica run."""
        lengths = [
            sum(len(str(m.get("content", ""))) // 4 + 1 for m in conv) if isinstance(conv, list) else 1
            for conv in messages
        ]
        costs = [n * (t + self.response_length) for t in lengths]
        runs = split_contiguous(costs, self.outstanding)
        start, refs = time.time(), []
        for replica, rows in runs:
            extra = dict(kwargs, n=n) if "validate" not in kwargs else dict(kwargs)
            if seed is not None:
                extra["seed"] = seed + rows.start * n
            refs.append(
                (
                    replica,
                    self.replicas[replica].actor.run_agent_sessions.remote(
                        messages[rows.start : rows.stop], uids=list(uids[rows.start : rows.stop]), **extra
                    ),
                )
            )
        outs, seconds = [], []
        for replica, ref in refs:
            try:
                outs.append(ray.get(ref))
            except Exception as err:  # noqa: BLE001
                raise ReplicaError(
                    f"{self.replicas[replica].where()} failed in agent sessions: {getattr(err, 'cause', None) or err}"
                ) from err
            seconds.append(time.time() - start)
        tokens = [
            float(o["response_mask"].sum()) if isinstance(o.get("response_mask"), torch.Tensor) else 0.0 for o in outs
        ]
        self._record([replica for replica, _ in refs], tokens, seconds)
        return merge_outputs(outs)

    # -- every replica ------------------------------------------------------------------------
    def call_all(self, method: str, *args, timeout: Optional[float] = None, **kwargs) -> list:
        """``method`` on every replica; their results in replica order (``ReplicaError`` naming a failed one)."""
        refs = [getattr(r.actor, method).remote(*args, **kwargs) for r in self.replicas]
        out = []
        for replica, ref in zip(self.replicas, refs):
            try:
                out.append(ray.get(ref, timeout=timeout))
            except Exception as err:  # noqa: BLE001
                raise ReplicaError(
                    f"{replica.where()} failed in {method}: {getattr(err, 'cause', None) or err}"
                ) from err
        return out

    def sleep_refs(self, level: int) -> list:
        """``sleep(level)`` started on every replica (the phase runner waits on the refs)."""
        return [r.actor.sleep.remote(level) for r in self.replicas]

    def wake_up_refs(self, tags: Optional[list]) -> list:
        """``wake_up(tags)`` started on every replica."""
        return [r.actor.wake_up.remote(tags) for r in self.replicas]

    # -- metrics ------------------------------------------------------------------------------
    def _record(self, used: list[int], tokens: list[float], seconds: list[float]) -> None:
        """One call's figures: replica ``used[i]`` generated ``tokens[i]`` in ``seconds[i]``; a replica
        given nothing counts 0 tokens (``last_tokens``: per replica, in replica order)."""
        per_replica = [0.0] * len(self.replicas)
        for replica, count in zip(used, tokens):
            per_replica[replica] += count
        tokens = per_replica
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        self._last = {
            "rollout/replicas": float(len(self.replicas)),
            "rollout/replica_tokens_max_over_mean": (max(tokens) / mean) if mean > 0 else 1.0,
            "rollout/replica_gen_seconds_max": max(seconds) if seconds else 0.0,
            "rollout/replica_gen_seconds_min": min(seconds) if seconds else 0.0,
        }
        self.last_tokens = tokens

    def metrics(self) -> dict[str, float]:
        """The last generation's per-replica figures (see the module docstring)."""
        return dict(self._last) if self._last else {"rollout/replicas": float(len(self.replicas))}
