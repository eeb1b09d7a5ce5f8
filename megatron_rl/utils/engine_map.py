"""Rollout replica arithmetic: how many vLLM engines a run starts and which GPUs each one uses.

One pure module (no Ray, no torch) read by both ``megatron-rl plan`` and the trainer's placement
(``megatron_rl.trainer.placement``), so the plan's engine map is the one the run builds.

An engine is ``tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size``
GPUs (``expert_parallel_size`` is vLLM's expert parallelism over the engine's TP x DP ranks and,
as verl requires, equals TP x DP when above 1). The rollout's GPUs are the trainer's
(``trainer.nnodes x trainer.n_gpus_per_node``) when colocated, its own pool
(``actor_rollout_ref.rollout.nnodes x n_gpus_per_node``) when separate; replicas = GPUs / engine.
An engine stays inside one node unless it is larger than a node; then it spans whole nodes (vLLM's
multi-node mode). GPUs are numbered node-major (GPU ``g`` is ``(g // gpus_per_node, g % gpus_per_node)``)
and engine ``r`` takes GPUs ``[r*E, (r+1)*E)``: consecutive GPUs of one node, or whole consecutive
nodes. A separate pool's nodes are numbered after the trainer's (they are other machines of the
cluster). Colocated engine ``r`` shares its GPUs with training ranks ``[r*E, (r+1)*E)`` of every role.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["EngineMap", "engine_map", "engine_weight_bytes_per_gpu", "rollout_engine_map", "rollout_layout"]

_R = "actor_rollout_ref.rollout"


@dataclasses.dataclass(frozen=True)
class EngineMap:
    """Where the rollout's engines run (see the module docstring)."""

    engine_gpus: int
    """GPUs per engine (TP x DP x PP)."""
    replicas: int
    """Engines the run starts."""
    nodes_per_engine: int
    """Nodes one engine spans (1 unless it is larger than a node)."""
    engines: tuple
    """Per engine, in replica order, its ``(node, gpu)`` pairs in the engine's rank order."""
    colocated: bool
    """True: the engines share the training ranks' GPUs (rank g of every role on GPU g)."""
    first_node: int = 0
    """Index of the pool's first node (a separate pool follows the trainer's nodes)."""

    def to_json(self) -> dict:
        """``{"engine_gpus", "replicas", "nodes_per_engine", "engines": [[[node, gpu], ...], ...]}``."""
        return {
            "engine_gpus": self.engine_gpus,
            "replicas": self.replicas,
            "nodes_per_engine": self.nodes_per_engine,
            "engines": [[list(pair) for pair in engine] for engine in self.engines],
        }

    def training_ranks(self, replica: int) -> range:
        """The training ranks (of every colocated role) that share engine ``replica``'s GPUs; empty when separate."""
        if not self.colocated:
            return range(0)
        return range(replica * self.engine_gpus, (replica + 1) * self.engine_gpus)

    def describe(self) -> list[str]:
        """One line per engine (at most 8, then a count): its nodes and GPUs and the ranks sharing them."""
        lines = []
        for r, engine in enumerate(self.engines[:8]):
            by_node: dict[int, list[int]] = {}
            for node, gpu in engine:
                by_node.setdefault(node, []).append(gpu)
            where = ", ".join(f"node {n} GPU{'s' if len(g) > 1 else ''} {_span(g)}" for n, g in by_node.items())
            ranks = self.training_ranks(r)
            share = f" (shared with training ranks {_span(list(ranks))} of every role)" if ranks else " (own pool)"
            lines.append(f"engine {r}: {where}{share}")
        if len(self.engines) > 8:
            lines.append(f"... +{len(self.engines) - 8} more engines")
        return lines


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def engine_map(
    *,
    tp: int,
    dp: int = 1,
    pp: int = 1,
    ep: int = 1,
    nodes: int,
    gpus_per_node: int,
    colocated: bool = True,
    first_node: int = 0,
    nodes_key: str = "trainer.nnodes",
    gpus_key: str = "trainer.n_gpus_per_node",
) -> EngineMap:
    """The ``EngineMap`` of engines of ``tp x dp x pp`` GPUs over ``nodes x gpus_per_node`` GPUs.
    ``ValueError`` naming the keys and numbers for a layout that does not divide (``nodes_key`` /
    ``gpus_key`` name where the pool's size comes from)."""
    for key, value in (
        ("tensor_model_parallel_size", tp),
        ("data_parallel_size", dp),
        ("pipeline_model_parallel_size", pp),
        ("expert_parallel_size", ep),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{_R}.{key}={value!r} must be an integer >= 1")
    for key, value in ((nodes_key, nodes), (gpus_key, gpus_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: the rollout's pool needs at least one node of one GPU")
    if ep > 1 and ep != tp * dp:
        raise ValueError(
            f"{_R}.expert_parallel_size={ep} must equal tensor_model_parallel_size x data_parallel_size "
            f"= {tp}x{dp} = {tp * dp} (vLLM's expert parallelism spans the engine's TP x DP ranks, "
            "as verl requires), or be 1"
        )
    size = tp * dp * pp
    what = (
        f"an engine of {size} GPUs ({_R}.tensor_model_parallel_size x data_parallel_size x "
        f"pipeline_model_parallel_size = {tp}x{dp}x{pp})"
    )
    if size <= gpus_per_node and gpus_per_node % size:
        raise ValueError(
            f"{what} does not divide {gpus_key}={gpus_per_node}: an engine no larger than a node "
            f"stays inside one node; use an engine size dividing {gpus_per_node}"
        )
    if size > gpus_per_node and size % gpus_per_node:
        raise ValueError(
            f"{what} is larger than a node of {gpus_key}={gpus_per_node} GPUs but not a multiple of "
            "it: an engine larger than a node spans whole nodes"
        )
    span = max(1, size // gpus_per_node)
    if nodes % span:
        raise ValueError(f"{what} spans {span} whole nodes, which does not divide {nodes_key}={nodes}")
    total = nodes * gpus_per_node
    if size > total:  # covered by the span rule (span > nodes), kept as the invariant the loop needs
        raise ValueError(
            f"{what} exceeds the rollout's {total} GPUs ({nodes_key} x {gpus_key} = {nodes}x{gpus_per_node})"
        )
    replicas = total // size
    engines = tuple(
        tuple((first_node + g // gpus_per_node, g % gpus_per_node) for g in range(r * size, (r + 1) * size))
        for r in range(replicas)
    )
    return EngineMap(
        engine_gpus=size,
        replicas=replicas,
        nodes_per_engine=span,
        engines=engines,
        colocated=colocated,
        first_node=first_node,
    )


def engine_weight_bytes_per_gpu(
    total_bytes: int, expert_bytes: int, *, tp: int, dp: int = 1, pp: int = 1, ep: int = 1
) -> int:
    """One GPU's share of an engine's weights (``total_bytes`` of the whole model, ``expert_bytes`` of
    them in routed experts). Every DP rank of an engine holds its own copy of the TP x PP-sharded dense
    weights; routed experts are TP x PP-sharded too unless vLLM's expert parallelism is on (``ep`` > 1,
    = TP x DP), which spreads them over the engine's EP x PP GPUs instead."""
    if not 0 <= expert_bytes <= total_bytes:
        raise ValueError(f"expert_bytes={expert_bytes} must lie in [0, total_bytes={total_bytes}]")
    expert_ways = (ep if ep > 1 else tp) * pp
    return (total_bytes - expert_bytes) // (tp * pp) + expert_bytes // expert_ways


def rollout_engine_map(config: Any) -> EngineMap:
    """``engine_map`` of a ``RunConfig`` (read by attribute): colocated on the trainer's GPUs
    unless ``actor_rollout_ref.rollout.nnodes`` >= 1 gives the rollout its own pool (separate_async).
    On CPU a "GPU" is one rank's slot: the colocated rollout has ``trainer.world_size`` of them and a
    separate one ``n_gpus_per_node`` CPUs on its one node."""
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    tp, dp = rollout.tensor_model_parallel_size, getattr(rollout, "data_parallel_size", 1)
    pp, ep = getattr(rollout, "pipeline_model_parallel_size", 1), getattr(rollout, "expert_parallel_size", 1)
    if rollout.nnodes > 0:
        return engine_map(
            tp=tp,
            dp=dp,
            pp=pp,
            ep=ep,
            nodes=rollout.nnodes,
            gpus_per_node=rollout.n_gpus_per_node,
            colocated=False,
            first_node=trainer.nnodes,
            nodes_key=f"{_R}.nnodes",
            gpus_key=f"{_R}.n_gpus_per_node",
        )
    return engine_map(tp=tp, dp=dp, pp=pp, ep=ep, nodes=trainer.nnodes, gpus_per_node=trainer.n_gpus_per_node)


def rollout_layout(config: Any) -> EngineMap:
    """The engines a run starts (``RunConfig`` read by attribute). On GPUs
    ``rollout_engine_map``, with ``actor_rollout_ref.rollout.num_replicas`` refused when it differs.
    On CPU there are no GPUs to divide: ``num_replicas`` engines (default 1) of TP slots each, on node 0
    (colocated) or the separate pool's node."""
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    wanted = getattr(rollout, "num_replicas", None)
    if trainer.device == "cuda":
        layout = rollout_engine_map(config)
        if wanted is not None and wanted != layout.replicas:
            raise ValueError(
                f"{_R}.num_replicas={wanted}, but the rollout's GPUs hold {layout.replicas} engine(s) of "
                f"{layout.engine_gpus} GPUs; on GPUs leave num_replicas unset (it is the arithmetic's)"
            )
        return layout
    tp = rollout.tensor_model_parallel_size
    separate = rollout.nnodes > 0
    return engine_map(
        tp=tp,
        nodes=1,
        gpus_per_node=(wanted or 1) * tp,
        colocated=not separate,
        first_node=trainer.nnodes if separate else 0,
    )
