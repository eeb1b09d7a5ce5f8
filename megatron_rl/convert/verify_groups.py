"""Layer-group ``--verify``: the Megatron side in bounded memory, and the comparison group by group.

The converted model is already in memory (its own dtype), so a forward in that dtype runs on it
directly. A forward in another dtype (the float32 check of a bf16 model) runs on a *twin*: the
same layout built with the other ``params_dtype`` (Megatron fixes dtype-dependent paths at build
time, e.g. the softmax's bf16 handling), whose parameters hold no storage until their module
runs: a pre-forward hook fills them from the converted model's parameters (an upcast: exact) and
a post-forward hook empties them again, so the twin costs one module's weights, not a model. The
vocabulary matrices, the largest, never exist whole in the other dtype: the embedding looks rows up
in the stored dtype and upcasts them, the output layer runs its own forward on blocks of rows.

Forward hooks on the decoder layers that end a layer group keep their output hidden states
(gathered over TP when sequence-parallel, sent to rank 0), which ``compare_groups`` sets against
HF's (``megatron_rl.convert.verify_hf``) to name the first group where the two sides part.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from megatron_rl.convert.verify import GAP_FACTOR

HIDDEN_TOLERANCE = 1e-4
"""Bound of a float32 forward's relative hidden-state difference (per token: max |diff| / max |HF|,
the largest over tokens). A correct mapping differs by rounding (~1e-6), a wrong one by O(0.1)."""
HIDDEN_FLOOR = 1e-2
"""Floor of the derived bound of a bf16/fp16 forward (per-token mean of the same relative figure,
within GAP_FACTOR x HF's own low-precision-vs-float32 figure at that group)."""


@contextlib.contextmanager
def model_for_dtype(chunks, model_cfg, parallel_config, dtype: str):
    """Yield chunks that compute in ``dtype`` with ``chunks``' values: ``chunks`` themselves when
    already in ``dtype``, else a twin whose parameters are filled one module at a time (see the
    module docstring). The hooks are removed and the twin dropped on exit."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from megatron_rl.convert.streamed_model import build_empty_model

    if model_cfg.params_dtype == dtype:
        yield chunks
        return
    twins = build_empty_model(dataclasses.replace(model_cfg, params_dtype=dtype), parallel_config)
    target = getattr(torch, dtype)
    handles = []

    def fill(pairs):
        def hook(*_):
            for param, source in pairs:
                param.data = source.data.to(target)  # an upcast (or the downcast of an upcast): exact

        return hook

    def empty(pairs):
        def hook(*_):
            for param, _source in pairs:
                param.data = torch.empty(0, dtype=target, device=param.device)

        return hook

    def lookup(pairs):
        def hook(*_):
            for param, source in pairs:
                param.data = source.data  # rows picked in the stored dtype, upcast after: the same values

        return hook

    def upcast(_module, _inputs, output):
        return output.to(target)

    with torch.no_grad():
        for twin, chunk in zip(twins, chunks):
            sources = dict(chunk.named_modules())
            buffers = dict(chunk.named_buffers())
            for name, buf in twin.named_buffers():  # rotary tables, a router's loaded expert bias
                buf.copy_(buffers[name])
            for name, module in twin.named_modules():
                pairs = [(p, sources[name]._parameters[n]) for n, p in module._parameters.items() if p is not None]
                tied = getattr(twin, "share_embeddings_and_output_weights", False) and getattr(
                    twin, "pre_process", False
                )
                if name.endswith("output_layer") and module.bias is None and not module.gather_output:
                    # The output layer reads the embedding's matrix when tied (passed in as its weight).
                    source = chunk.embedding.word_embeddings.weight if tied else pairs[0][1]
                    module.forward = _in_row_blocks(module, source, target)
                    for param, _ in pairs:
                        param.data = torch.empty(0, dtype=target, device=param.device)
                    continue
                if name.endswith("output_layer") and tied:
                    pairs.append((twin.embedding.word_embeddings.weight, chunk.embedding.word_embeddings.weight))
                if not pairs:
                    continue
                for param, _ in pairs:
                    param.data = torch.empty(0, dtype=target, device=param.device)
                if isinstance(module, VocabParallelEmbedding):
                    # A lookup (and its TP sum with zeros) is exact in any dtype: no float32 copy
                    # of the vocabulary matrix for the embedding (the output layer still needs one).
                    handles.append(module.register_forward_pre_hook(lookup(pairs)))
                    handles.append(module.register_forward_hook(upcast))
                else:
                    handles.append(module.register_forward_pre_hook(fill(pairs)))
                handles.append(module.register_forward_hook(empty(pairs)))
    try:
        yield twins
    finally:
        for h in handles:
            h.remove()


OUTPUT_BLOCK_BYTES = 16 * 2**20
"""Bytes of the output layer's matrix held in the twin's dtype at a time (a block of vocabulary rows)."""


def _in_row_blocks(module, source: torch.nn.Parameter, target: torch.dtype):
    """``module``'s (a bias-free, vocab-parallel output layer's) own forward, run on blocks of
    ``OUTPUT_BLOCK_BYTES`` of rows of ``source`` cast to ``target``, the logits concatenated: each
    logit is the same dot product, and the output layer's matrix (the largest in most models) never
    exists whole in ``target``."""
    forward = type(module).forward

    def blocked(input_, weight=None, runtime_gather_output=None, **kwargs):
        rows, full = source.shape[0], module.output_size_per_partition
        step = max(1, OUTPUT_BLOCK_BYTES // max(1, source.shape[1] * target.itemsize))
        out = []
        try:
            for start in range(0, rows, step):
                block = source.data[start : start + step].to(target)
                module.output_size_per_partition = block.shape[0]  # what its shape check expects
                out.append(forward(module, input_, weight=block, runtime_gather_output=False, **kwargs)[0])
        finally:
            module.output_size_per_partition = full
        return torch.cat(out, dim=-1), None

    return blocked


@contextlib.contextmanager
def capture_hidden(chunks, mesh, ends: set[int], store: dict):
    """While active, the output hidden states of the decoder layers numbered ``ends`` (0-based,
    global) go into ``store`` as float32 ``[b, s, hidden]`` on the ranks that hold them whole
    (TP rank 0 of DP/CP rank 0; gathered over TP under sequence parallelism)."""
    import torch.distributed as dist

    holder = mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0

    def hook_for(number: int, sequence_parallel: bool):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if sequence_parallel and mesh.size("tp") > 1:
                parts = [torch.empty_like(hidden) for _ in range(mesh.size("tp"))]
                dist.all_gather(parts, hidden.contiguous(), group=mesh.tp_group)
                hidden = torch.cat(parts, dim=0)
            if holder:
                store[number] = hidden.detach().float().transpose(0, 1).contiguous().cpu()

        return hook

    handles = []
    for chunk in chunks:
        for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
            if layer.layer_number - 1 in ends:  # Megatron numbers layers from 1, globally
                handles.append(
                    layer.register_forward_hook(hook_for(layer.layer_number - 1, chunk.config.sequence_parallel))
                )
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def gather_hidden(store: dict) -> Optional[dict]:
    """Every rank's captured hidden states merged on global rank 0 (None elsewhere); collective."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, store)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def grouped_forwards(
    chunks, model_cfg, parallel_config, mesh, input_ids: torch.Tensor, dtypes: list[str], layers_per_group: int
) -> tuple[dict, dict]:
    """({dtype: float32 logits on rank 0}, {dtype: {last layer of each group: hidden states}} on
    rank 0; None elsewhere) of the model in each dtype; collective. Holds the converted model plus
    one module in another dtype (``model_for_dtype``)."""
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.convert.verify_hf import layer_groups

    ends = {b - 1 for _, b in layer_groups(model_cfg.num_layers, layers_per_group)}
    logits, hidden = {}, {}
    for dtype in dtypes:
        store: dict = {}
        with (
            model_for_dtype(chunks, model_cfg, parallel_config, dtype) as model,
            capture_hidden(model, mesh, ends, store),
        ):
            logits[dtype] = megatron_logits(model, mesh, input_ids, model_cfg.vocab_size)
        hidden[dtype] = gather_hidden(store)
    return logits, hidden


def relative_diffs(a: torch.Tensor, b: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per real token: max |a - b| / max |b| over the hidden dimension (``[b, s, h]`` inputs)."""
    out = []
    for i, n in enumerate(lengths):
        ref = b[i, :n]
        out.append((a[i, :n] - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1).clamp_min(1e-12))
    return torch.cat(out)


def compare_groups(
    dtype: str, mine: dict, reference: dict, own: Optional[dict], groups: list[tuple[int, int]], lengths: list[int]
) -> tuple[str, Optional[str]]:
    """Set the Megatron ``mine`` hidden states ({last layer: tensor}) of the ``dtype`` forward
    against HF's float32 ``reference`` (and, for bf16/fp16, HF's ``own`` forward in ``dtype``),
    group by group. Returns the line to print and, when a group diverges, its description."""
    worst, first = None, None  # (value / bound, group, value, bound) closest to its bound; the first above
    for k, (a, b) in enumerate(groups):
        rel = relative_diffs(mine[b - 1], reference[b - 1], lengths)
        if own is None:
            value, bound = float(rel.max()), HIDDEN_TOLERANCE
        else:
            value = float(rel.mean())
            bound = max(GAP_FACTOR * float(relative_diffs(own[b - 1], reference[b - 1], lengths).mean()), HIDDEN_FLOOR)
        if worst is None or value / bound > worst[0]:
            worst = (value / bound, k, value, bound)
        if first is None and value > bound:
            first = (k, a, b, value, bound)
    kind = "max" if own is None else "per-token mean"
    head = (
        f"verify ({dtype} forward) hidden states: {len(groups)} layer groups of {groups[0][1] - groups[0][0]} "
        f"layer(s), {kind} relative diff (max |diff| / max |HF| per token)"
    )
    if first is None:
        _, k, value, bound = worst
        return (f"{head}: every group agrees (closest to its bound: group {k + 1}, {value:.3e} <= {bound:.3e})", None)
    k, a, b, value, bound = first
    layers = f"decoder layer {a}" if b - a == 1 else f"decoder layers {a}-{b - 1}"
    where = f"layer group {k + 1} of {len(groups)} ({layers})"
    return f"{head}: first diverging: {where}, {value:.3e} > {bound:.3e}", where
