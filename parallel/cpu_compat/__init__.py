"""Let Megatron-Core 0.16.1 run on a machine without CUDA (laptops, CI, dry runs).

Megatron-Core hard-codes a handful of CUDA calls on paths that are otherwise device-agnostic
(RoPE buffers, pipeline receive buffers, the RNG tracker, the MoE all-to-all dispatcher, ...).
This module redirects exactly those calls to the CPU, and nothing else:

* ``apply_cpu_compat()`` applies every redirect once (idempotent) and returns the names of the
  active ones; where ``torch.cuda.is_available()`` it does nothing and returns ``[]``.
* Each redirect is a named function in ``CPU_REDIRECTS`` with a one-line reason, so the list can
  shrink as Megatron-Core drops its CUDA assumptions (e.g. the router's ``te_general_gemm``
  NameError is fixed upstream in 0.19).
* Redirects patch attributes of the Megatron modules involved, never global ``torch``: a module
  that calls ``torch.cuda.current_device()`` gets its own ``torch`` stand-in (``_TorchView``)
  whose ``cuda.current_device`` answers ``"cpu"``; every other attribute is torch's own.
* ``revert_cpu_compat()`` undoes everything (tests use it to show each redirect is needed).

Model builders also need a few ``TransformerConfig`` settings on CPU; they are listed in
``CPU_TRANSFORMER_CONFIG_OVERRIDES`` and returned by ``cpu_transformer_config_overrides()``.

Layout: ``_patching`` (the undo bookkeeping and the per-module ``torch`` views), ``redirects``
(the general redirects), ``optimizer`` (the distributed optimizer on CPU), ``on_demand`` (what
model builders apply for the models that need it: YaRN, uneven expert-TP collectives).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from parallel.cpu_compat._patching import _APPLIED, _UNDO
from parallel.cpu_compat.on_demand import redirect_uneven_tp_collectives, redirect_yarn_current_device
from parallel.cpu_compat.optimizer import _distributed_optimizer_on_cpu
from parallel.cpu_compat.redirects import (
    _fix_alltoall_dispatcher_stream,
    _fix_moe_te_general_gemm,
    _noop_tensor_cuda,
    _redirect_cuda_rng,
    _redirect_cuda_synchronize,
    _redirect_current_device,
    _redirect_schedules_zeros,
    _redirect_training_stack,
)

__all__ = [
    "apply_cpu_compat",
    "revert_cpu_compat",
    "applied_cpu_redirects",
    "cpu_transformer_config_overrides",
    "CPU_REDIRECTS",
    "CPU_TRANSFORMER_CONFIG_OVERRIDES",
    "redirect_yarn_current_device",
    "redirect_uneven_tp_collectives",
]

CPU_REDIRECTS: dict[str, tuple[Callable[[], None], str]] = {
    "_redirect_current_device": (
        _redirect_current_device,
        "RoPE, p2p buffers, MoE router/all-to-all, sequence-parallel buffers and dist_checkpointing "
        "allocate on torch.cuda.current_device()",
    ),
    "_redirect_training_stack": (
        _redirect_training_stack,
        "the optimizer, grad norm and grad clip create tensors with device='cuda' and assert CUDA grads",
    ),
    "_redirect_cuda_rng": (
        _redirect_cuda_rng,
        "model_parallel_cuda_manual_seed and the RNG tracker (forked even with dropout 0) use the CUDA generator",
    ),
    "_redirect_schedules_zeros": (
        _redirect_schedules_zeros,
        "all three pipeline schedules create their token counter with device='cuda'",
    ),
    "_noop_cuda_synchronize": (
        _redirect_cuda_synchronize,
        "p2p shape exchange (variable_seq_lengths) and dist_checkpointing call torch.cuda.synchronize()",
    ),
    "_noop_tensor_cuda": (
        _noop_tensor_cuda,
        "PP>1 with tied embeddings moves the shared weight with weight.data.cuda() before all-reduce",
    ),
    "_fix_moe_te_general_gemm": (
        _fix_moe_te_general_gemm,
        "MoE router gating reads te_general_gemm, undefined when TransformerEngine is absent "
        "(0.16.1 bug, fixed in 0.19)",
    ),
    "_fix_alltoall_dispatcher_stream": (
        _fix_alltoall_dispatcher_stream,
        "MoE alltoall dispatcher creates a torch.cuda.Stream() and records CUDA events for split sizes",
    ),
    "_distributed_optimizer_on_cpu": (
        _distributed_optimizer_on_cpu,
        "DistributedOptimizer accepts only parameters whose type() is torch.cuda.{Float,Half,BFloat16}Tensor "
        "and gathers its checkpoint state on torch.cuda.current_device() with .cuda()",
    ),
}

CPU_TRANSFORMER_CONFIG_OVERRIDES: dict[str, tuple[Any, str]] = {
    "use_cpu_initialization": (
        True,
        "the GPU init path allocates weights on torch.cuda.current_device(); CPU init also makes "
        "TP shards slices of one master weight, independent of the TP size",
    ),
    "batch_p2p_comm": (
        False,
        "gloo pairs batched isend/irecv to one peer in posting order: at PP=2 with VPP the batched "
        "send_prev/send_next meet recv_prev/recv_next crosswise and activations and gradients swap "
        "silently; the unbatched path orders the ops by rank parity",
    ),
    "batch_p2p_sync": (
        False,
        "the cuda.synchronize after batched isend/irecv guards an NCCL race that gloo does not have",
    ),
    "gradient_accumulation_fusion": (False, "needs the fused wgrad kernels of APEX/TransformerEngine"),
    "masked_softmax_fusion": (False, "the fused softmax kernels are CUDA-only"),
    "bias_activation_fusion": (False, "the fused bias-GeLU/SwiGLU kernels target CUDA"),
    "bias_dropout_fusion": (False, "the fused bias-dropout-add kernels target CUDA"),
    "apply_rope_fusion": (False, "fused RoPE needs TransformerEngine"),
    "moe_permute_fusion": (False, "fused permutation needs TransformerEngine"),
}


def cpu_transformer_config_overrides() -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments a model must use to run on CPU.

    Model builders merge these into their config kwargs when CUDA is absent
    (``TransformerConfig(**base_kwargs, **cpu_transformer_config_overrides())``); reasons are in
    ``CPU_TRANSFORMER_CONFIG_OVERRIDES``.
    """
    return {name: value for name, (value, _reason) in CPU_TRANSFORMER_CONFIG_OVERRIDES.items()}


def apply_cpu_compat(*, skip: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Apply the CPU redirects for Megatron-Core when CUDA is absent; return the active names.

    Idempotent: a redirect already applied is not applied again, and the returned list (in
    ``CPU_REDIRECTS`` order) is the same on every call. ``skip`` leaves named redirects out
    (tests use it to show a redirect is required). With CUDA available this is a no-op that
    returns ``[]``.
    """
    unknown = [name for name in skip if name not in CPU_REDIRECTS]
    if unknown:
        raise ValueError(f"skip={list(skip)} names unknown redirects {unknown}; known: {list(CPU_REDIRECTS)}")
    if torch.cuda.is_available():
        return []
    for name, (redirect, _reason) in CPU_REDIRECTS.items():
        if name in skip or name in _APPLIED:
            continue
        redirect()
        _APPLIED.append(name)
    return applied_cpu_redirects()


def applied_cpu_redirects() -> list[str]:
    """Names of the redirects currently in effect, in ``CPU_REDIRECTS`` order."""
    return [name for name in CPU_REDIRECTS if name in _APPLIED]


def revert_cpu_compat() -> list[str]:
    """Undo every redirect (most recent patch first); return the names that were active."""
    active = applied_cpu_redirects()
    while _UNDO:
        _UNDO.pop()()
    _APPLIED.clear()
    return active
