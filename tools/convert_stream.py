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


class _Prebuilt:
    """A chunk stand-in for ``parallel.checkpoint.save_model``: its ``sharded_state_dict()`` is given."""

    def __init__(self, state: dict):
        self._state = state

    def sharded_state_dict(self) -> dict:
        """The state dict built by ``state_for_save``."""
        return self._state


def state_for_save(chunks: list[torch.nn.Module]) -> tuple[list[Any], dict]:
    """Stand-ins for ``chunks`` whose sharded state dicts hold no views, and the parameters given up.

    Megatron's writer clones every tensor that is a view before it writes anything (a view would
    otherwise be saved with its whole storage): the gate and up halves of every gated MLP's fc1
    (a third of a dense model, two thirds of an MoE's experts) would exist twice during the save.
    Here the factories are applied (as ``dist_checkpointing.save`` applies them) and each
    parameter's views are cloned one parameter at a time, its own storage released right after,
    so the state dict holds every byte once. Returns the stand-ins (for ``save_model``) and
    {parameter: shape} of the released parameters (``restore_released`` gives them storage again).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    owners = {p.untyped_storage().data_ptr(): p for c in chunks for p in c.parameters() if p.numel()}
    states, views = [], {}
    for chunk in chunks:
        state = chunk.sharded_state_dict()
        apply_factories(state)
        for leaf in nested_values(state):
            if isinstance(leaf, ShardedTensor) and isinstance(leaf.data, torch.Tensor) and leaf.data.numel():
                storage = leaf.data.untyped_storage()
                if storage.nbytes() != leaf.data.numel() * leaf.data.element_size():
                    views.setdefault(storage.data_ptr(), []).append(leaf)
        states.append(state)
    released = {}
    with torch.no_grad():
        for ptr, leaves in views.items():
            for leaf in leaves:
                leaf.data = leaf.data.clone()
            owner = owners.get(ptr)
            if owner is not None:  # every reference to its storage was a view, now cloned
                released[owner] = tuple(owner.shape)
                owner.data = torch.empty(0, dtype=owner.dtype)
    return [_Prebuilt(s) for s in states], released


def restore_released(released: dict) -> None:
    """Give the parameters ``state_for_save`` released empty storage of their shape again."""
    for param, shape in released.items():
        param.data = torch.empty(shape, dtype=param.dtype)


def fork_write_queue() -> None:
    """Give Megatron's torch_dist writer an in-process results queue.

    The writer reports through a module-level ``multiprocessing`` Manager queue that it starts with
    ``spawn`` on first use: a fresh interpreter that imports torch to unpickle the results (seconds,
    and a torch-sized process beside the rank). A save that runs synchronously (``save_model``:
    ``execute_sync``, as every conversion does) puts its results into that queue and takes them out
    again in the same rank process (its writer workers report through queues of their own), so a
    plain ``queue.Queue`` serves it: no manager process at all (a forked one still held ~45 MiB PSS
    per rank). An asynchronous save (a persistent worker) would need the Manager: not used here."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
