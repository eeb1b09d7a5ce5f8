"""A trainable engine's Megatron pieces: DDP-wrapped chunks, the optimizer and the LR schedule.

Gradients go through Megatron's ``DistributedDataParallel`` (fp32 gradient buffers, reduced over
DP x CP by ``finalize_model_grads`` at the end of the schedule); the optimizer is
``get_megatron_optimizer`` (Adam or SGD, global gradient-norm clipping over all model-parallel
ranks; optionally the ZeRO-1 ``DistributedOptimizer``, its state sharded over DP) and the schedule Megatron's ``OptimizerParamScheduler``, both filled from an
``OptimConfig``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.config import OptimConfig

__all__ = ["wrap_ddp", "build_optimizer", "optimizer_config_kwargs"]


def wrap_ddp(
    chunks: list[torch.nn.Module], tf_config: Any, *, distributed_optimizer: bool = False
) -> list[torch.nn.Module]:
    """The chunks in Megatron DDP (only the first one bucketed); sets the schedule's hooks on ``tf_config``.

    ``distributed_optimizer``: the buffers are laid out for ZeRO-1 (a contiguous parameter buffer
    the parameters are views of, buckets padded to a multiple of ``lcm(DP, 128)``; gradients are
    reduce-scattered and the updated shards all-gathered)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    wrapped = [
        DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    no_sync = [m.no_sync for m in wrapped]
    tf_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    tf_config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def optimizer_config_kwargs(optim: OptimConfig, tf_config: Any, *, distributed_optimizer: bool = False) -> dict:
    """The keyword arguments of Megatron's ``OptimizerConfig`` for ``optim``: its own fields, then
    ``optim.override_optimizer_config`` on top (verl's order: an override wins). A name megatron-core's
    ``OptimizerConfig`` lacks is a ``ValueError`` listing those names."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    kwargs = dict(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]),
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=tf_config.bf16,
        fp16=tf_config.fp16,
        params_dtype=tf_config.params_dtype,
        use_distributed_optimizer=distributed_optimizer,
    )
    overrides = dict(optim.override_optimizer_config or {})
    known = {f.name for f in dataclasses.fields(OptimizerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        import megatron.core

        raise ValueError(
            f"optim.override_optimizer_config: megatron-core {megatron.core.__version__}'s OptimizerConfig "
            f"has no field(s) {unknown}"
        )
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype", "main_params_dtype"):
        if isinstance(overrides.get(name), str):  # verl writes dtypes as names (bf16, fp32)
            overrides[name] = _DTYPES.get(overrides[name], overrides[name])
    return {**kwargs, **overrides}


_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp8": torch.uint8,
    "uint8": torch.uint8,
}


def build_optimizer(
    model: list[torch.nn.Module], tf_config: Any, optim: OptimConfig, *, distributed_optimizer: bool = False
) -> tuple[Any, Any]:
    """``(optimizer, scheduler)`` for the DDP-wrapped ``model`` chunks.

    ``distributed_optimizer`` (``megatron.use_distributed_optimizer``): Megatron's
    ``DistributedOptimizer``, each DP rank keeping the Adam state (and fp32 masters) of its shard of
    the buffers only; the chunks must have been wrapped with the same setting.

    ``total_training_steps <= 0`` means an open-ended run (a horizon that is never reached);
    ``lr_warmup_steps < 0`` takes the warm-up from ``lr_warmup_steps_ratio`` of the horizon.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        **optimizer_config_kwargs(optim, tf_config, distributed_optimizer=distributed_optimizer)
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    total = optim.total_training_steps if optim.total_training_steps > 0 else 1_000_000_000
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total)
    decay = optim.lr_decay_steps or total
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler
