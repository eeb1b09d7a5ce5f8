"""Actor -> rollout weight sync as the driver sees it: ``WeightSync``, built once from the config.

``WeightSync(actor_group, rollout_workers, checkpoint_engine)`` picks the path once from
``checkpoint_engine.backend`` (``megatron_rl.config.rollout.WeightSyncConfig``) and syncs into every
rollout engine (replica) of the run, every vLLM worker inside each:

* a streamable transport (``broadcast``, ``shm``, ``nccl``): actor rank 0 and the vLLM workers of
  every replica share one side band (replica ``r``'s workers at ranks ``1 + sum of the earlier
  replicas' workers``), connected on the first ``sync()`` and kept for the run (with ``nccl`` one
  NCCL broadcast group spanning every engine worker, built once, not per sync); every sync then
  streams the bridge's export bucket by bucket from rank 0 (``megatron_rl.rollout.weight_stream``)
  to all of them at once, so the model is never whole anywhere;
* ``colocated`` / ``bytes``: rank 0 gathers the HF tensors once and every replica loads the same
  object-store copy with that transport into its engine (small models).

Every replica acknowledges the sync before ``sync()`` returns (the next generation starts after);
one that fails raises ``ReplicaError`` naming the replica, and the trainer stops the step there (each
engine's receiver aborts a failed session without a half-loaded layer).

With ``quantization="fp8"`` (``actor_rollout_ref.rollout.quantization``; the trainer passes it) rank 0
quantises the export into DeepSeek-V3's block FP8 before it travels (``megatron_rl.rollout.weight_stream.quantize_fp8_stream``),
whichever path is taken; an FP8 engine given unquantised weights quantises them itself.

``export_weights(group, bucket_bytes)`` is the gathered HF export on its own (HF checkpoints);
``WeightSyncRank.export_lora_adapter`` the LoRA adapters as a PEFT adapter (``lora_adapter/`` of one).
A LoRA actor with ``lora.merge: false`` syncs its adapters only (``WeightSync(adapter_only=True)``):
rank 0's compact PEFT adapter goes through Ray's object store to every replica's vLLM LoRA.
``WeightSyncRank`` is the part each actor rank runs (mixed into ``MegatronWorker``).
``connect_weight_sync`` / ``sync_weights`` are the older two-call form of the streamed path.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from megatron_rl.config.rollout import WeightSyncConfig

__all__ = ["WeightSync", "WeightSyncRank", "export_weights", "connect_weight_sync", "sync_weights"]


def _check_merged_sync(engine) -> None:
    """A full (streamed or gathered) sync of a LoRA engine moves its merged weights; with
    ``lora.merge: false`` the rollout gets the adapters instead (``WeightSync(adapter_only=True)``)."""
    lora = engine.lora
    if lora is not None and not lora.merge:
        raise ValueError(
            f"lora.merge={lora.merge!r} with lora.rank={lora.rank}: this engine syncs only its adapters "
            "into vLLM's LoRA (WeightSync(adapter_only=True)); a full-weight sync is not its path. "
            "Allowed here: lora.merge=true (the merged weights W + alpha/rank * B A)"
        )


class WeightSyncRank:
    """Mixin of ``MegatronWorker``: uses ``self.engine``, ``self.weight_map``, ``self.mesh``, ``self.rank``."""

    _exporter = None
    _weight_sync = None

    def export_weights(
        self, bucket_bytes: int, dtype: Optional[str] = None, quantization: Optional[str] = None
    ) -> Optional[list]:
        """Collective: global rank 0 returns the full model as HF ``(name, tensor)`` copies (block FP8
        weight + scale pairs with ``quantization="fp8"``); others None. A LoRA engine exports its merged
        weights (``W + scale * B A`` under the base's names; the adapters, ``bridge_ignore``, left out)."""
        from parallel.bridge import HFExporter

        if self.weight_map is None:
            raise ValueError("export_weights needs the HF family of the model: build the group with hf_dir")
        if self._exporter is None:
            self._exporter = HFExporter(
                self.engine.model,
                self.weight_map,
                mesh=self.mesh,
                dtype=getattr(torch, dtype) if dtype else None,
                ignore=self.engine.bridge_ignore,
            )
        with self.engine.merged_weights():  # copies taken inside: the base is restored bit for bit after
            weights = self._exporter.iter_weights(bucket_bytes=bucket_bytes, all_ranks=False)
            out = [(name, t.detach().clone()) for name, t in weights]
        if quantization is not None and self.rank == 0:
            from megatron_rl.config.base_config import check_choice
            from megatron_rl.config.rollout import QUANTIZATIONS
            from megatron_rl.rollout.weight_stream import quantize_fp8_stream
            from parallel.bridge.fp8 import DEFAULT_BLOCK

            check_choice("rollout.quantization", quantization, QUANTIZATIONS)
            out = [pair for bucket in quantize_fp8_stream([out], DEFAULT_BLOCK) for pair in bucket]
        return out if self.rank == 0 else None

    def export_lora_adapter(
        self, bucket_bytes: int, base_model_name_or_path: Optional[str] = None, *, required: bool = True
    ) -> Optional[tuple[dict, dict] | str]:
        """Collective: global rank 0 returns the LoRA adapters as a PEFT adapter, ``(tensors, config)``
        (``megatron_rl.engine.lora_peft``: PEFT's names, gathered over TP / PP); others, and every rank
        of an engine without LoRA, None. Adapters with no PEFT form (inside MoE experts) raise, or with
        ``required=False`` rank 0 returns the reason as a string."""
        if self.engine.lora is None:
            return None
        from megatron_rl.engine.lora_peft import PeftExportUnsupported, peft_adapter_config, peft_adapter_tensors

        if self.weight_map is None:
            raise ValueError("export_lora_adapter needs the HF family of the model: build the group with hf_dir")
        try:
            tensors = peft_adapter_tensors(
                self.engine.model, self.weight_map, mesh=self.mesh, bucket_bytes=bucket_bytes
            )
        except PeftExportUnsupported as exc:  # raised on every rank alike (the check follows a gather)
            if required:
                raise
            return str(exc) if self.rank == 0 else None
        if self.rank != 0:
            return None
        return tensors, peft_adapter_config(self.engine.lora, tensors, base_model_name_or_path=base_model_name_or_path)

    def export_lora_adapter_parts(self, bucket_bytes: int) -> Optional[tuple[dict, dict, dict]]:
        """Collective: global rank 0 returns the compact PEFT adapter ``(tensors, shared, peft_config)``
        (``megatron_rl.engine.lora_peft.peft_adapter_parts``: each adapter tensor once) for an
        adapter-only sync (``lora.merge: false``); the others None."""
        from megatron_rl.engine.lora_peft import expand_shared, peft_adapter_config, peft_adapter_parts

        if self.engine.lora is None:
            raise ValueError("an adapter-only weight sync needs a LoRA actor (actor_rollout_ref.model.lora.rank > 0)")
        if self.weight_map is None:
            raise ValueError("export_lora_adapter_parts needs the HF family of the model: build the group with hf_dir")
        tensors, shared = peft_adapter_parts(
            self.engine.model, self.weight_map, mesh=self.mesh, bucket_bytes=bucket_bytes
        )
        if self.rank != 0:
            return None
        return tensors, shared, peft_adapter_config(self.engine.lora, expand_shared(tensors, shared))

    def weight_sync_listen(
        self,
        world_size: int,
        transport: str,
        bucket_megabytes: float,
        shm_dir: str,
        dtype: Optional[str] = None,
        quantization: Optional[str] = None,
    ) -> Optional[tuple[str, int]]:
        """Collective: build this rank's ``ActorWeightSync``; rank 0 hosts the side band and
        returns ``(addr, port)`` for the rollout worker, the others None."""
        import ray

        from megatron_rl.rollout.weight_stream import ActorWeightSync

        if self.weight_map is None:
            raise ValueError("weight sync needs the HF family of the model: build the group with hf_dir")
        _check_merged_sync(self.engine)
        if self._weight_sync is not None:
            self._weight_sync.close()
        self._weight_sync = ActorWeightSync.from_engine(
            self.engine,
            self.weight_map,
            mesh=self.mesh,
            dtype=getattr(torch, dtype) if dtype else None,
            bucket_megabytes=bucket_megabytes,
            quantization=quantization,
        )
        return self._weight_sync.listen(
            world_size, transport=transport, master_addr=ray.util.get_node_ip_address(), shm_dir=shm_dir
        )

    def weight_sync_connect(self) -> None:
        """Collective: rank 0 joins the side band (blocks until the rollout worker has joined)."""
        self._weight_sync.connect()

    def weight_sync(self) -> dict[str, Any]:
        """Collective: stream the current weights bucket by bucket (rank 0 sends)."""
        return self._weight_sync.sync()

    def weight_sync_close(self) -> None:
        """Leave the side band."""
        if self._weight_sync is not None:
            self._weight_sync.close()
            self._weight_sync = None


class WeightSync:
    """The driver's handle on actor -> rollout weight sync; construct once, call ``sync()`` per step.

    Args:
        actor_group: the actor's ``MegatronWorkerGroup`` (its ``workers`` are ``WeightSyncRank`` actors).
        rollout_worker: the ``RolloutWorker`` Ray actor, or a list of them (one per replica).
        config: ``actor_rollout_ref.rollout.checkpoint_engine`` (transport, bucket bound, shm directory).
        dtype: cast the exported tensors (a torch dtype name, e.g. ``"bfloat16"``); None keeps them.
        quantization: ``actor_rollout_ref.rollout.quantization`` (None or ``"fp8"``: rank 0 sends
            block FP8 weight + scale pairs).
        adapter_only: a LoRA actor with ``lora.merge: false``: every sync moves only the adapters (rank
            0's compact PEFT adapter, through Ray's object store to each replica, which loads it into
            vLLM's LoRA: ``VLLMRollout.load_lora_tensors``); the transport setting is not used.
    """

    def __init__(
        self,
        actor_group,
        rollout_worker,
        config: WeightSyncConfig,
        *,
        dtype: Optional[str] = None,
        quantization: Optional[str] = None,
        adapter_only: bool = False,
    ):
        from parallel.transport import get_transport

        self.rollouts = list(rollout_worker) if isinstance(rollout_worker, (list, tuple)) else [rollout_worker]
        self.group, self.rollout, self.config, self.dtype = actor_group, self.rollouts[0], config, dtype
        self.quantization = quantization
        if adapter_only and quantization is not None:
            raise ValueError(
                f"rollout.quantization={quantization!r} with lora.merge=false is not built (the adapters "
                "go to vLLM's LoRA unquantised); allowed: None, or set lora.merge=true"
            )
        self.adapter_only = adapter_only
        self.streamed = get_transport(config.backend).streamable and not adapter_only
        self.connected = False

    @property
    def bucket_bytes(self) -> int:
        return int(self.config.update_weights_bucket_megabytes * 2**20)

    def connect(self) -> None:
        """Join actor rank 0 and the rollout worker's vLLM workers in a side band (streamed
        transports only; ``sync()`` calls it the first time)."""
        import ray

        if not self.streamed:
            raise ValueError(f"checkpoint_engine.backend={self.config.backend!r} does not stream; nothing to connect")
        sizes = [int(s) for s in ray.get([r.num_engine_workers.remote() for r in self.rollouts])]  # TP x PP each
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]  # replica r's first worker's rank
        world = 1 + sum(sizes)
        listened = ray.get(
            [
                w.weight_sync_listen.remote(
                    world,
                    self.config.backend,
                    self.config.update_weights_bucket_megabytes,
                    self.config.shm_dir,
                    self.dtype,
                    self.quantization,
                )
                for w in self.group.workers
            ]
        )
        addr, port = listened[0]
        ray.get(
            [w.weight_sync_connect.remote() for w in self.group.workers]
            + [r.weight_sync_connect.remote(addr, port, world, offset) for r, offset in zip(self.rollouts, offsets)]
        )
        self.connected = True

    def sync(self) -> dict[str, Any]:
        """Push the actor's current weights into the rollout engine.

        Returns ``{"transport", "bytes", "num_tensors", "num_buckets", "seconds", "wall_seconds"}``
        (``seconds``: the sync as its sender timed it; ``wall_seconds``: as the driver saw it,
        export and hand-over included); streamed syncs add ``receiver_seconds`` and the export's
        ``export_*`` figures.
        """

        start = time.perf_counter()
        if self.adapter_only:
            import ray

            parts = [w.export_lora_adapter_parts.remote(self.bucket_bytes) for w in self.group.workers]
            acks = [r.load_lora_adapter_parts.remote(parts[0]) for r in self.rollouts]  # rank 0's, by reference
            try:
                ray.get(parts)
            finally:
                out = _acknowledged(acks)[0]
        elif self.streamed:
            if not self.connected:
                self.connect()
            out = _streamed_sync(self.group, self.rollouts)
        else:
            weights = export_weights(self.group, self.bucket_bytes, self.dtype, self.quantization)
            refs = [
                r.update_weights.remote(
                    weights, transport=self.config.backend, bucket_megabytes=self.config.update_weights_bucket_megabytes
                )
                for r in self.rollouts
            ]
            out = _acknowledged(refs)[0]
        return {**out, "replicas": len(self.rollouts), "wall_seconds": time.perf_counter() - start}

    def close(self) -> None:
        """Leave the side band (if connected)."""
        import ray

        if self.connected:
            ray.get(
                [w.weight_sync_close.remote() for w in self.group.workers]
                + [r.weight_sync_close.remote() for r in self.rollouts]
            )
            self.connected = False


def export_weights(group, bucket_bytes: int, dtype: Optional[str] = None, quantization: Optional[str] = None):
    """ObjectRef to rank 0's HF ``(name, tensor)`` list (all ranks take part in the gather; block FP8
    pairs with ``quantization="fp8"``)."""
    refs = [w.export_weights.remote(bucket_bytes, dtype, quantization) for w in group.workers]
    return refs[0]


# ----------------------------------------------------------------------------- the two-call form
def connect_weight_sync(
    group, rollout, transport: str, bucket_megabytes: float, dtype: Optional[str] = None, shm_dir: Optional[str] = None
) -> WeightSync:
    """Join actor rank 0 of ``group`` and the ``RolloutWorker`` actor ``rollout`` in a side band
    (``transport`` ``broadcast`` or ``shm``); afterwards ``sync_weights(group, rollout)`` streams the
    weights. Prefer ``WeightSync``, which also connects on first use. Returns the connected one."""
    extra = {} if shm_dir is None else {"shm_dir": shm_dir}  # else the config's own default
    config = WeightSyncConfig(backend=transport, update_weights_bucket_megabytes=bucket_megabytes, **extra)
    sync = WeightSync(group, rollout, config, dtype=dtype)
    sync.connect()
    return sync


def sync_weights(group, rollout) -> dict[str, Any]:
    """One streamed sync into ``rollout`` (after ``connect_weight_sync``): rank 0's stats merged with
    the receiver's."""
    return _streamed_sync(group, rollout)


def _streamed_sync(group, rollouts) -> dict[str, Any]:
    """Every actor rank sends (rank 0 streams) while every replica's rollout worker receives."""
    import ray

    rollouts = list(rollouts) if isinstance(rollouts, (list, tuple)) else [rollouts]
    sent = [w.weight_sync.remote() for w in group.workers]
    received = [r.weight_sync_receive.remote() for r in rollouts]
    try:
        out = ray.get(sent)[0]
    finally:
        acks = _acknowledged(received)
    return {**out, "receiver_seconds": max(a["seconds"] for a in acks)}


def _acknowledged(refs: list) -> list:
    """Every replica's answer to one sync; ``RuntimeError`` naming the replicas that failed (the step
    stops: no generation runs on a mix of versions)."""
    import ray

    out, failed = [], []
    for r, ref in enumerate(refs):
        try:
            out.append(ray.get(ref))
        except Exception as err:  # noqa: BLE001 - collected, then raised together
            failed.append(f"rollout replica {r}: {getattr(err, 'cause', None) or err}")
    if failed:  # a RayError: the trainer stops the run naming the last good checkpoint
        from megatron_rl.workers.router import ReplicaError

        raise ReplicaError(f"weight sync failed in {len(failed)} of {len(refs)} replica(s): " + "; ".join(failed))
    return out
