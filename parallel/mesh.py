"""Set up Megatron-Core's process groups for a ``ParallelConfig`` and hand them out explicitly.

``init_mesh(config)`` validates the layout against the world size (before any group exists),
applies the CPU redirects where CUDA is absent, initialises ``megatron.core.parallel_state``
(gloo on CPU, NCCL on GPU), seeds Megatron's RNG tracker, and returns a ``Mesh``: the process
groups as attributes (``mesh.tp_group``, ``mesh.dp_group`` ...), ranks and sizes, and Megatron's
``ProcessGroupCollection`` for modules that accept ``pg_collection``. Callers pass groups down
instead of reading ``parallel_state`` globals deep inside math. ``destroy_mesh()`` tears it down
so another layout can be initialised in the same processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.config import ParallelConfig
from parallel.netbind import pin_interfaces, store_from_env

__all__ = ["Mesh", "init_mesh", "destroy_mesh", "DEFAULT_SEED"]

DEFAULT_SEED = 1234

# Mesh attribute -> short name used by ``Mesh.size/rank/ranks``.
_GROUP_NAMES = ("tp", "pp", "dp", "cp", "dp_cp", "ep", "etp", "expert_dp", "mp", "embd")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The process groups of one parallel layout, for this rank.

    Groups are ``torch.distributed`` process groups; ``dp_group`` is data parallel without CP,
    ``dp_cp_group`` with it (gradients are reduced over the latter), ``etp_group`` /
    ``expert_dp_group`` are the expert-tensor and expert-data parallel groups, ``mp_group`` is
    Megatron's model-parallel group (TP x PP; CP ranks are not in it) and ``embd_group`` the
    first + last pipeline stage group that ties embeddings (``None`` on middle stages).
    ``pg_collection`` is Megatron's ``ProcessGroupCollection`` over the same groups.
    """

    config: ParallelConfig
    rank: int
    world_size: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    cp_group: Any
    dp_cp_group: Any
    ep_group: Any
    etp_group: Any
    expert_dp_group: Any
    mp_group: Any
    embd_group: Any
    pg_collection: Any
    seed: int
    owns_default_group: bool = False
    """True when ``init_mesh`` created the default process group (``destroy_mesh`` then ends it)."""

    def group(self, name: str) -> Any:
        """Process group by short name: tp, pp, dp, cp, dp_cp, ep, etp, expert_dp, mp, embd."""
        if name not in _GROUP_NAMES:
            raise ValueError(f"group name {name!r} is not allowed; choose one of {list(_GROUP_NAMES)}")
        return getattr(self, f"{name}_group")

    def size(self, name: str) -> int:
        """Number of ranks in group ``name`` (0 if this rank is in none, e.g. ``embd`` mid-pipeline)."""
        group = self.group(name)
        return 0 if group is None else dist.get_world_size(group)

    def rank_in(self, name: str) -> int:
        """This rank's index inside group ``name`` (-1 if it is in none)."""
        group = self.group(name)
        return -1 if group is None else dist.get_rank(group)

    def ranks(self, name: str) -> list[int]:
        """Global ranks of group ``name``, in group order ([] if this rank is in none)."""
        group = self.group(name)
        return [] if group is None else list(dist.get_process_group_ranks(group))

    @property
    def tp_rank(self) -> int:
        """Rank inside the tensor-parallel group."""
        return self.rank_in("tp")

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.rank_in("pp")

    @property
    def dp_rank(self) -> int:
        """Rank inside the data-parallel group (without CP)."""
        return self.rank_in("dp")

    @property
    def cp_rank(self) -> int:
        """Rank inside the context-parallel group."""
        return self.rank_in("cp")

    @property
    def ep_rank(self) -> int:
        """Rank inside the expert-parallel group."""
        return self.rank_in("ep")

    @property
    def is_first_pp_stage(self) -> bool:
        """Holds the embedding (pipeline stage 0)."""
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        """Holds the output layer and computes the loss (last pipeline stage)."""
        return self.pp_rank == self.size("pp") - 1

    def sizes(self) -> dict[str, Optional[int]]:
        """Group sizes of this layout (same keys as ``ParallelConfig.sizes``)."""
        return self.config.sizes(self.world_size)

    def describe(self) -> str:
        """One line with this rank's coordinates, for logs."""
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.size('tp')} "
            f"pp {self.pp_rank}/{self.size('pp')} cp {self.cp_rank}/{self.size('cp')} "
            f"dp {self.dp_rank}/{self.size('dp')} ep {self.ep_rank}/{self.size('ep')}"
        )


def _env_world_size() -> int:
    if "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "init_mesh: torch.distributed is not initialised and WORLD_SIZE is not set; start the "
            "ranks with torchrun / parallel.testing.run_distributed or initialise the process group first"
        )
    return int(os.environ["WORLD_SIZE"])


def init_mesh(
    config: ParallelConfig | Any,
    *,
    backend: Optional[str] = None,
    seed: int = DEFAULT_SEED,
    timeout_minutes: int = 30,
    **model_dims: Any,
) -> Mesh:
    """Initialise Megatron-Core's parallel state for ``config`` and return this rank's ``Mesh``.

    ``config`` is a ``ParallelConfig`` or a mapping with its keys. ``model_dims`` are forwarded
    to ``ParallelConfig.validate`` (``num_layers``, ``num_attention_heads``, ``num_query_groups``,
    ``num_experts`` ...), which runs before any process group is created. If
    ``torch.distributed`` is not initialised yet, the default group is created from the
    environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``) with ``backend``
    (default gloo without CUDA, NCCL with it); rank 0's store listens on ``MASTER_ADDR`` only
    (``parallel.netbind.tcp_store``), and a loopback master keeps gloo/NCCL on its interface.
    Without CUDA, ``apply_cpu_compat()`` is applied first. ``seed`` seeds Megatron's RNG tracker (``model_parallel_cuda_manual_seed``), so a model
    built right after is deterministic for a given layout.
    """
    config = ParallelConfig.from_dict(config)
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not allowed; choose 'gloo', 'nccl' or None")
    world_size = dist.get_world_size() if dist.is_initialized() else _env_world_size()
    config.validate(world_size, **model_dims)
    if dist.is_initialized() and backend is not None and dist.get_backend() != backend:
        raise ValueError(
            f"backend={backend!r} but torch.distributed is already initialised with {dist.get_backend()!r}"
        )

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised; call destroy_mesh() first")

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        from parallel.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())

    owns_default_group = False
    if not dist.is_initialized():
        backend = backend or ("nccl" if has_cuda else "gloo")
        rendezvous = store_from_env(datetime.timedelta(minutes=timeout_minutes))
        if rendezvous is None:
            dist.init_process_group(backend=backend)
        else:  # rank 0's store listens on MASTER_ADDR only (torch's own binds every interface)
            store, rank, world_size = rendezvous
            pin_interfaces(os.environ["MASTER_ADDR"])  # a loopback master: gloo/NCCL pairs on lo too
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
        owns_default_group = True

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=config.effective_expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    model_parallel_cuda_manual_seed(seed)

    ps = parallel_state
    return Mesh(
        config=config,
        rank=dist.get_rank(),
        world_size=world_size,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        # None on middle pipeline stages: only the first and last stage share the embedding.
        embd_group=ps.get_embedding_group(check_initialized=False),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        seed=seed,
        owns_default_group=owns_default_group,
    )


def destroy_mesh(mesh: Optional[Mesh] = None) -> None:
    """Tear down Megatron's parallel state (and the default group if ``mesh`` created it).

    Afterwards ``init_mesh`` can set up another layout in the same processes.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if mesh is not None and mesh.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
