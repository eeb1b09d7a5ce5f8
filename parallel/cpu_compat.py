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
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from typing import Any, Callable

import torch

__all__ = [
    "apply_cpu_compat",
    "revert_cpu_compat",
    "applied_cpu_redirects",
    "cpu_transformer_config_overrides",
    "CPU_REDIRECTS",
    "CPU_TRANSFORMER_CONFIG_OVERRIDES",
]

_MC = "megatron.core."

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


# ---------------------------------------------------------------------------------------------
# Bookkeeping: every patch is recorded so that revert_cpu_compat() can undo it.
# ---------------------------------------------------------------------------------------------
_MISSING = object()
_UNDO: list[Callable[[], None]] = []
_APPLIED: list[str] = []


def _set_attr(obj: Any, name: str, value: Any) -> None:
    """``setattr`` that remembers the previous value (or its absence) for revert."""
    old = vars(obj).get(name, _MISSING)

    def undo() -> None:
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)

    setattr(obj, name, value)
    _UNDO.append(undo)


def _module(short_name: str) -> types.ModuleType:
    return importlib.import_module(_MC + short_name)


class _TorchView:
    """A stand-in for ``torch`` inside one Megatron module.

    Attribute reads fall through to the real object except for the few overridden names;
    dotted overrides (``"cuda.current_device"``) create nested views, so ``torch.cuda.is_available``
    and friends stay torch's own.
    """

    def __init__(self, real: Any):
        self._real = real
        self._overrides: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # only called for names not set on the view itself
        overrides = self.__dict__["_overrides"]
        if name in overrides:
            return overrides[name]
        return getattr(self.__dict__["_real"], name)

    def __repr__(self) -> str:
        return f"<cpu_compat view of {self._real!r}: overrides {sorted(self._overrides)}>"

    def override(self, dotted: str, value: Any) -> None:
        head, _, rest = dotted.partition(".")
        if not rest:
            self._overrides[head] = value
            return
        child = self._overrides.get(head)
        if not isinstance(child, _TorchView):
            child = _TorchView(getattr(self._real, head))
            self._overrides[head] = child
        child.override(rest, value)


def _torch_view(module: types.ModuleType) -> _TorchView:
    """The module's private ``torch`` view, installed on first use."""
    current = module.__dict__.get("torch")
    if isinstance(current, _TorchView):
        return current
    if current is not torch:
        raise RuntimeError(f"{module.__name__}.torch is {current!r}, expected the torch module")
    view = _TorchView(torch)
    _set_attr(module, "torch", view)
    return view


def _override_in(module_names: tuple[str, ...], dotted: str, value: Any) -> None:
    for short in module_names:
        _torch_view(_module(short)).override(dotted, value)


# ---------------------------------------------------------------------------------------------
# The redirects.
# ---------------------------------------------------------------------------------------------
def _cpu_current_device() -> str:
    return "cpu"


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


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


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


@contextlib.contextmanager
def _tensor_type_reports_cuda():
    """``tensor.type()`` names a CPU tensor as its CUDA twin (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``)."""
    original = torch.Tensor.type

    def type_(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _distributed_optimizer_on_cpu() -> None:
    """Megatron's ``DistributedOptimizer`` (ZeRO-1) on CPU tensors.

    ``__init__`` sorts parameters by ``param.type()`` and refuses anything but
    ``torch.cuda.{Float,Half,BFloat16}Tensor``: while it runs, CPU tensors report the CUDA names.
    ``get_parameter_state_dp_zero`` (the ``fully_reshardable`` checkpoint gathers the state shards
    on DP rank 0) allocates on ``torch.cuda.current_device()`` and moves its send buffer with
    ``.cuda()``: there the device is the CPU and ``.cuda()`` the identity. Loading that checkpoint
    into torch's Adam (the optimizer without Apex/TE, i.e. always on CPU) fails with
    ``KeyError: 'step'`` in ``_set_main_param_and_optimizer_states`` (0.16.1: the per-parameter
    ``step`` is skipped in the loaded tensors, restored from the common state): the parameter's
    own ``step`` is handed back to it. And ``load_state_dict`` gives every parameter the *same*
    ``step`` tensor, which torch's Adam increments in place once per parameter (the n-th parameter
    would see step + n): each parameter gets its own copy. Everything else (reduce-scatter of the
    gradient buffer, all-gather of the updated shards) runs on gloo as it is.
    """
    module = _module("optimizer.distrib_optimizer")
    cls = module.DistributedOptimizer
    _torch_view(module).override("cuda.current_device", _cpu_current_device)
    original_init, original_gather = cls.__init__, cls.get_parameter_state_dp_zero
    original_set, original_load = cls._set_main_param_and_optimizer_states, cls.load_state_dict

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _tensor_type_reports_cuda():
            original_init(self, *args, **kwargs)

    def get_parameter_state_dp_zero(self, *args: Any, **kwargs: Any) -> Any:
        with _tensor_cuda_is_identity():
            return original_gather(self, *args, **kwargs)

    def _set_main_param_and_optimizer_states(self, model_param: Any, tensors: dict) -> Any:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original_set(self, model_param, tensors)

    def load_state_dict(self, state_dict: dict) -> Any:
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return result

    for wrapper, original in ((__init__, original_init), (get_parameter_state_dp_zero, original_gather),
                              (_set_main_param_and_optimizer_states, original_set), (load_state_dict, original_load)):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__doc__ = original.__doc__
        _set_attr(cls, original.__name__, wrapper)


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
        "model_parallel_cuda_manual_seed and the RNG tracker (forked even with dropout 0) use the "
        "CUDA generator",
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
    for name, wrap in (("_gather_along_first_dim", _uneven_gather_along_first_dim),
                       ("_reduce_scatter_along_first_dim", _uneven_reduce_scatter_along_first_dim)):
        current = getattr(mappings, name)
        if not getattr(current, "cpu_compat_uneven", False):
            _set_attr(mappings, name, wrap(current))
    return True
