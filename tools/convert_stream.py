"""Models for conversion without a second copy: built on the meta device, then given empty CPU storage.

``build_empty_model`` builds the Megatron model chunks under ``torch.device("meta")`` -- no
random init, no float32 master weights, no bytes at all -- and then gives every parameter and
buffer an uninitialised CPU tensor (``torch.empty``: its pages are touched only when a value is
written into them). Parameters keep their Python attributes (Megatron's ``tensor_model_parallel``,
``partition_dim``, ``shared``, ...) and tied parameters stay one tensor. The loaders then read
each shard straight into that storage (``parallel.bridge.load_hf_checkpoint`` with ``pread``, or
``dist_checkpointing.load`` for the way back), so a rank holds its shard once and nothing more.

Megatron computes its derived tensors (rotary ``inv_freq``, ``cos_cached``) on an explicit
device, so they are real; a buffer that is on the meta device gets zeros (a router's token
counts start at zero; a persistent buffer is loaded anyway), and ``build_empty_model`` refuses a
model that keeps a meta tensor anywhere else.
"""

from __future__ import annotations

from typing import Any

import torch


def _materialize(chunks: list[torch.nn.Module]) -> list[str]:
    """Replace every meta parameter / buffer of ``chunks`` with an empty CPU tensor (in place);
    returns the names of meta tensors held as plain attributes (not parameters or buffers)."""
    memo: dict[int, torch.Tensor] = {}
    leftovers: list[str] = []
    for v, chunk in enumerate(chunks):
        for mod_name, module in chunk.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in memo:
                    new = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    new.__dict__.update(p.__dict__)  # Megatron's TP / sharing attributes
                    memo[id(p)] = new
                module._parameters[name] = memo[id(p)]
            for name, b in list(module._buffers.items()):
                if b is None or not b.is_meta:
                    continue
                if id(b) not in memo:
                    memo[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
                module._buffers[name] = memo[id(b)]
            for name, value in vars(module).items():
                if isinstance(value, torch.Tensor) and value.is_meta:
                    leftovers.append(f"chunk {v} {mod_name or '<root>'}.{name}")
    return leftovers


def build_empty_model(model_cfg: Any, parallel_config: Any) -> list[torch.nn.Module]:
    """The model chunks of this rank with uninitialised CPU storage (see the module docstring);
    call with the mesh initialised, as ``megatron_rl.models.gpt.build_model``."""
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from tools.convert_common import NO_INIT

    with torch.device("meta"):
        chunks = build_model(model_cfg, build_transformer_config(model_cfg, parallel_config, **NO_INIT))
    leftovers = _materialize(chunks)
    if leftovers:
        raise RuntimeError(f"the model keeps meta tensors outside its parameters and buffers: {leftovers[:5]}")
    return chunks
