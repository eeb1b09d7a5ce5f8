"""INTERIM (re-layering in progress): the driver side of weight sync until workers/weight_sync.py has its own."""

from __future__ import annotations

from typing import Any

from megatron_rl.config.rollout import WeightSyncConfig

__all__ = ["WeightSync"]


class WeightSync:
    """Actor group -> rollout worker, by ``checkpoint_engine.backend`` (picked once, here)."""

    def __init__(self, actor: Any, rollout: Any, config: WeightSyncConfig):
        self.actor, self.rollout, self.config = actor, rollout, config
        self._connected = False

    def sync(self) -> dict[str, Any]:
        import ray

        from megatron_rl.workers.weight_sync import connect_weight_sync, export_weights, sync_weights

        mb = self.config.update_weights_bucket_megabytes
        if self.config.backend in ("broadcast", "shm"):
            if not self._connected:
                connect_weight_sync(self.actor, self.rollout, transport=self.config.backend, bucket_megabytes=mb)
                self._connected = True
            return sync_weights(self.actor, self.rollout)
        return ray.get(self.rollout.update_weights.remote(export_weights(self.actor, bucket_bytes=int(mb * 2**20))))
