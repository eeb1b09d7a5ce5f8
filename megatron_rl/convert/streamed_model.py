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

import contextlib
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


@contextlib.contextmanager
def _attributes_only_init():
    """Megatron's CPU initialisation reduced to what it leaves on a weight that is loaded anyway:
    its tensor-parallel attributes. The full one builds a master weight, splits it and
    ``torch.cat``-s this rank's parts: on meta tensors that cat goes through torch's Python meta
    kernels, whose first call imports dynamo (1.1 s of a rank's 1.25 s model build). The TP
    attributes are set exactly as Megatron sets them (``set_tensor_model_parallel_attributes``)."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import experts

    original = layers._initialize_affine_weight_cpu

    def attributes_only(
        weight,
        output_size,
        input_size,
        per_partition_size,
        partition_dim,
        init_method,
        stride=1,
        return_master_weight=False,
        *,
        skip_set_tensor_parallel_attributes=False,
        **_,
    ):
        if return_master_weight:  # a caller that keeps the master weight (tests only): Megatron's own path
            return original(
                weight,
                output_size,
                input_size,
                per_partition_size,
                partition_dim,
                init_method,
                stride,
                return_master_weight,
                skip_set_tensor_parallel_attributes=skip_set_tensor_parallel_attributes,
                **_,
            )
        if not skip_set_tensor_parallel_attributes:
            layers.set_tensor_model_parallel_attributes(
                tensor=weight, is_parallel=True, dim=partition_dim, stride=stride
            )
        return None

    modules = [m for m in (layers, experts) if getattr(m, "_initialize_affine_weight_cpu", None) is original]
    for m in modules:
        m._initialize_affine_weight_cpu = attributes_only
    try:
        yield
    finally:
        for m in modules:
            m._initialize_affine_weight_cpu = original


def build_empty_model(model_cfg: Any, parallel_config: Any) -> list[torch.nn.Module]:
    """The model chunks of this rank with uninitialised CPU storage (see the module docstring);
    call with the mesh initialised, as ``megatron_rl.models.gpt.build_model``."""
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from megatron_rl.convert.support import NO_INIT

    with torch.device("meta"), _attributes_only_init():
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
        """The state dict built by ``StreamedSave``."""
        return self._state


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class StreamedSave:
    """The sharded state dicts of ``chunks`` for ``save_model``, and its ``write_hooks``: each tensor is
    read from the HF files just before it is written and its storage released right after.

    ``deferred`` (``parallel.bridge.DeferredReads``, from ``load_hf_checkpoint(..., deferred=True)``):
    the checked reads of every parameter, done here one storage at a time; None when the chunks
    are already loaded (then only the release applies). Megatron's writer would clone every tensor
    that is a view (the gate and up halves of every gated MLP's fc1, built by its factories) before
    writing anything; here each such half gets its own empty tensor, filled from the parameter as it
    is written, and the parameter is read once and released when its last half is written. So a
    rank holds one parameter (two for an fc1) at a time, not its shard. A tensor handed to the
    writer that the state dict does not hold (a copy made of a parameter not read yet) is refused.
    """

    def __init__(self, chunks: list[torch.nn.Module], deferred=None):
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        self._deferred = deferred
        self._halves: dict[int, tuple] = {}  # half's storage -> (half, view of the parameter, parameter storage)
        self._open: dict[int, int] = {}  # parameter storage -> halves not written yet
        self._writes: dict[int, int] = {}  # storage -> tensors of the current file not written yet
        self._known: set[int] = set()
        states = []
        for chunk in chunks:
            state = chunk.sharded_state_dict()
            apply_factories(state)
            for leaf in nested_values(state):
                if not (isinstance(leaf, ShardedTensor) and isinstance(leaf.data, torch.Tensor) and leaf.data.numel()):
                    continue
                data = leaf.data
                if data.untyped_storage().nbytes() != data.numel() * data.element_size():  # a view
                    half = torch.empty(data.shape, dtype=data.dtype)  # untouched: no pages yet
                    self._halves[_ptr(half)] = (half, data, _ptr(data))
                    self._open[_ptr(data)] = self._open.get(_ptr(data), 0) + 1
                    leaf.data = half
                self._known.add(_ptr(leaf.data))
            states.append(state)
        self.chunks = [_Prebuilt(s) for s in states]

    def start(self, tensors: list[torch.Tensor]) -> None:
        """The tensors of the next file: a storage is released after its last one is written."""
        for t in tensors:
            if t.numel():
                self._writes[_ptr(t)] = self._writes.get(_ptr(t), 0) + 1

    def before(self, tensor: torch.Tensor) -> None:
        """Fill ``tensor``'s storage (read it, or copy its half out of its parameter) if not yet done."""
        if not tensor.numel():
            return
        ptr = _ptr(tensor)
        if ptr not in self._known:
            raise RuntimeError(
                f"streamed save: the writer was handed a tensor of shape {list(tensor.shape)} that "
                f"the state dict does not hold (a copy of a parameter not read yet?)"
            )
        if ptr in self._halves:
            half, view, owner = self._halves.pop(ptr)
            if self._deferred is not None:
                self._deferred.read(owner)
            with torch.no_grad():
                half.copy_(view)
            self._open[owner] -= 1
            if not self._open[owner]:  # both halves out: the parameter goes
                del self._open[owner]
                view.untyped_storage().resize_(0)
        elif self._deferred is not None:
            self._deferred.read(ptr)

    def after(self, tensor: torch.Tensor) -> None:
        """Release ``tensor``'s storage once every tensor of the file that uses it is written."""
        if not tensor.numel():
            return
        ptr = _ptr(tensor)
        self._writes[ptr] -= 1
        if not self._writes[ptr]:
            del self._writes[ptr]
            self._known.discard(ptr)  # its address may be reused
            tensor.untyped_storage().resize_(0)


def restore_storage(chunks: list[torch.nn.Module]) -> None:
    """Give every parameter and buffer of ``chunks`` whose storage a ``StreamedSave`` released (or
    never filled) empty storage of its shape again (tied parameters stay one tensor)."""
    done: dict[int, torch.Tensor] = {}
    for chunk in chunks:
        for t in list(chunk.parameters()) + list(chunk.buffers()):
            if not t.numel() or id(t) in done:
                continue
            if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
                t.data = torch.empty(t.shape, dtype=t.dtype)
            done[id(t)] = t


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
