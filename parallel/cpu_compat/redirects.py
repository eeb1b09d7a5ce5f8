"""The redirects ``apply_cpu_compat()`` applies: Megatron-Core 0.16.1's CUDA calls on CPU-reachable
paths (current device, RNG tracker, schedules, optimizer stack, synchronize, MoE dispatcher)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from parallel.cpu_compat._patching import (
    _UNDO,
    _cpu_current_device,
    _module,
    _override_in,
    _set_attr,
    _tensor_cuda_is_identity,
    _torch_view,
)

# Modules whose code paths reachable on CPU call ``torch.cuda.current_device()``.
_CURRENT_DEVICE_MODULES = (
    # RotaryEmbedding.get_emb moves inv_freq "to the GPU" at the first forward.
    "models.common.embeddings.rotary_pos_embedding",
    # Pipeline send/receive buffers and shape tensors.
    "pipeline_parallel.p2p_communication",
    # TopKRouter.gating moves its weight "to the GPU" at every forward.
    "transformer.moe.router",
    # all-to-all-v output buffer of the MoE alltoall dispatcher.
    "tensor_parallel.mappings",
    # GlobalMemoryBuffer.get_tensor: the local DotProductAttention's matmul buffer.
    "utils",
    # dist_checkpointing: failure broadcast after saving and the async writer's liveness check.
    "dist_checkpointing.strategies.state_dict_saver",
    "dist_checkpointing.strategies.async_utils",
    # Sequence-parallel backward of the column/row parallel linears (all-gather buffer).
    "tensor_parallel.layers",
    # DistributedDataParallel's contiguous param/grad buffers.
    "distributed.param_and_grad_buffer",
)

# Modules of the training stack (optimizer, grad norm) that build small tensors with device="cuda".
_CUDA_FACTORY_MODULES = {
    # FP32Optimizer/MixedPrecisionOptimizer: loss-scale and found-inf tensors.
    "optimizer.optimizer": ("tensor", "zeros", "ones", "empty"),
    # get_grad_norm_fp32: overflow buffer and the norm accumulator.
    "optimizer.clip_grads": ("tensor", "zeros"),
    # local_multi_tensor_l2_norm (no Apex/TE): the norm result.
    "utils": ("tensor",),
}

# Modules that call ``torch.cuda.synchronize()`` unconditionally on CPU-reachable paths.
_SYNCHRONIZE_MODULES = (
    # _communicate_shapes (variable_seq_lengths=True) and batched p2p with batch_p2p_sync.
    "pipeline_parallel.p2p_communication",
    # dist_checkpointing: D2H staging before the async/sync writer and after parallel loads.
    "dist_checkpointing.strategies.async_utils",
    "dist_checkpointing.strategies.filesystem_async",
    "dist_checkpointing.strategies.fully_parallel",
    "dist_checkpointing.tensor_aware_state_dict",
)

_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def _redirect_current_device() -> None:
    """``torch.cuda.current_device()`` -> ``"cpu"`` inside the modules that allocate with it."""
    _override_in(_CURRENT_DEVICE_MODULES, "cuda.current_device", _cpu_current_device)


class _DropSameGeneratorWarning(logging.Filter):
    """On CPU the tracker's "CUDA" generator *is* the CPU generator, so this warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


def _redirect_cuda_rng() -> None:
    """Back Megatron's CUDA RNG tracker with the CPU default generator.

    ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker.add/fork`` (entered even with
    dropout 0) read and write the CUDA generator; here they read and write the CPU one, so
    ``fork()`` swaps the CPU generator to the per-TP-rank state and back, exactly as on GPU.
    """
    random = _module("tensor_parallel.random")

    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    view = _torch_view(random)
    view.override("cuda.get_rng_state", get_rng_state)
    view.override("cuda.set_rng_state", set_rng_state)
    view.override("cuda.manual_seed", manual_seed)
    _set_attr(random, "_get_cuda_rng_state", get_rng_state)
    _set_attr(random, "_set_cuda_rng_state", set_rng_state)

    logger = logging.getLogger(random.__name__)
    rng_filter = _DropSameGeneratorWarning()
    logger.addFilter(rng_filter)
    _UNDO.append(lambda: logger.removeFilter(rng_filter))


def _redirect_schedules_zeros() -> None:
    """``torch.zeros(..., device="cuda")`` (token counter in all three schedules) -> CPU."""
    schedules = _module("pipeline_parallel.schedules")

    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)

    _torch_view(schedules).override("zeros", zeros)


def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory(..., device="cuda")`` -> the same call on the CPU; other devices untouched."""

    def on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    on_cpu.__name__ = f"cpu_{factory.__name__}"
    return on_cpu


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its ``torch.cuda.FloatTensor`` assert."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _redirect_training_stack() -> None:
    """Optimizer, grad-norm and gradient clipping on CPU (DDP buffers via ``current_device``).

    ``FP32Optimizer`` and the grad-norm code create tensors with ``device="cuda"``; the gradient
    clip asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``. The clip is replaced in the
    optimizer module by the same in-place scaling without the assert.
    """
    for short, names in _CUDA_FACTORY_MODULES.items():
        view = _torch_view(_module(short))
        for name in names:
            view.override(name, _cpu_factory(getattr(torch, name)))
    _set_attr(_module("optimizer.optimizer"), "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu)


def _noop_cuda_synchronize(device: Any = None) -> None:
    return None


def _redirect_cuda_synchronize() -> None:
    """``torch.cuda.synchronize()`` -> no-op in p2p shape exchange and dist_checkpointing."""
    _override_in(_SYNCHRONIZE_MODULES, "cuda.synchronize", _noop_cuda_synchronize)


def _noop_tensor_cuda() -> None:
    """``weight.data.cuda()`` in ``LanguageModule.setup_embeddings_and_output_layer`` -> no-op.

    With PP > 1 and tied embeddings the first and last stage all-reduce the shared weight after
    moving it "to the GPU". ``Tensor.cuda`` is made a no-op only while that method runs.
    """
    language_module = _module("models.common.language_module.language_module")
    cls = language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self, *args: Any, **kwargs: Any) -> Any:
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    setup_embeddings_and_output_layer.__wrapped__ = original  # type: ignore[attr-defined]
    setup_embeddings_and_output_layer.__doc__ = original.__doc__
    _set_attr(cls, "setup_embeddings_and_output_layer", setup_embeddings_and_output_layer)


def _fix_moe_te_general_gemm() -> None:
    """Define ``moe_utils.te_general_gemm = None`` (0.16.1 NameError without TE, fixed in 0.19)."""
    moe_utils = _module("transformer.moe.moe_utils")
    if "te_general_gemm" not in moe_utils.__dict__:
        _set_attr(moe_utils, "te_general_gemm", None)


class _NoDtoHStream:
    """Marks the alltoall dispatcher's device-to-host stream as present; there is none on CPU."""

    def __repr__(self) -> str:
        return "<no CUDA stream: cpu_compat>"


def _fix_alltoall_dispatcher_stream() -> None:
    """MoE alltoall dispatcher: skip ``torch.cuda.Stream()`` and do its D2H step on the host.

    ``__init__`` creates a class-level CUDA stream once; a placeholder keeps it from trying.
    ``_maybe_dtoh_and_synchronize`` copies split sizes to the host on that stream and records an
    event; on CPU the only thing that matters is its result: split sizes as numpy arrays.
    """
    dispatcher_mod = _module("transformer.moe.token_dispatcher")
    cls = dispatcher_mod.MoEAlltoAllTokenDispatcher

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    _set_attr(cls, "cuda_dtoh_stream", _NoDtoHStream())
    _set_attr(cls, "_maybe_dtoh_and_synchronize", _maybe_dtoh_and_synchronize)
