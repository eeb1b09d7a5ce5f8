"""HF's reference forward for ``--verify``, streamed layer group by layer group.

``hf_stream_forward`` runs transformers' own forward (the model class of config.json, eager
attention and experts, CPU) on a model whose parameters live on the meta device: just before a part of the
model runs, its weights are read from the safetensors (``pread``, no mapping: only what is read
is resident) through transformers' own loader (its renamings and conversions, e.g. fused expert
tensors), and they are dropped right after. The parts are the embedding, each group of
``layers_per_group`` decoder layers, and the head (final norm + output layer), so the reference
holds one part at a time, never the whole model. The hidden states leaving each group are kept
(float32), so a wrong mapping can be traced to the first group where the two sides part.
An FP8 block-quantised checkpoint (DeepSeek-V3's ``quantization_config``) is dequantised as it is
read (``parallel.bridge.fp8``, as the converters read it) into a plain model of its config.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

HEAD_BLOCK_BYTES = 64 * 2**20
"""Bytes of the output layer's matrix held in the compute dtype at a time."""


def layer_groups(num_layers: int, layers_per_group: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: the decoder layers in consecutive groups of ``layers_per_group``
    (the last one may be shorter); one group of all layers for ``layers_per_group`` 0."""
    if layers_per_group < 0:
        raise ValueError(
            f"--verify-layers-per-group={layers_per_group} is not allowed; give 0 (the whole model "
            "at once) or a number of layers >= 1"
        )
    step = layers_per_group or num_layers
    return [(s, min(s + step, num_layers)) for s in range(0, num_layers, step)]


@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with every parameter on the meta device and buffers where they are made
    (the rotary embedding's ``inv_freq`` is real: no checkpoint holds it)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _unmap_freed_blocks() -> None:
    """glibc only: give every allocation of 1 MiB or more its own mapping, returned to the system
    when freed. By default glibc raises that threshold (to 32 MiB) after the first large free, so a
    layer group's 3 MiB expert slices and their stacked copies come from the heap and stay resident
    after the group is dropped (on a Qwen3-30B-A3B-shaped layer: 2.4 GiB kept, 6.7 GiB peak for a
    1.2 GiB layer; with this: nothing kept, 4.3 GiB peak). A no-op elsewhere."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _tensor_files(hf_dir: Path) -> dict[str, str]:
    """{tensor name: safetensors file name} of ``hf_dir`` (sharded with an index, or one file)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update(dict.fromkeys(h.keys(), f.name))
    return out


class _Streamer:
    """The meta-device HF model of ``hf_dir`` and the loader that fills one part of it at a time."""

    def __init__(self, hf_dir: Path, weight_dtype: torch.dtype, compute_dtype: torch.dtype):
        from transformers import AutoConfig, AutoModelForCausalLM

        from parallel.bridge.fp8 import fp8_block_size

        self.hf_dir, self.compute_dtype = hf_dir, compute_dtype
        config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
        self.fp8_block = fp8_block_size(json.loads((hf_dir / "config.json").read_text()))
        if self.fp8_block is not None:  # dequantised on read: the model is a plain one
            config.quantization_config = None
            delattr(config, "quantization_config")
        with _parameters_on_meta():
            # Parameters in the weight dtype: transformers' loader casts to them (the rounding);
            # ``load`` upcasts to the compute dtype. Eager experts: a loop over the experts' own matrices (the grouped-mm default copies
            # every expert's matrix transposed: a layer's worth of weights more, per MoE layer).
            self.model = AutoModelForCausalLM.from_config(
                config, dtype=weight_dtype, attn_implementation="eager", experts_implementation="eager"
            ).eval()
        self.config = config
        self.files = _tensor_files(hf_dir)
        self.weight_dtype = weight_dtype
        names = {id(m): n for n, m in self.model.named_modules()}
        inner = self.model.model
        self.embedding = self.model.get_input_embeddings()
        self.layers = list(inner.layers)
        self.norm, self.head = inner.norm, self.model.get_output_embeddings()
        self.prefix = {id(m): names[id(m)] + "." for m in (self.embedding, *self.layers, self.norm, self.head)}
        self.tied = getattr(config, "tie_word_embeddings", False) and f"{names[id(self.head)]}.weight" not in self.files
        # The vocabulary matrices stay in the weight dtype (they are the largest): a lookup is exact
        # in any dtype (its rows are upcast after it), the output layer runs on blocks of rows.
        self.stored = set()
        if type(self.embedding) is torch.nn.Embedding:
            self.stored.add(id(self.embedding))
            self.embedding.register_forward_hook(lambda _m, _i, out: out.to(compute_dtype))
        if type(self.head) is torch.nn.Linear and self.head.bias is None:
            self.stored.add(id(self.head))
            self.head.forward = self._head_in_blocks

    def load(self, modules: list[torch.nn.Module]) -> None:
        """Read the weights of ``modules`` (rounded to the weight dtype, then cast to the compute
        dtype); a ``ValueError`` naming any parameter the checkpoint does not fill."""
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        prefixes = tuple(self.prefix[id(m)] for m in modules)
        wanted: dict[str, list[str]] = {}
        for name, file in self.files.items():
            if name.startswith(prefixes):
                wanted.setdefault(file, []).append(name)
        with contextlib.ExitStack() as stack:
            handles, state = {}, {}
            for file, names in wanted.items():
                handles[file] = stack.enter_context(safe_open(str(self.hf_dir / file), framework="pt", backend="pread"))
                state.update({n: handles[file].get_slice(n) for n in names})
            if self.fp8_block is not None:
                self._dequantize(state, handles, stack)
            # Fresh converters for each part: they collect the tensors of the call they serve.
            dtype = self.weight_dtype
            config = LoadStateDictConfig(
                dtype=dtype,
                dtype_plan=self.model._get_dtype_plan(dtype),
                weight_mapping=get_model_conversion_mapping(self.model, None, None),
            )
            convert_and_load_state_dict_in_model(self.model, state, config)
            del config, state
        if self.tied and self.head in modules:
            self.head.weight = self.embedding.weight
        missing = []
        for module in modules:
            for name, param in module.named_parameters():
                if param.is_meta:
                    missing.append(self.prefix[id(module)] + name)
                elif param.dtype != self.compute_dtype and id(module) not in self.stored:
                    param.data = param.data.to(self.compute_dtype)  # an upcast of the rounded weights: exact
        if missing:
            raise ValueError(f"{self.hf_dir}: the checkpoint does not hold {missing[:5]} (HF reference for --verify)")

    def _head_in_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's ``F.linear`` on blocks of ``HEAD_BLOCK_BYTES`` of its (stored-dtype)
        rows cast to the compute dtype, concatenated: each logit is the same dot product."""
        weight = self.head.weight
        step = max(1, HEAD_BLOCK_BYTES // (weight.shape[1] * self.compute_dtype.itemsize))
        return torch.cat(
            [
                torch.nn.functional.linear(hidden, weight[i : i + step].to(self.compute_dtype))
                for i in range(0, weight.shape[0], step)
            ],
            dim=-1,
        )

    def _dequantize(self, state: dict, handles: dict, stack) -> None:
        """Replace the FP8 weights in ``state`` by their float32 values and drop their scales."""
        from safetensors import safe_open

        from parallel.bridge.fp8 import SCALE_SUFFIX, dequantize_fp8_blocks

        for name in [n for n in state if state[n].get_dtype().startswith("F8")]:
            scale_name, file = name + SCALE_SUFFIX, self.files.get(name + SCALE_SUFFIX)
            if file is None:
                raise ValueError(f"{self.hf_dir}: {name!r} is FP8 but {scale_name!r} is missing")
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(self.hf_dir / file), framework="pt", backend="pread"))
            state[name] = dequantize_fp8_blocks(state[name][:], handles[file].get_tensor(scale_name), self.fp8_block)
            state.pop(scale_name, None)

    @staticmethod
    def release(modules: list[torch.nn.Module]) -> None:
        """Put the parameters of ``modules`` back on the meta device (their memory is freed)."""
        for module in modules:
            for sub in module.modules():
                for name, p in list(sub._parameters.items()):
                    if p is not None and not p.is_meta:
                        sub._parameters[name] = torch.nn.Parameter(
                            torch.empty_like(p, device="meta"), requires_grad=False
                        )


def hf_stream_forward(
    hf_dir: str | os.PathLike,
    input_ids: torch.Tensor,
    weight_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    layers_per_group: int,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Float32 logits ``[b, s, vocab]`` of the HF checkpoint in ``hf_dir`` with weights rounded
    to ``weight_dtype`` and the forward in ``compute_dtype``, and {last layer of each group (0-based):
    its output hidden states, float32 ``[b, s, hidden]``}; at most one part of the model (the
    embedding, one layer group, or the head) holds weights at a time (see the module docstring)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _unmap_freed_blocks()
    stream = _Streamer(Path(hf_dir), weight_dtype, compute_dtype)
    groups = layer_groups(len(stream.layers), layers_per_group)
    hidden: dict[int, torch.Tensor] = {}
    parts: list[tuple[torch.nn.Module, torch.nn.Module, list[torch.nn.Module], Optional[int]]] = [
        (stream.embedding, stream.embedding, [stream.embedding], None)
    ]
    parts += [(stream.layers[a], stream.layers[b - 1], stream.layers[a:b], b - 1) for a, b in groups]
    # A tied output layer is the embedding's matrix: read again for the head.
    parts.append(
        (stream.norm, stream.head, [stream.norm, stream.head, *([stream.embedding] if stream.tied else [])], None)
    )
    handles = []

    def on_enter(modules):
        return lambda *_: stream.load(modules)

    def on_exit(modules, last):
        def hook(_module, _inputs, output):
            if last is not None:
                hidden[last] = (output[0] if isinstance(output, tuple) else output).detach().float().clone()
            stream.release(modules)

        return hook

    try:
        for first, end, modules, last in parts:
            handles.append(first.register_forward_pre_hook(on_enter(modules)))
            handles.append(end.register_forward_hook(on_exit(modules, last)))
        with torch.no_grad():
            logits = stream.model(input_ids=input_ids, use_cache=False).logits.float()
    finally:
        for h in handles:
            h.remove()
        stream.release([stream.model])
    return logits, hidden
