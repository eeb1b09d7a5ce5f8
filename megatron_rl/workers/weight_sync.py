"""Worker-side glue of actor -> rollout weight sync (the transports live in ``megatron_rl.rollout``).

* ``WeightSyncRank``: the methods a ``MegatronWorker`` (one actor rank) runs for a sync:
  the gathered HF export (``export_weights``) and the streamed side band
  (``weight_sync_listen`` / ``weight_sync_connect`` / ``weight_sync``).
* ``connect_weight_sync`` / ``sync_weights`` / ``export_weights``: what the driver runs over a
  worker group and a ``RolloutWorker``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["WeightSyncRank", "connect_weight_sync", "sync_weights", "export_weights"]


class WeightSyncRank:
    """Mixin of ``MegatronWorker``: uses ``self.engine``, ``self.weight_map``, ``self.mesh``, ``self.rank``."""

    _exporter = None
    _weight_sync = None

    def export_weights(self, bucket_bytes: int, dtype: Optional[str] = None) -> Optional[list]:
        """Collective: global rank 0 returns the full model as HF ``(name, tensor)`` copies; others None."""
        from parallel.bridge import HFExporter

        if self.weight_map is None:
            raise ValueError("export_weights needs the HF family of the model: build the group with hf_dir")
        if self._exporter is None:
            self._exporter = HFExporter(self.engine.model, self.weight_map, mesh=self.mesh,
                                        dtype=getattr(torch, dtype) if dtype else None)
        out = [(name, t.detach().clone()) for name, t in
               self._exporter.iter_weights(bucket_bytes=bucket_bytes, all_ranks=False)]
        return out if self.rank == 0 else None

    def weight_sync_listen(self, world_size: int, transport: str, bucket_megabytes: float,
                           dtype: Optional[str] = None) -> Optional[tuple[str, int]]:
        """Collective: build this rank's ``ActorWeightSync``; rank 0 hosts the side-band group and
        returns ``(addr, port)`` for the rollout worker, the others None."""
        import ray

        from megatron_rl.rollout.weight_sync import ActorWeightSync

        if self.weight_map is None:
            raise ValueError("weight sync needs the HF family of the model: build the group with hf_dir")
        self._weight_sync = ActorWeightSync.from_engine(self.engine, self.weight_map, mesh=self.mesh,
                                                        dtype=getattr(torch, dtype) if dtype else None,
                                                        bucket_megabytes=bucket_megabytes)
        return self._weight_sync.listen(world_size, transport=transport, master_addr=ray.util.get_node_ip_address())

    def weight_sync_connect(self) -> None:
        self._weight_sync.connect()

    def weight_sync(self) -> dict[str, Any]:
        """Collective: stream the current weights bucket by bucket (rank 0 sends)."""
        return self._weight_sync.sync()


def connect_weight_sync(group, rollout, transport: str, bucket_megabytes: float, dtype: Optional[str] = None) -> None:
    """Join actor rank 0 of ``group`` and the ``RolloutWorker`` actor ``rollout`` in a gloo side band
    (``transport`` ``broadcast`` or ``shm``, the latter when both share a node); afterwards
    ``sync_weights(group, rollout)`` streams the weights without gathering the model anywhere."""
    import ray

    world = 1 + int(ray.get(rollout.tensor_parallel_size.remote()))
    listened = ray.get([w.weight_sync_listen.remote(world, transport, bucket_megabytes, dtype) for w in group.workers])
    addr, port = listened[0]
    ray.get([w.weight_sync_connect.remote() for w in group.workers] + [rollout.weight_sync_connect.remote(addr, port, world)])


def sync_weights(group, rollout) -> dict[str, Any]:
    """One streamed sync into ``rollout`` (after ``connect_weight_sync``): rank 0's stats merged with
    the receiver's."""
    import ray

    sent = [w.weight_sync.remote() for w in group.workers]
    received = rollout.weight_sync_receive.remote()
    out = ray.get(sent)[0]
    return {**out, "receiver_seconds": ray.get(received)["seconds"]}


def export_weights(group, bucket_bytes: int, dtype: Optional[str] = None):
    """ObjectRef to rank 0's HF ``(name, tensor)`` list (all ranks take part in the gather)."""
    refs = [w.export_weights.remote(bucket_bytes, dtype) for w in group.workers]
    return refs[0]
