"""``RolloutWorker``: a ``VLLMRollout`` inside a Ray actor, and ``create_rollout_worker`` to place one.

With partial rollouts (``trainer.v1.partial_rollout``) the worker holds a
``megatron_rl.rollout.partial.PauseGate`` and is started as ``partial_worker_class()``: its weight
pushes (``update_weights``, ``weight_sync_receive``) run in a Ray concurrency group of their own
(``weights``), so a push arrives while a generation runs, pauses it between two engine steps, loads
the weights and lets it continue with them. Without partial rollouts every call runs in the
actor's one default thread, in order (a push queues behind the generations submitted before it).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

from megatron_rl.config.rollout import RolloutConfig

__all__ = ["RolloutWorker", "create_rollout_worker"]


class RolloutWorker:
    """A ``VLLMRollout`` inside a Ray actor (create with ``ray.remote(RolloutWorker)``)."""

    def __init__(self, model_path: str, config: Optional[RolloutConfig] = None, tokenizer_path: Optional[str] = None,
                 num_threads: int = 1, partial_rollout: bool = False):
        from megatron_rl.rollout.partial import PauseGate
        from megatron_rl.rollout.vllm_rollout import VLLMRollout

        self._num_threads = max(1, num_threads)
        torch.set_num_threads(self._num_threads)
        self.rollout = VLLMRollout(model_path, config, tokenizer_path=tokenizer_path)
        self._receiver = None  # RolloutWeightReceiver once a side band is joined
        self._tokenizer_path = tokenizer_path or model_path
        self._agents: dict = {}  # chat template -> AgentRunner, built on the first agent rollout
        self._version = 0  # weight updates received without a gate
        self.gate = PauseGate() if partial_rollout else None  # partial rollouts: pushes pause generations

    @property
    def policy_version(self) -> int:
        """Weight updates this engine has received (tags what ``generate_tagged`` produces)."""
        return self.gate.version if self.gate is not None else self._version

    def _push(self):
        """Context of one weight push: through the gate with partial rollouts (it pauses a running
        generation and counts the push when it succeeds), else the version counts after it."""
        if self.gate is not None:
            return self.gate.push()
        return _counted(self)

    def _engine_threads(self) -> None:
        """With partial rollouts (concurrency groups) Ray runs a call on a thread of its own, whose
        OpenMP thread count is the process default (OMP_NUM_THREADS), not the engine's: vLLM's CPU
        attention builds its metadata with the calling thread's count and refuses a kernel run with
        another ("Check failed: input->metadata->thread_num == thread_num"). Sets this thread's count
        to the engine's (torch._C.set_num_threads: vLLM's CPU worker makes torch.set_num_threads a
        no-op)."""
        if not torch.cuda.is_available():
            torch._C.set_num_threads(self._num_threads)

    def generate(self, prompts: Any, **kwargs: Any) -> dict[str, Any]:
        """``VLLMRollout.generate``: the verl-layout rollout batch (not paused: with partial rollouts a
        push waits for it)."""
        if self.gate is not None:
            self._engine_threads()
        with self.gate.hold() if self.gate is not None else contextlib.nullcontext():
            return self.rollout.generate(prompts, **kwargs)

    def generate_tagged(self, prompts: Any, **kwargs: Any) -> dict[str, Any]:
        """``generate``, tagged for the asynchronous trainer (``megatron_rl.trainer.async_loop``):
        ``{"batch": the rollout batch, "policy_version": weight updates this engine had received
        when it generated it, "start"/"end": wall-clock seconds of the call}``. Calls run one at a
        time, so without partial rollouts every token of the batch comes from that one version;
        with them a push may pause the call: the batch's ``rollout_policy_versions`` [b, R] tag each
        token and ``policy_version`` is the oldest of them (the version the call started with)."""
        import time

        start, version = time.time(), self.policy_version
        if self.gate is not None:
            self._engine_threads()
            out = self.rollout.generate(prompts, pause=self.gate, **kwargs)
            tagged = out["rollout_policy_versions"][out["response_mask"].bool()]
            version = int(tagged.min()) if tagged.numel() else version
        else:
            out = self.rollout.generate(prompts, **kwargs)
        return {"batch": out, "policy_version": version, "start": start, "end": time.time()}

    def pin_cpus(self, cpus: list) -> list:
        """Pin every thread of this process to ``cpus`` (benchmarks: rollout and trainer on their own
        cores); returns the affinity now in effect."""
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), set(cpus))
            except OSError:  # a thread that ended meanwhile
                pass
        return sorted(os.sched_getaffinity(0))

    def run_agent_sessions(self, messages: list, *, chat_template: Optional[str] = None, **kwargs: Any
                           ) -> dict[str, Any]:
        """Multi-turn agent sessions on this engine (``megatron_rl.rollout.agent.AgentRunner.run``): the
        verl-layout batch with observation tokens masked, plus the per-session fields."""
        if chat_template not in self._agents:
            from transformers import AutoTokenizer

            from megatron_rl.rollout.agent import AgentRunner

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            self._agents[chat_template] = AgentRunner(self.rollout, tokenizer, chat_template=chat_template)
        return self._agents[chat_template].run(messages, **kwargs)

    def update_weights(self, weights: list, **kwargs: Any) -> dict[str, Any]:
        """``VLLMRollout.update_weights`` from a list of HF ``(name, tensor)`` pairs (``transport``,
        ``bucket_megabytes``, ``allow_partial`` as there)."""
        if weights is None:
            raise ValueError("update_weights got None: pass the export of global rank 0")
        with self._push():
            return self.rollout.update_weights(weights, **kwargs)

    def sleep(self, level: int = 1) -> None:
        """``VLLMRollout.sleep``: release the engine's GPU memory (the phase schedule, between generations)."""
        self.rollout.sleep(level)

    def wake_up(self, tags: Optional[list] = None) -> None:
        """``VLLMRollout.wake_up``: re-allocate ``tags`` (``weights`` / ``kv_cache``; default both)."""
        self.rollout.wake_up(tags)

    def pad_token_id(self) -> int:
        return self.rollout.pad_token_id

    def tensor_parallel_size(self) -> int:
        return int(self.rollout.config.tensor_model_parallel_size)

    def weight_sync_connect(self, addr: str, port: int, world_size: int) -> list[int]:
        """Join actor rank 0's side band (``megatron_rl.workers.weight_sync.WeightSync.connect``)."""
        from megatron_rl.rollout.weight_sync import RolloutWeightReceiver

        self._receiver = RolloutWeightReceiver(self.rollout, addr, port, world_size)
        return self._receiver.connect()

    def weight_sync_receive(self) -> dict[str, Any]:
        """Receive one streamed sync (runs while the actor ranks run ``weight_sync``)."""
        if self._receiver is None:
            raise RuntimeError("weight_sync_receive before weight_sync_connect")
        with self._push():
            return self._receiver.receive()

    def weight_sync_close(self) -> None:
        """Leave the side band."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    def enable_stack_dumps(self, directory: str, name: str) -> int:
        """Dump this process's Python stacks into ``directory`` whenever the driver's hang watchdog asks
        (``megatron_rl.workers.stacks``), even while a call hangs; returns the pid."""
        from megatron_rl.workers.stacks import StackDumpListener

        self._stack_dumps = StackDumpListener(directory, name)
        return os.getpid()

    def shutdown(self) -> None:
        self.rollout.shutdown()


@contextlib.contextmanager
def _counted(worker: RolloutWorker):
    """A push without a gate: the version counts once the body succeeded."""
    yield
    worker._version += 1


def partial_worker_class() -> type:
    """``RolloutWorker`` with its weight pushes in the ``weights`` concurrency group (partial
    rollouts: a push runs while a generation does and pauses it; see the module docstring)."""
    import ray

    class PartialRolloutWorker(RolloutWorker):
        """A ``RolloutWorker`` whose pushes pause its generations (``partial_rollout=True``)."""

        @ray.method(concurrency_group="weights")
        def update_weights(self, weights: list, **kwargs: Any) -> dict[str, Any]:
            """``RolloutWorker.update_weights``, on the push thread (pauses a running generation)."""
            return super().update_weights(weights, **kwargs)

        @ray.method(concurrency_group="weights")
        def weight_sync_receive(self) -> dict[str, Any]:
            """``RolloutWorker.weight_sync_receive``, on the push thread (pauses a running generation)."""
            return super().weight_sync_receive()

        @ray.method(concurrency_group="weights")
        def pause_stats(self) -> dict[str, int]:
            """``{"version", "pauses", "steps"}`` of the gate (answers while a generation runs)."""
            return {"version": self.gate.version, "pauses": self.gate.pauses, "steps": self.gate.steps}

    return PartialRolloutWorker


def create_rollout_worker(model_path: str, config: Optional[RolloutConfig] = None, *, tokenizer_path: Optional[str] = None,
                          num_cpus: float = 1.0, num_gpus: float = 0.0, partial_rollout: bool = False):
    """Start a ``RolloutWorker`` actor in its own placement group; returns ``(actor, placement_group)``.
    ``partial_rollout``: weight pushes pause its generations (``partial_worker_class``)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    pg = placement_group([bundle], name="rollout_pg")
    ray.get(pg.ready(), timeout=600)
    remote = (ray.remote(concurrency_groups={"weights": 1})(partial_worker_class()) if partial_rollout
              else ray.remote(RolloutWorker))
    actor = remote.options(
        num_cpus=num_cpus, num_gpus=num_gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote(model_path, config, tokenizer_path, max(1, round(num_cpus)), partial_rollout)
    return actor, pg
