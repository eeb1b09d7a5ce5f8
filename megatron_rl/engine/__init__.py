"""The role-agnostic Megatron engine: one model's chunks, optimizer and schedule on this rank.

``MegatronEngine`` (``engine.py``) runs caller-supplied closures over Megatron's schedule:
``forward(batch, fn)`` and ``train_step(mini_batch, loss_fn)``. ``batching.py`` forms the
micro-batches (fixed sizes, token budgets, Karmarkar-Karp partitions); ``packing.py`` turns a
micro-batch into one packed THD sequence (the default), ``batch_layout.py`` into padded, left-aligned
rows (with CP shares), and defines the ``ModelOutput`` the closures see for both; ``metrics.py``
the ``StepInfo`` / ``LossMetrics`` protocol of a training step; ``ddp_optimizer.py`` DDP + optimizer + LR
schedule; ``offload.py`` host offload of parameters, gradient buffers and optimizer state. Roles live above, in ``megatron_rl.roles``.
"""

from megatron_rl.engine.batching import MicroBatchPlan, balanced_partitions, token_budget_micro_batches
from megatron_rl.engine.engine import HEADS, ForwardFn, LossFn, MegatronEngine
from megatron_rl.engine.batch_layout import Layout, ModelOutput, left_align, response_positions
from megatron_rl.engine.step_info import LossMetrics, StepInfo
from megatron_rl.engine.packing import PackedLayout, pack_micro_batch

__all__ = [
    "MegatronEngine",
    "HEADS",
    "ForwardFn",
    "LossFn",
    "ModelOutput",
    "Layout",
    "PackedLayout",
    "StepInfo",
    "LossMetrics",
    "MicroBatchPlan",
    "balanced_partitions",
    "token_budget_micro_batches",
    "pack_micro_batch",
    "left_align",
    "response_positions",
]
