"""``MegatronWorker``: one rank of a Megatron role, as a Ray actor.

It joins the role's ``torch.distributed`` group (rank 0's address and a free port, chosen on
rank 0's node), initialises the mesh (``parallel.mesh.init_mesh``), builds the engine and the
role object from a ``WorkerSpec`` (``megatron_rl.roles.build_role``) and, given an HF checkpoint
directory, loads its weights through the bridge. ``call(method, shard, kwargs)`` runs a role
method on this rank's data-parallel shard, whose fields arrive as object-store references
(``megatron_rl.workers.dispatch``). Weight export and streamed weight sync come from
``WeightSyncRank`` (``megatron_rl.workers.weight_sync``).

On CPU, bundles ask for fractional CPUs, so more actors than cores can start; each actor limits
torch to ``max(1, round(num_cpus))`` threads.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch

from megatron_rl.engine.device import to_host
from megatron_rl.workers.dispatch import resolve_shard
from megatron_rl.workers.spec import WorkerSpec
from megatron_rl.workers.weight_sync import WeightSyncRank

__all__ = ["MegatronWorker", "free_port"]


def free_port() -> int:
    """A TCP port that was free on this node a moment ago."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class MegatronWorker(WeightSyncRank):
    """One rank of a Megatron role (wrapped as a Ray actor by ``MegatronWorkerGroup``)."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(max(1, num_threads))
        self.engine = self.role = self.mesh = self.weight_map = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a port held for the rendezvous store (asked of rank 0 for
        ``MASTER_ADDR/PORT``): rank 0's ``init_engine`` hosts the store on the socket held there."""
        import ray

        from parallel.netbind import reserve_port

        host = ray.util.get_node_ip_address()
        return host, reserve_port(host)

    def init_engine(self, master_addr: str, master_port: int, spec: WorkerSpec) -> dict[str, int]:
        """Join the group, build the engine and role (and load ``spec.hf_dir``); return this rank's coordinates.

        A checkpoint that does not fit the role (a causal LM for ``reward``, a sequence classifier
        for ``actor``/``ref``/``teacher``) is refused before the rank joins any process group.
        """
        from megatron_rl.utils.heavy_imports import collector_paused

        with collector_paused():  # Megatron's and the role's imports, once per worker process
            from megatron_rl.models.families import get_family, hf_head
            from megatron_rl.roles import build_role
            from parallel.bridge import load_hf_checkpoint
            from parallel.mesh import init_mesh

        role, head = spec.role, "lm"
        if spec.hf_dir is not None:
            family = get_family(spec.hf_dir)
            model_cfg = family.model_config(spec.hf_dir, **spec.model_overrides)
            head = hf_head(spec.hf_dir)  # "score" for a *ForSequenceClassification checkpoint
            if role == "reward" and head != "score":
                raise ValueError(
                    f"reward: {spec.hf_dir} is not a reward model; it needs an HF "
                    "*ForSequenceClassification checkpoint with num_labels=1 (its score.weight "
                    "becomes the scalar head)"
                )
            if role in ("actor", "ref", "teacher") and head != "lm":
                raise ValueError(
                    f"{role}: {spec.hf_dir} is a *ForSequenceClassification checkpoint (no lm_head); "
                    "this role needs a causal LM"
                )
            self.weight_map = family.weight_map(model_cfg, head=head)
        else:
            model_cfg = spec.model_config
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
        )
        self.mesh = init_mesh(spec.megatron.parallel(), seed=spec.megatron.seed)
        self.role = build_role(
            role,
            model_cfg,
            self.mesh,
            spec.config,
            transformer_overrides=spec.megatron.override_transformer_config,
            sequence_parallel=spec.megatron.sequence_parallel,
            remove_padding=spec.megatron.use_remove_padding,
            distributed_optimizer=role in ("actor", "critic") and spec.megatron.use_distributed_optimizer,
            routing_replay=role in ("actor", "ref") and spec.megatron.router_replay.enabled,
            lora=spec.lora,
        )
        self.engine = self.role.engine
        if spec.hf_dir is not None:
            # A critic from a causal LM keeps its value head's fresh initialisation; one from a
            # reward model (verl's usual PPO start) loads the score head.
            # LoRA adapters (engine.bridge_ignore) have no HF name: they keep their initialisation.
            ignore = ((r"output_layer\.",) if role == "critic" and head == "lm" else ()) + self.engine.bridge_ignore
            load_hf_checkpoint(self.engine.model, self.weight_map, spec.hf_dir, mesh=self.mesh, ignore=ignore)
            if spec.lora is not None and spec.lora.adapter_path:  # verl's lora.adapter_path: a saved PEFT adapter
                from megatron_rl.engine.lora_peft import load_peft_adapter

                load_peft_adapter(self.engine.model, self.weight_map, spec.lora.adapter_path, spec.lora, mesh=self.mesh)
        m = self.mesh
        return {
            "rank": self.rank,
            "dp_rank": m.dp_rank,
            "dp_size": m.size("dp"),
            "tp_rank": m.tp_rank,
            "cp_rank": m.cp_rank,
            "pp_rank": m.pp_rank,
            "is_last_pp_stage": m.is_last_pp_stage,
        }

    def call(self, method: str, shard: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Any:
        """``role.<method>(batch, **kwargs)`` on this rank's shard (its object references fetched here).

        The shard arrives in host memory and is handed over as it is: the engine moves each
        micro-batch to its device (``megatron_rl.engine.device``). What the method returns goes
        back in host memory, so the driver never unpickles a CUDA tensor."""
        return to_host(getattr(self.role, method)(resolve_shard(shard), **kwargs))

    def save_checkpoint(self, path: str) -> str:
        """Collective: the engine's model / optimizer / schedule / RNG to ``path`` (atomic; offloaded
        parts come back for the save and leave again)."""
        with self._onloaded():
            return self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Collective: restore ``save_checkpoint``'s state (any layout for the model and optimizer)."""
        with self._onloaded():
            self.engine.load_checkpoint(path, load_optimizer=load_optimizer)

    # -- host offload between phases (megatron_rl.trainer.phases.PhaseRunner) ----------------------
    def offload(self, parts: list[str]) -> int:
        """Move ``parts`` (``params`` / ``grads`` / ``optimizer``) of the engine to host memory; bytes moved."""
        return self.engine.offload_to_cpu(**{p: p in parts for p in ("params", "grads", "optimizer")})

    def onload(self, parts: list[str]) -> int:
        """Bring ``parts`` back to the compute device; bytes moved."""
        return self.engine.load_to_device(**{p: p in parts for p in ("params", "grads", "optimizer")})

    def memory_stats(self) -> dict[str, Any]:
        """Bytes the engine keeps on its compute device by part, the device's peak allocated / reserved
        bytes (on CPU the process's peak RSS) and the host memory in use."""
        import resource

        import psutil

        cuda = torch.cuda.is_available()
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "resident": self.engine.resident_bytes(device="cuda" if cuda else "cpu"),
            "max_allocated": torch.cuda.max_memory_allocated() if cuda else peak_rss,
            "max_reserved": torch.cuda.max_memory_reserved() if cuda else peak_rss,
            "cpu_used": psutil.virtual_memory().used,
        }

    @contextlib.contextmanager
    def _onloaded(self):
        """Everything on device inside the block; what was offloaded leaves again after it."""
        away = [p for p, off in self.engine.offloaded().items() if off] if self.engine is not None else []
        if away:
            self.onload(away)
        try:
            yield
        finally:
            if away:
                self.offload(away)

    def enable_stack_dumps(self, directory: str, name: str) -> int:
        """Dump this process's Python stacks into ``directory`` whenever the driver's hang watchdog asks
        (``megatron_rl.workers.stacks``), even while a call hangs; returns the pid."""
        from megatron_rl.workers.stacks import StackDumpListener

        self._stack_dumps = StackDumpListener(directory, name)
        return os.getpid()

    def shutdown(self) -> None:
        from parallel.mesh import destroy_mesh

        if self.mesh is not None:
            destroy_mesh(self.mesh)
            self.mesh = None
