"""Megatron-Core's ``DistributedOptimizer`` (ZeRO-1) on CPU tensors: one of ``CPU_REDIRECTS``."""

from __future__ import annotations

from typing import Any

import torch

from parallel.cpu_compat._patching import (
    _cpu_current_device,
    _module,
    _set_attr,
    _tensor_cuda_is_identity,
    _tensor_type_reports_cuda,
    _torch_view,
)


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

    for wrapper, original in (
        (__init__, original_init),
        (get_parameter_state_dp_zero, original_gather),
        (_set_main_param_and_optimizer_states, original_set),
        (load_state_dict, original_load),
    ):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__doc__ = original.__doc__
        _set_attr(cls, original.__name__, wrapper)
