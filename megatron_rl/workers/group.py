"""``MegatronWorkerGroup``: the Ray actors of one Megatron role, called with global batches.

It starts one ``MegatronWorker`` per rank of the role's layout (world size = TP x PP x CP x DP
x ...) in a placement group of one bundle per rank and builds every rank from the same
``WorkerSpec``. A role method is called on the *global* batch: the fields the method declares
(``megatron_rl.data.batch.fields_of``) go to the data-parallel replicas by reference
(``megatron_rl.workers.dispatch.ShardCache``, shared by the trainer's groups), and the result
is collected from one rank per replica in DP order. Update calls return the metrics of global
rank 0 (the engine already reduces them over DP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from megatron_rl.data.batch import fields_of
from megatron_rl.workers.dispatch import ShardCache
from megatron_rl.workers.probes import bundle_where
from megatron_rl.workers.spec import WorkerSpec

__all__ = ["MegatronWorkerGroup", "GpuBundles"]


class GpuBundles:
    """One placement group of one bundle per GPU, ``nodes x gpus_per_node`` of them, shared by every
    colocated role (verl's ``max_colocate_count``): rank ``g`` of each role and the engine worker of
    GPU ``g`` take slot ``g``, so they see the same device and no two ranks of one role share one.

    Ray's bundle order is not node-grouped (a known cause of cross-node TP groups), so a probe task
    in each bundle reports its node and GPU id and the slots are the bundles sorted by (node, GPU):
    node order is that of the first bundle Ray placed on each node. ``gpus`` gives each slot's
    ``(node_index, node_id, node_ip, gpu_id)``.

    Args:
        nodes / gpus_per_node: the pool (``trainer.nnodes x n_gpus_per_node`` or the separate rollout's).
        num_cpus_per_bundle: CPUs each bundle reserves (its colocated ranks and engine actors share them).
        name: the placement group's name.
    """

    def __init__(
        self,
        nodes: int,
        gpus_per_node: int,
        *,
        num_cpus_per_bundle: float = 1.0,
        name: str = "gpus_pg",
        timeout_s: float = 600,
    ):
        import ray
        from ray.util.placement_group import placement_group

        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        total = nodes * gpus_per_node
        self.placement_group = placement_group(
            [{"GPU": 1, "CPU": num_cpus_per_bundle} for _ in range(total)], strategy="PACK", name=name
        )
        try:
            ray.get(self.placement_group.ready(), timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 - name what could not be placed
            ray.util.remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"{name}: Ray could not reserve {total} bundles of one GPU and {num_cpus_per_bundle} "
                f"CPU(s) ({nodes} node(s) x {gpus_per_node} GPUs) within {timeout_s:.0f} s; cluster "
                f"resources: {ray.cluster_resources()}"
            ) from err
        # A task, not an actor: it runs on a pooled worker process instead of starting one per bundle, and
        # it lives in a module that imports neither torch nor this one (a worker unpickles it by module).
        probe = ray.remote(num_cpus=0, num_gpus=0.001, max_calls=0)(bundle_where)  # 0: reuse (it holds no GPU memory)
        found = ray.get([probe.options(scheduling_strategy=self._strategy(b)).remote() for b in range(total)])
        node_order: dict[str, int] = {}
        for node_id, _, _ in found:
            node_order.setdefault(node_id, len(node_order))
        self.order = sorted(range(total), key=lambda b: (node_order[found[b][0]], found[b][2]))
        self.gpus = [(node_order[found[b][0]], found[b][0], found[b][1], found[b][2]) for b in self.order]
        per_node = [sum(1 for g in self.gpus if g[0] == n) for n in range(len(node_order))]
        if len(node_order) != nodes or any(c != gpus_per_node for c in per_node):
            self.shutdown()
            raise RuntimeError(
                f"{name}: Ray placed the {total} GPU bundles as {per_node} per node, not {nodes} node(s) "
                f"x {gpus_per_node}: the cluster's nodes do not match trainer.nnodes / n_gpus_per_node"
            )

    def _strategy(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=bundle)

    def strategy(self, slot: int):
        """The scheduling strategy that puts an actor into slot ``slot`` (GPU ``slot`` in (node, GPU) order)."""
        return self._strategy(self.order[slot])

    def node_of(self, slot: int) -> int:
        """Index of slot ``slot``'s node (0 = the first node of the pool)."""
        return self.gpus[slot][0]

    def gpu_id(self, slot: int) -> int:
        """The physical GPU id of slot ``slot`` on its node (what ``CUDA_VISIBLE_DEVICES`` names)."""
        return self.gpus[slot][3]

    def node_ip(self, slot: int) -> str:
        return self.gpus[slot][2]

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)


class MegatronWorkerGroup:
    """``world_size`` Ray actors running one Megatron role; methods take and return global batches.

    Args:
        spec: what every rank builds (role, layout, role config, model).
        world_size: number of ranks (= the layout's TP x PP x CP x DP).
        num_cpus_per_worker / num_gpus_per_worker: each rank's resources (its bundle's without ``bundles``).
        name: placement-group name prefix (default: the role).
        shards: the trainer's shared ``ShardCache`` (default: one of this group's own).
        bundles: a ``GpuBundles`` shared with the other colocated roles: rank ``i`` runs in its slot ``i``
            (a share ``num_gpus_per_worker`` of GPU ``i``) instead of a placement group of the group's own.
        worker_cls: the rank actor's class (default ``MegatronWorker``; the placement tests put probes there).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        world_size: int,
        *,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        name: Optional[str] = None,
        shards: Optional[ShardCache] = None,
        bundles: Optional[GpuBundles] = None,
        worker_cls: Optional[type] = None,
    ):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from megatron_rl.roles import role_class
        from megatron_rl.workers.megatron_worker import MegatronWorker

        if world_size < 1:
            raise ValueError(f"{spec.role}: world_size={world_size} must be >= 1")
        self.spec, self.role, self.world_size = spec, spec.role, world_size
        self.role_cls = role_class(spec.role)
        self.shards = shards if shards is not None else ShardCache()
        if bundles is not None:
            if world_size > len(bundles.order):
                raise ValueError(f"{spec.role}: world_size={world_size} exceeds the {len(bundles.order)} GPUs placed")
            self.placement_group = None  # the shared bundles belong to the placement
            strategies = [bundles.strategy(rank) for rank in range(world_size)]
        else:
            bundle = {"CPU": num_cpus_per_worker, **({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {})}
            self.placement_group = placement_group(
                [dict(bundle) for _ in range(world_size)], strategy="PACK", name=f"{name or spec.role}_pg"
            )
            ray.get(self.placement_group.ready(), timeout=600)
            strategies = [
                PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
                for rank in range(world_size)
            ]
        remote_cls = ray.remote(worker_cls or MegatronWorker)
        self.workers = [
            remote_cls.options(
                num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker, scheduling_strategy=strategies[rank]
            ).remote(rank, world_size, max(1, round(num_cpus_per_worker)))
            for rank in range(world_size)
        ]
        master_addr, master_port = ray.get(self.workers[0].address.remote())
        self.ranks = ray.get([w.init_engine.remote(master_addr, master_port, spec) for w in self.workers])
        self.dp_size = self.ranks[0]["dp_size"]
        # One collecting rank per DP replica, in DP order.
        collect = {
            r["dp_rank"]: r["rank"]
            for r in self.ranks
            if r["tp_rank"] == 0 and r["cp_rank"] == 0 and r["is_last_pp_stage"]
        }
        if sorted(collect) != list(range(self.dp_size)):
            raise RuntimeError(
                f"{spec.role}: no collecting rank for DP replicas {sorted(set(range(self.dp_size)) - set(collect))}"
            )
        self.collect_ranks = [collect[d] for d in range(self.dp_size)]

    # -- dispatch / collect -------------------------------------------------------------------
    def _dispatch(self, method: str, batch: Any, kwargs: Mapping[str, Any]) -> list:
        fields = fields_of(getattr(self.role_cls, method))
        shards = self.shards.refs(batch, fields.all, self.dp_size)
        return [w.call.remote(method, shards[r["dp_rank"]], dict(kwargs)) for w, r in zip(self.workers, self.ranks)]

    def collect(self, method: str, batch: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """``method`` on every rank; the per-sample results of the global batch, in its order."""
        import ray

        outs = ray.get(self._dispatch(method, batch, kwargs))  # waits for every rank (any rank's error surfaces)
        parts = [outs[r] for r in self.collect_ranks]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def update(self, method: str, batch: Any, **kwargs: Any) -> dict[str, float]:
        """``method`` (an update) on every rank; the globally reduced metrics of rank 0."""
        import ray

        return ray.get(self._dispatch(method, batch, kwargs))[0]

    def compute_log_prob(self, batch: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """``log_probs [B, R]`` (and ``entropys`` with ``calculate_entropy=True``) of the global batch."""
        return self.collect("compute_log_prob", batch, **kwargs)

    def compute_values(self, batch: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Critic ``values [B, R]`` of the global batch."""
        return self.collect("compute_values", batch, **kwargs)

    def compute_topk_log_probs(self, batch: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """``topk_log_probs`` / ``topk_ids [B, R, k]`` of the global batch (a distillation teacher's
        side of ``forward_kl_topk``; pass ``k=`` and the student's ``temperature=``)."""
        return self.collect("compute_topk_log_probs", batch, **kwargs)

    def compute_rm_score(self, batch: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Reward-model ``rm_scores [B]`` (the scalar head at each sequence's last valid token)."""
        return self.collect("compute_rm_score", batch, **kwargs)

    def update_policy(self, batch: Any, **kwargs: Any) -> dict[str, float]:
        """One actor update on the global batch; ``distillation_loss=`` (a ``DistillationLossConfig``)
        adds the on-policy distillation loss over the batch's teacher fields."""
        return self.update("update_policy", batch, **kwargs)

    def update_critic(self, batch: Any) -> dict[str, float]:
        """One critic update on the global batch; returns ``critic/*`` metrics."""
        return self.update("update_critic", batch)

    # -- state ----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> str:
        """Every rank saves its shard of model + optimizer state into one dist checkpoint at ``path``."""
        import ray

        return ray.get([w.save_checkpoint.remote(str(path)) for w in self.workers])[0]

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Every rank loads ``path`` (saved at any layout)."""
        import ray

        ray.get([w.load_checkpoint.remote(str(path), load_optimizer) for w in self.workers])

    def shutdown(self) -> None:
        """Tear the ranks down and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # noqa: BLE001 - best effort: the actors are killed next anyway
            pass
        for w in self.workers:
            ray.kill(w)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
