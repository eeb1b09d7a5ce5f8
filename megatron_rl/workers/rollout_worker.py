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
import dataclasses
import os
from typing import Any, Optional

import torch

from megatron_rl.config.rollout import RolloutConfig

__all__ = ["RolloutWorker", "RolloutReplica", "create_rollout_worker", "create_rollout_replicas", "HeadlessEngineNode"]


class RolloutWorker:
    """A ``VLLMRollout`` inside a Ray actor (create with ``ray.remote(RolloutWorker)``)."""

    def __init__(
        self,
        model_path: str,
        config: Optional[RolloutConfig] = None,
        tokenizer_path: Optional[str] = None,
        num_threads: int = 1,
        partial_rollout: bool = False,
        multi_node: Optional[dict] = None,
    ):
        from megatron_rl.rollout.partial import PauseGate
        from megatron_rl.rollout.vllm_rollout import VLLMRollout

        self._num_threads = max(1, num_threads)
        torch.set_num_threads(self._num_threads)
        try:  # vLLM's reason, with where the engine was to run (the driver adds the replica)
            self.rollout = VLLMRollout(
                model_path, config, tokenizer_path=tokenizer_path, **({"multi_node": multi_node} if multi_node else {})
            )
        except Exception as err:
            raise RuntimeError(
                f"vLLM engine failed to start on node {_node_ip()} with CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}: {type(err).__name__}: {err}"
            ) from err
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

    def run_agent_sessions(
        self, messages: list, *, chat_template: Optional[str] = None, **kwargs: Any
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

    def load_lora_adapter_parts(self, parts: tuple) -> dict[str, Any]:
        """Adapter-only weight sync (``lora.merge: false``): ``VLLMRollout.load_lora_tensors`` of actor
        rank 0's ``(tensors, shared, peft_config)`` (``WeightSyncRank.export_lora_adapter_parts``)."""
        if parts is None:
            raise ValueError("load_lora_adapter_parts got None: pass the adapter of global rank 0")
        with self._push():
            return self.rollout.load_lora_tensors(*parts)

    def sleep(self, level: int = 1) -> None:
        """``VLLMRollout.sleep``: release the engine's GPU memory (the phase schedule, between generations)."""
        self.rollout.sleep(level)

    def wake_up(self, tags: Optional[list] = None) -> None:
        """``VLLMRollout.wake_up``: re-allocate ``tags`` (``weights`` / ``kv_cache``; default both)."""
        self.rollout.wake_up(tags)

    def pad_token_id(self) -> int:
        return self.rollout.pad_token_id

    def num_engine_workers(self) -> int:
        """The engine's vLLM workers (``VLLMRollout.num_workers``: TP x PP), its ranks in a weight-sync side band."""
        return self.rollout.num_workers

    def weight_sync_connect(self, addr: str, port: int, world_size: int, rank_offset: int = 1) -> list[int]:
        """Join actor rank 0's side band (``megatron_rl.workers.weight_sync.WeightSync.connect``) with this
        engine's workers at ranks ``rank_offset ...`` (the replicas before it hold the ranks below)."""
        from megatron_rl.rollout.weight_stream import RolloutWeightReceiver

        self._receiver = RolloutWeightReceiver(self.rollout, addr, port, world_size, rank_offset=rank_offset)
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


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return "127.0.0.1"


class HeadlessEngineNode:
    """The part of a multi-node vLLM engine on one of its other nodes: vLLM's headless multiproc
    executor (what ``vllm serve --headless --node-rank k`` runs), whose workers join the head's
    torch.distributed group and serve its ``collective_rpc`` calls (weight sync included). Its
    ``CUDA_VISIBLE_DEVICES`` is set by the placement (the node's GPUs of the engine). GPU only."""

    def __init__(self, model_path: str, config: RolloutConfig, multi_node: dict):
        import threading

        from megatron_rl.rollout.vllm_rollout import headless_engine_config

        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        self._executor = MultiprocExecutor(
            headless_engine_config(model_path, config, multi_node), monitor_workers=False
        )
        self._thread = threading.Thread(
            target=self._executor.start_worker_monitor, kwargs={"inline": True}, daemon=True
        )
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._executor.shutdown()


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


def create_rollout_worker(
    model_path: str,
    config: Optional[RolloutConfig] = None,
    *,
    tokenizer_path: Optional[str] = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    partial_rollout: bool = False,
    worker_cls: Optional[type] = None,
    name: str = "rollout_pg",
):
    """Start a ``RolloutWorker`` actor in its own placement group; returns ``(actor, placement_group)``.
    ``partial_rollout``: weight pushes pause its generations (``partial_worker_class``)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    pg = placement_group([bundle], name=name)
    ray.get(pg.ready(), timeout=600)
    remote = _remote_worker(partial_rollout, worker_cls)
    actor = remote.options(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote(model_path, config, tokenizer_path, max(1, round(num_cpus)), partial_rollout)
    return actor, pg


@dataclasses.dataclass
class RolloutReplica:
    """One rollout engine as the placement started it."""

    index: int
    """Replica rank (the engine map's order)."""
    actor: Any
    """The ``RolloutWorker`` actor (the engine's head)."""
    nodes: tuple
    """Pool node indices the engine uses."""
    gpus: tuple
    """``(node, physical GPU id)`` of every GPU it uses (empty on CPU)."""
    headless: tuple = ()
    """``HeadlessEngineNode`` actors on its other nodes (an engine larger than a node)."""
    placement_group: Any = None
    """Its own placement group (CPU placements), else None (the placement's shared bundles)."""

    def where(self) -> str:
        """``replica r on node(s) ... GPUs ...`` for errors."""
        gpus = ", ".join(f"{n}:{g}" for n, g in self.gpus) or "none (CPU)"
        return f"rollout replica {self.index} (node(s) {list(self.nodes)}, GPUs {gpus})"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the engine down, then kill its actors: what the engine holds outside its process (vLLM's
        rendezvous file, the last LoRA adapter in shared memory) goes with it. An engine that has died
        answers at once; one that does not answer within ``timeout_s`` is killed as it is."""
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.actor.shutdown.remote(), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in (self.actor, *self.headless):
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def _remote_worker(partial_rollout: bool, worker_cls: Optional[type]):
    import ray

    if worker_cls is not None:
        return ray.remote(worker_cls)
    return (
        ray.remote(concurrency_groups={"weights": 1})(partial_worker_class())
        if partial_rollout
        else ray.remote(RolloutWorker)
    )


def create_rollout_replicas(
    model_path: str,
    config: RolloutConfig,
    layout: Any,
    *,
    bundles: Any = None,
    num_cpus: float = 1.0,
    partial_rollout: bool = False,
    tokenizer_path: Optional[str] = None,
    worker_cls: Optional[type] = None,
    headless_cls: Optional[type] = None,
    start_timeout_s: float = 1800,
    wait: bool = True,
) -> list[RolloutReplica]:
    """Start one engine per replica of ``layout`` (``megatron_rl.utils.engine_map.EngineMap``).

    With ``bundles`` (``megatron_rl.workers.group.GpuBundles``, GPUs): engine ``r``'s head is a CPU-only
    actor in the slot of its first GPU with ``CUDA_VISIBLE_DEVICES`` the physical ids of its GPUs on
    that node, and vLLM's ``mp`` executor starts one worker per GPU (verl's choice: the engine sees
    exactly its GPUs and the colocated training ranks keep their own Ray GPU shares of the same
    bundles, which vLLM's Ray executor, wanting whole-GPU bundles of its own, would not allow). An
    engine larger than a node adds a ``HeadlessEngineNode`` on each further node (vLLM's multi-node
    ``mp`` mode: ``nnodes`` / ``node_rank`` / ``master_addr``). Without ``bundles`` (CPU) each replica
    gets a placement group of one bundle of ``num_cpus`` CPUs. An engine that fails to start raises
    ``RuntimeError`` naming the replica, its nodes, GPUs and vLLM's reason; the others are stopped.
    ``worker_cls`` / ``headless_cls`` replace the actors (the placement tests start probes). ``wait=False``
    returns as soon as the engines are created: the caller starts other workers meanwhile and calls
    ``wait_started`` (and kills the replicas if that raises)."""
    import ray

    remote = _remote_worker(partial_rollout, worker_cls)
    threads = max(1, round(num_cpus))
    replicas: list[RolloutReplica] = []
    try:
        for r, engine in enumerate(layout.engines):
            if bundles is None:
                actor, pg = create_rollout_worker(
                    model_path,
                    config,
                    tokenizer_path=tokenizer_path,
                    num_cpus=num_cpus,
                    partial_rollout=partial_rollout,
                    worker_cls=worker_cls,
                    name=f"rollout_pg_{r}",
                )
                replicas.append(RolloutReplica(r, actor, (engine[0][0],), (), placement_group=pg))
                continue
            gpn = bundles.gpus_per_node
            slots = [(node - layout.first_node) * gpn + gpu for node, gpu in engine]
            per_node: dict[int, list[int]] = {}
            for slot in slots:
                per_node.setdefault(bundles.node_of(slot), []).append(slot)
            node_slots = list(per_node.values())
            gpus = tuple((bundles.node_of(s), bundles.gpu_id(s)) for s in slots)
            multi = None
            if len(node_slots) > 1:
                from megatron_rl.workers.megatron_worker import free_port

                multi = {
                    "nnodes": len(node_slots),
                    "node_rank": 0,
                    "master_addr": bundles.node_ip(slots[0]),
                    "master_port": free_port(),
                }

            def env(group):
                return {"env_vars": {"CUDA_VISIBLE_DEVICES": ",".join(str(bundles.gpu_id(s)) for s in group)}}

            actor = remote.options(
                num_cpus=0.01,
                num_gpus=0,
                runtime_env=env(node_slots[0]),
                scheduling_strategy=bundles.strategy(node_slots[0][0]),
            ).remote(model_path, config, tokenizer_path, threads, partial_rollout, multi)
            headless = tuple(
                ray.remote(headless_cls or HeadlessEngineNode)
                .options(
                    num_cpus=0.01, num_gpus=0, runtime_env=env(group), scheduling_strategy=bundles.strategy(group[0])
                )
                .remote(model_path, config, {**multi, "node_rank": k})
                for k, group in enumerate(node_slots[1:], start=1)
            )
            replicas.append(RolloutReplica(r, actor, tuple(per_node), gpus, headless))
        if wait:
            wait_started(replicas, start_timeout_s)
    except BaseException:
        for replica in replicas:
            replica.kill()
        raise
    return replicas


def wait_started(replicas: list[RolloutReplica], timeout_s: float = 1800) -> None:
    """Block until every engine answers; a failure names the replica (``RolloutReplica.where``)."""
    import ray

    pending = {r.actor.pad_token_id.remote(): r for r in replicas}
    for ref, replica in pending.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 - re-raised with the replica named
            cause = getattr(err, "cause", None) or err
            raise RuntimeError(f"{replica.where()} failed to start: {cause}") from err
