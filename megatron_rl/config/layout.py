"""``*.megatron``: how one Megatron model is laid out and kept, the section of every role that runs a
Megatron model (actor, reference, critic, reward model, teacher), with its router replay (verl's
``McoreEngineConfig`` / ``EngineRouterReplayConfig`` keys), and the checks that tie it to a role's optimizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from megatron_rl.config.base_config import BaseConfig, check_choice
from parallel.config import ParallelConfig

__all__ = ["RouterReplayConfig", "MegatronConfig", "PARALLEL_KEYS", "check_rollout_n", "check_distributed_optimizer"]

PARALLEL_KEYS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
"""The layout keys of ``MegatronConfig`` (the fields of ``parallel.config.ParallelConfig``)."""
_DTYPES = (None, "float32", "bfloat16", "float16")


@dataclasses.dataclass
class RouterReplayConfig(BaseConfig):
    """``*.megatron.router_replay``: pin an MoE model's routing (verl's ``EngineRouterReplayConfig``;
    ``megatron_rl.engine.router_replay``)."""

    mode: str = "disabled"
    """``disabled``; ``R2``: the update (and a reference set to R2) replays the experts the actor's
    old-log-prob pass chose; ``R3``: every actor / reference pass replays the rollout engine's
    experts (needs vLLM's routed-experts output)."""
    record_file: Optional[str] = None
    """Actor only: save each step's replayed routing (``routed_experts`` with ``input_ids`` and
    ``attention_mask``) with ``torch.save`` to this path (``{step}`` is replaced by the step; without
    it the file is overwritten every step)."""
    replay_file: Optional[str] = None
    """verl's key, read nowhere (see ``INERT_KEYS``): replay always uses the step's own routing."""

    def __post_init__(self) -> None:
        check_choice("megatron.router_replay.mode", self.mode, ("disabled", "R2", "R3"))

    @property
    def enabled(self) -> bool:
        """Replay is on (R2 or R3): the engine builds Megatron's router replay."""
        return self.mode != "disabled"


@dataclasses.dataclass
class MegatronConfig(BaseConfig):
    """``*.megatron``: how one Megatron model is laid out and kept (verl's ``McoreEngineConfig`` keys)."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that split each weight matrix."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline rank (interleaved 1F1B); None = no interleaving."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split the routed experts."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: tensor parallelism inside each expert; None = TP."""
    context_parallel_size: int = 1
    """CP: ranks that split the sequence (needs TransformerEngine attention, i.e. a GPU)."""
    sequence_parallel: bool = True
    """Shard norms/dropout activations over TP (only acts with TP > 1; always on for MoE under TP)."""
    param_offload: bool = False
    """Keep parameters in host memory while this role is idle."""
    grad_offload: bool = False
    """Keep gradient buffers in host memory while this role is idle."""
    optimizer_offload: bool = False
    """Keep optimizer state in host memory while this role is idle."""
    use_distributed_optimizer: bool = True
    """Shard a trainable role's optimizer state (Adam moments, fp32 masters) over data parallelism
    (Megatron's ZeRO-1 ``DistributedOptimizer``; on CPU through ``parallel.cpu_compat``), as verl's
    default. At DP=1 it steps like the plain optimizer up to float32 rounding (it sums the gradient
    norm in another order); Adam only (``optim.optimizer=sgd`` needs False). Megatron pads each bucket
    to a multiple of lcm(DP, 128), so every DP size shards evenly."""
    dtype: Optional[str] = None
    """Training dtype (the workers' ``params_dtype``): ``float32``, ``bfloat16`` or ``float16``; None =
    the model's: an inline model's ``params_dtype``, ``float32`` for an HF checkpoint (its stored
    dtype is not used; set ``bfloat16`` for GPU runs, as the GPU recipes do)."""
    seed: int = 42
    """Seed of Megatron's model-parallel RNG (weight init of from-scratch models, dropout)."""
    override_transformer_config: dict = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields (e.g. ``recompute_granularity: full``)."""
    use_remove_padding: bool = True
    """Pack each micro-batch's rows into one THD sequence (no FLOPs on padding; RoPE restarts and
    attention stops at every row); False pads rows to the micro-batch's longest."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE router replay (R2 / R3) of the actor and the reference."""

    def __post_init__(self) -> None:
        self.parallel()  # ParallelConfig's ValueError names the field and its allowed values
        check_choice("megatron.dtype", self.dtype, _DTYPES)

    def parallel(self) -> ParallelConfig:
        """The model-parallel layout as a ``parallel.config.ParallelConfig``."""
        return ParallelConfig(**{k: getattr(self, k) for k in PARALLEL_KEYS})


def check_rollout_n(value: int) -> None:
    """``rollout_n`` is copied from ``actor_rollout_ref.rollout.n``: report it under the key users set."""
    if isinstance(value, int) and value < 1:
        raise ValueError(f"actor_rollout_ref.rollout.n={value} is out of range (samples per prompt); allowed: [1, inf)")


def check_distributed_optimizer(where: str, megatron: "MegatronConfig", optim: Any) -> None:
    """Megatron's ``DistributedOptimizer`` shards Adam's state and refuses any other optimizer (an
    assertion inside the workers, after allocation): name the keys here instead."""
    if megatron.use_distributed_optimizer and optim.optimizer != "adam":
        raise ValueError(
            f"{where}.megatron.use_distributed_optimizer=True is not allowed with {where}.optim.optimizer="
            f"{optim.optimizer!r}: Megatron's DistributedOptimizer shards only Adam's state; set "
            f"{where}.megatron.use_distributed_optimizer=False or {where}.optim.optimizer=adam"
        )
