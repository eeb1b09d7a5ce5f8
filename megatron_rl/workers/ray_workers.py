"""Ray actors for the single controller: Megatron worker groups (actor / ref / critic / reward /
teacher) and rollout.

``MegatronWorkerGroup`` starts one Ray actor per rank of a Megatron layout (world size =
TP x PP x CP x DP x ...), in a placement group of one bundle per rank. Each actor sets the
``torch.distributed`` environment (rank 0's address and a free port, chosen on rank 0's node),
initialises the mesh (``parallel.mesh.init_mesh``), builds a ``MegatronEngine`` and, given an HF
checkpoint directory, loads its weights through the bridge. The group's methods take the
*global* batch (a dict of tensors, verl's field names) and:

* dispatch: split it into ``dp`` equal contiguous shards; every TP/PP/CP rank of data-parallel
  replica ``d`` receives shard ``d`` (one ``ray.put`` per shard, shared by those ranks);
* collect: take the result of one rank per DP replica (``tp_rank == 0``, ``cp_rank == 0``, the
  last pipeline stage), concatenated in DP-rank order -- the global batch order. Update calls
  return the metrics dict of global rank 0 (the engine already reduces them over DP).

``RolloutWorker`` wraps ``VLLMRollout`` in an actor. Weight sync without an extra copy through
the driver: ``group.export_weights()`` returns an ``ObjectRef`` to rank 0's list of
``(hf_name, tensor)`` (``HFExporter.iter_weights(all_ranks=False)``: the other ranks send their
shards to rank 0), which is passed straight into ``RolloutWorker.update_weights``.

On CPU, bundles ask for fractional CPUs (``num_cpus_per_worker``), so more actors than cores
can start; each actor limits torch to ``max(1, round(num_cpus))`` threads.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_rl.algos.utils import cfg_get

__all__ = ["MegatronWorker", "MegatronWorkerGroup", "RolloutWorker", "split_for_dp", "tensor_fields", "free_port"]

ROLES = ("actor", "ref", "critic", "reward", "teacher")
"""``actor`` (trainable policy), ``ref`` (frozen policy), ``critic`` (trainable scalar head), ``reward``
(frozen scalar head: an HF ``*ForSequenceClassification`` reward model), ``teacher`` (frozen LM of
on-policy distillation: any size, the student's vocabulary)."""
_ENGINE_ROLES = {"actor": "actor", "ref": "actor", "teacher": "actor", "critic": "critic", "reward": "reward"}
_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
"""The batch fields a forward-only pass (log-probs, values, scores) sends to the ranks."""


def free_port() -> int:
    """A TCP port that was free on this node a moment ago."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def tensor_fields(batch: Mapping[str, Any], keys: Optional[Sequence[str]] = None) -> dict[str, torch.Tensor]:
    """The tensor fields of ``batch`` (only ``keys`` when given) -- what Megatron ranks need."""
    return {k: v for k, v in batch.items() if torch.is_tensor(v) and (keys is None or k in keys)}


def split_for_dp(batch: Mapping[str, torch.Tensor], dp: int) -> list[dict[str, torch.Tensor]]:
    """``dp`` contiguous equal shards of a tensor batch (dim 0); ValueError if it does not divide."""
    sizes = {k: int(v.shape[0]) for k, v in batch.items()}
    if not sizes:
        raise ValueError("batch has no tensor fields to dispatch")
    n = next(iter(sizes.values()))
    if any(s != n for s in sizes.values()):
        raise ValueError(f"batch fields disagree on the batch size: {sizes}")
    if n % dp:
        raise ValueError(f"batch of {n} samples is not divisible by the data-parallel size {dp}")
    return [{k: v.chunk(dp)[d].contiguous() for k, v in batch.items()} for d in range(dp)]


def _plain(config: Any) -> Any:
    """DictConfig -> plain containers (picklable, and what typed configs' ``from_dict`` take)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return config


def _parallel_config(parallel: Any):
    """A ``ParallelConfig`` from one, from a ``MegatronConfig`` (verl's ``megatron`` section) or a mapping."""
    from megatron_rl.config.sections import MegatronConfig
    from parallel.config import ParallelConfig

    if isinstance(parallel, ParallelConfig):
        return parallel
    if isinstance(parallel, MegatronConfig):
        return parallel.parallel()
    return MegatronConfig.from_dict(_plain(parallel)).parallel()


# ----------------------------------------------------------------------------- one rank
class MegatronWorker:
    """One rank of a Megatron role (wrapped as a Ray actor by ``MegatronWorkerGroup``)."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(max(1, num_threads))
        self.engine = self.mesh = self._exporter = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port (asked of rank 0 for ``MASTER_ADDR/PORT``)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init_engine(self, master_addr: str, master_port: int, role: str, parallel: Mapping, engine_config: Any,
                    model_config: Any = None, hf_dir: Optional[str] = None, model_overrides: Optional[Mapping] = None,
                    seed: int = 42, transformer_overrides: Optional[Mapping] = None) -> dict[str, int]:
        """Join the group, build the engine (and load ``hf_dir``); return this rank's coordinates."""
        from megatron_rl.models.families import get_family, hf_head
        from megatron_rl.models.gpt import ModelConfig
        from megatron_rl.workers.engine import MegatronEngine
        from parallel.bridge import load_hf_checkpoint
        from parallel.config import ParallelConfig
        from parallel.mesh import init_mesh

        pc = ParallelConfig.from_dict(parallel)
        self.weight_map = None
        if hf_dir is not None:
            family = get_family(hf_dir)
            model_cfg = family.model_config(hf_dir, **dict(model_overrides or {}))
            head = hf_head(hf_dir)  # "score" for a *ForSequenceClassification checkpoint
            if role == "reward" and head != "score":
                raise ValueError(f"reward: {hf_dir} is not a reward model; it needs an HF *ForSequenceClassification "
                                 "checkpoint with num_labels=1 (its score.weight becomes the scalar head)")
            if role in ("actor", "ref", "teacher") and head != "lm":
                raise ValueError(f"{role}: {hf_dir} is a *ForSequenceClassification checkpoint (no lm_head); "
                                 "this role needs a causal LM")
            self.weight_map = family.weight_map(model_cfg, head=head)
        else:
            model_cfg = model_config if isinstance(model_config, ModelConfig) else ModelConfig.from_dict(model_config)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        self.mesh = init_mesh(pc, seed=seed)
        self.engine = MegatronEngine(model_cfg, pc, role=_ENGINE_ROLES[role], config=engine_config,
                                     trainable=role in ("actor", "critic"), transformer_overrides=transformer_overrides)
        if hf_dir is not None:
            # A critic from a causal LM keeps its value head's fresh initialisation; one from a
            # reward model (verl's usual PPO start) loads the score head.
            ignore = (r"output_layer\.",) if role == "critic" and head == "lm" else ()
            load_hf_checkpoint(self.engine.model, self.weight_map, hf_dir, mesh=self.mesh, ignore=ignore)
        m = self.mesh
        return {"rank": self.rank, "dp_rank": m.dp_rank, "dp_size": m.size("dp"), "tp_rank": m.tp_rank,
                "cp_rank": m.cp_rank, "pp_rank": m.pp_rank, "is_last_pp_stage": m.is_last_pp_stage}

    def compute_log_prob(self, batch: dict, **kwargs: Any) -> dict[str, torch.Tensor]:
        return self.engine.compute_log_prob(batch, **kwargs)

    def compute_values(self, batch: dict, **kwargs: Any) -> dict[str, torch.Tensor]:
        return self.engine.compute_values(batch, **kwargs)

    def compute_rm_score(self, batch: dict, **kwargs: Any) -> dict[str, torch.Tensor]:
        return self.engine.compute_rm_score(batch, **kwargs)

    def compute_topk_log_probs(self, batch: dict, **kwargs: Any) -> dict[str, torch.Tensor]:
        return self.engine.compute_topk_log_probs(batch, **kwargs)

    def update_policy(self, batch: dict, **kwargs: Any) -> dict[str, float]:
        return self.engine.update_policy(batch, **kwargs)

    def update_critic(self, batch: dict) -> dict[str, float]:
        return self.engine.update_critic(batch)

    def save_checkpoint(self, path: str) -> str:
        """Collective: the engine's model / optimizer / schedule / RNG to ``path`` (atomic)."""
        return self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Collective: restore ``save_checkpoint``'s state (any layout for the model and optimizer)."""
        self.engine.load_checkpoint(path, load_optimizer=load_optimizer)

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

    # -- streamed weight sync to a remote rollout worker (megatron_rl.workers.weight_sync) ------
    def weight_sync_listen(self, world_size: int, transport: str, bucket_megabytes: float,
                           dtype: Optional[str] = None) -> Optional[tuple[str, int]]:
        """Collective: build this rank's ``ActorWeightSync``; rank 0 hosts the side-band group and
        returns ``(addr, port)`` for the rollout worker, the others None."""
        import ray

        from megatron_rl.workers.weight_sync import ActorWeightSync

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

    def shutdown(self) -> None:
        from parallel.mesh import destroy_mesh

        if self.mesh is not None:
            destroy_mesh(self.mesh)
            self.mesh = None


# ----------------------------------------------------------------------------- the group
class MegatronWorkerGroup:
    """``world_size`` Ray actors running one Megatron role; methods take and return global batches.

    Args:
        role: one of ``ROLES``: ``actor``, ``ref``, ``critic``, ``reward`` or ``teacher``.
        parallel: Megatron layout (``ParallelConfig`` keys; verl's ``megatron`` section works).
        engine_config: ``ActorConfig`` (actor, ref, teacher) / ``CriticConfig`` (critic, reward), or a
            mapping with their keys.
        world_size: number of ranks (= the layout's TP x PP x CP x DP).
        hf_dir: HF checkpoint to load (and whose family names the weights on export); or
        model_config: an inline ``ModelConfig`` (random init, seeded by ``seed``).
        num_cpus_per_worker / num_gpus_per_worker: each bundle's resources.
    """

    def __init__(self, role: str, parallel: Mapping | Any, engine_config: Any, world_size: int, *,
                 hf_dir: Optional[str] = None, model_config: Any = None, model_overrides: Optional[Mapping] = None,
                 num_cpus_per_worker: float = 1.0, num_gpus_per_worker: float = 0.0, seed: int = 42,
                 name: Optional[str] = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if role not in ROLES:
            raise ValueError(f"role={role!r}; allowed: {list(ROLES)}")
        if (hf_dir is None) == (model_config is None):
            raise ValueError(f"{role}: give exactly one of hf_dir and model_config")
        if world_size < 1:
            raise ValueError(f"{role}: world_size={world_size} must be >= 1")
        self.role, self.world_size = role, world_size
        bundle = {"CPU": num_cpus_per_worker, **({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {})}
        self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK",
                                               name=f"{name or role}_pg")
        ray.get(self.placement_group.ready(), timeout=600)
        remote_cls = ray.remote(MegatronWorker)
        self.workers = [
            remote_cls.options(
                num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                     placement_group_bundle_index=rank),
            ).remote(rank, world_size, max(1, round(num_cpus_per_worker)))
            for rank in range(world_size)
        ]
        master_addr, master_port = ray.get(self.workers[0].address.remote())
        # verl's megatron.override_transformer_config (e.g. activation recompute) rides along.
        tf_overrides = _plain(cfg_get(parallel, "override_transformer_config"))
        parallel = _parallel_config(parallel)
        self.ranks = ray.get([w.init_engine.remote(master_addr, master_port, role, parallel, _plain(engine_config),
                                                   _plain(model_config), hf_dir, _plain(model_overrides), seed,
                                                   dict(tf_overrides or {}))
                              for w in self.workers])
        self.dp_size = self.ranks[0]["dp_size"]
        # One collecting rank per DP replica, in DP order.
        collect = {r["dp_rank"]: r["rank"] for r in self.ranks
                   if r["tp_rank"] == 0 and r["cp_rank"] == 0 and r["is_last_pp_stage"]}
        if sorted(collect) != list(range(self.dp_size)):
            raise RuntimeError(f"{role}: no collecting rank for DP replicas {sorted(set(range(self.dp_size)) - set(collect))}")
        self.collect_ranks = [collect[d] for d in range(self.dp_size)]

    # -- dispatch / collect -------------------------------------------------------------------
    def _dispatch(self, method: str, batch: Mapping[str, Any], keys: Sequence[str], **kwargs: Any) -> list:
        import ray

        shards = [ray.put(s) for s in split_for_dp(tensor_fields(batch, keys), self.dp_size)]
        return [getattr(w, method).remote(shards[r["dp_rank"]], **kwargs) for w, r in zip(self.workers, self.ranks)]

    def _collect_tensors(self, refs: list) -> dict[str, torch.Tensor]:
        import ray

        outs = ray.get(refs)  # wait for every rank (errors of any rank surface here)
        parts = [outs[r] for r in self.collect_ranks]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def compute_log_prob(self, batch: Mapping[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
        """``log_probs [B, R]`` (and ``entropys`` with ``calculate_entropy=True``) of the global batch."""
        return self._collect_tensors(self._dispatch("compute_log_prob", batch, _FORWARD_KEYS, **kwargs))

    def compute_values(self, batch: Mapping[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
        """Critic ``values [B, R]`` of the global batch."""
        return self._collect_tensors(self._dispatch("compute_values", batch, _FORWARD_KEYS, **kwargs))

    def compute_topk_log_probs(self, batch: Mapping[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
        """``topk_log_probs`` / ``topk_ids [B, R, k]`` of the global batch (a distillation teacher's
        side of ``forward_kl_topk``; pass ``k=`` and the student's ``temperature=``)."""
        return self._collect_tensors(self._dispatch("compute_topk_log_probs", batch, _FORWARD_KEYS, **kwargs))

    def compute_rm_score(self, batch: Mapping[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
        """Reward-model ``rm_scores [B]`` (the scalar head at each sequence's last valid token)."""
        return self._collect_tensors(self._dispatch("compute_rm_score", batch, _FORWARD_KEYS, **kwargs))

    def update_policy(self, batch: Mapping[str, Any], **kwargs: Any) -> dict[str, float]:
        """One actor update on the global batch; returns the engine's (globally reduced) metrics.

        ``distillation_loss=`` (verl's ``distillation`` section or its ``distillation_loss``) turns on
        the on-policy distillation loss over the batch's ``teacher_log_probs [B, R]``."""
        import ray

        keys = (*_FORWARD_KEYS, "old_log_probs",
                "advantages", "ref_log_prob", "rollout_is_weights", "teacher_log_probs", "teacher_topk_log_probs",
                "teacher_topk_ids")
        kwargs = {k: _plain(v) for k, v in kwargs.items()}
        return ray.get(self._dispatch("update_policy", batch, keys, **kwargs))[0]

    def update_critic(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One critic update on the global batch; returns ``critic/*`` metrics."""
        import ray

        keys = (*_FORWARD_KEYS, "values", "returns")
        return ray.get(self._dispatch("update_critic", batch, keys))[0]

    def save_checkpoint(self, path: str) -> str:
        """Every rank saves its shard of model + optimizer state into one dist checkpoint at ``path``."""
        import ray

        return ray.get([w.save_checkpoint.remote(str(path)) for w in self.workers])[0]

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Every rank loads ``path`` (saved at any layout)."""
        import ray

        ray.get([w.load_checkpoint.remote(str(path), load_optimizer) for w in self.workers])

    def connect_weight_sync(self, rollout, transport: str = "broadcast", bucket_megabytes: float = 128.0,
                            dtype: Optional[str] = None) -> None:
        """Join actor rank 0 and the ``RolloutWorker`` actor ``rollout`` in a gloo side band
        (``transport`` ``broadcast`` or ``shm``, the latter when both share a node); afterwards
        ``sync_weights(rollout)`` streams the weights without gathering the model anywhere."""
        import ray

        world = 1 + int(ray.get(rollout.tensor_parallel_size.remote()))
        listened = ray.get([w.weight_sync_listen.remote(world, transport, bucket_megabytes, dtype) for w in self.workers])
        addr, port = listened[0]
        ray.get([w.weight_sync_connect.remote() for w in self.workers] + [rollout.weight_sync_connect.remote(addr, port, world)])

    def sync_weights(self, rollout) -> dict[str, Any]:
        """One streamed sync into ``rollout`` (after ``connect_weight_sync``): rank 0's stats
        merged with the receiver's."""
        import ray

        sent = [w.weight_sync.remote() for w in self.workers]
        received = rollout.weight_sync_receive.remote()
        out = ray.get(sent)[0]
        return {**out, "receiver_seconds": ray.get(received)["seconds"]}

    def export_weights(self, bucket_bytes: int = 1 << 28, dtype: Optional[str] = None):
        """ObjectRef to rank 0's HF ``(name, tensor)`` list (all ranks take part in the gather)."""
        refs = [w.export_weights.remote(bucket_bytes, dtype) for w in self.workers]
        return refs[0]

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
        remove_placement_group(self.placement_group)


# ----------------------------------------------------------------------------- rollout
class RolloutWorker:
    """A ``VLLMRollout`` inside a Ray actor (create with ``ray.remote(RolloutWorker)``)."""

    def __init__(self, model_path: str, config: Any = None, tokenizer_path: Optional[str] = None,
                 num_threads: int = 1):
        from megatron_rl.workers.rollout import VLLMRollout

        torch.set_num_threads(max(1, num_threads))
        self.rollout = VLLMRollout(model_path, _plain(config), tokenizer_path=tokenizer_path)

    def generate(self, prompts: Any, **kwargs: Any) -> dict[str, Any]:
        """``VLLMRollout.generate``: the verl-layout rollout batch."""
        return self.rollout.generate(prompts, **kwargs)

    def update_weights(self, weights: list, **kwargs: Any) -> dict[str, Any]:
        """``VLLMRollout.update_weights`` from a list of HF ``(name, tensor)`` pairs."""
        if weights is None:
            raise ValueError("update_weights got None: pass the export of global rank 0")
        return self.rollout.update_weights(weights, **kwargs)

    def pad_token_id(self) -> int:
        return self.rollout.pad_token_id

    def tensor_parallel_size(self) -> int:
        return int(self.rollout.config.tensor_model_parallel_size)

    def weight_sync_connect(self, addr: str, port: int, world_size: int) -> list[int]:
        """Join actor rank 0's side-band group (``MegatronWorkerGroup.connect_weight_sync``)."""
        from megatron_rl.workers.weight_sync import RolloutWeightReceiver

        self._receiver = RolloutWeightReceiver(self.rollout, addr, port, world_size)
        return self._receiver.connect()

    def weight_sync_receive(self) -> dict[str, Any]:
        """Receive one streamed sync (runs while the actor ranks run ``weight_sync``)."""
        return self._receiver.receive()

    def shutdown(self) -> None:
        self.rollout.shutdown()


def create_rollout_worker(model_path: str, config: Any = None, *, tokenizer_path: Optional[str] = None,
                          num_cpus: float = 1.0, num_gpus: float = 0.0):
    """Start a ``RolloutWorker`` actor in its own placement group; returns ``(actor, placement_group)``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    pg = placement_group([bundle], name="rollout_pg")
    ray.get(pg.ready(), timeout=600)
    actor = ray.remote(RolloutWorker).options(
        num_cpus=num_cpus, num_gpus=num_gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote(model_path, _plain(config), tokenizer_path, max(1, round(num_cpus)))
    return actor, pg
