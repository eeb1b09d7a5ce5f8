"""CPU redirects a model builder applies on demand (not in ``CPU_REDIRECTS``): YaRN RoPE's
current device and gloo's uneven expert-TP all-gather / reduce-scatter (issue 20)."""

from __future__ import annotations

from typing import Callable

import torch

from parallel.cpu_compat._patching import _cpu_current_device, _module, _override_in, _set_attr


def redirect_yarn_current_device() -> bool:
    """``torch.cuda.current_device()`` -> ``"cpu"`` inside Megatron's YaRN RoPE module (issue 20).

    ``YarnRotaryEmbedding`` (MLA's RoPE for DeepSeek-V3-style models) calls it when it is built
    and at every ``get_emb``; the model builder calls this before building an MLA model with YaRN
    on CPU. Idempotent; undone by ``revert_cpu_compat``; returns whether it acted (False with CUDA).
    """
    if torch.cuda.is_available():
        return False
    _override_in(("models.common.embeddings.yarn_rotary_pos_embedding",), "cuda.current_device", _cpu_current_device)
    return True


def _uneven_gather_along_first_dim(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        # gloo's all_gather takes equal sizes only: pad every rank's rows to the longest, trim after.
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:rows] for part, rows in zip(parts, output_split_sizes)])

    gather.cpu_compat_uneven = True
    return gather


def _uneven_reduce_scatter_along_first_dim(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        # gloo's reduce_scatter takes equal sizes only: reduce everything, keep this rank's rows.
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return total.split(list(input_split_sizes))[group.rank()].clone()

    reduce_scatter.cpu_compat_uneven = True
    return reduce_scatter


def redirect_uneven_tp_collectives() -> bool:
    """Uneven all-gather / reduce-scatter over the expert-TP group on gloo (issue 20).

    With expert tensor parallelism (ETP > 1) next to EP > 1, Megatron's alltoall MoE dispatcher
    gathers each rank's routed tokens over the expert-TP group with per-rank row counts
    (``output_splits_tp``) through ``torch.distributed.all_gather`` / ``reduce_scatter`` with
    tensors of unequal sizes, which NCCL accepts and gloo refuses ("invalid tensor size"). This
    pads to the longest part and trims (gather), or all-reduces and keeps this rank's rows
    (reduce-scatter). The model builder calls it before building an MoE model on CPU.
    Idempotent; undone by ``revert_cpu_compat``; returns whether it acted (False with CUDA).
    """
    if torch.cuda.is_available():
        return False
    mappings = _module("tensor_parallel.mappings")
    for name, wrap in (
        ("_gather_along_first_dim", _uneven_gather_along_first_dim),
        ("_reduce_scatter_along_first_dim", _uneven_reduce_scatter_along_first_dim),
    ):
        current = getattr(mappings, name)
        if not getattr(current, "cpu_compat_uneven", False):
            _set_attr(mappings, name, wrap(current))
    return True
