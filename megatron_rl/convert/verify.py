"""``--verify`` of both converters: fixed prompts, Megatron's and HF's logits, and the tolerances.

The reference is HF's float32 forward of the same (rounded) weights; a bf16/fp16 Megatron
forward is judged against HF's own forward in that dtype (``check_logits``).

By default (``--verify-layers-per-group N``, N >= 1; default ``DEFAULT_LAYERS_PER_GROUP``) the
check runs layer group by layer group: HF's forward streams its weights from the safetensors one
part at a time (``megatron_rl.convert.verify_hf``), the Megatron forward runs on the converted model
itself, in another dtype through a twin filled one module at a time (``megatron_rl.convert.verify_groups``),
and the hidden states leaving each group of N decoder layers are compared too, so a failure names
the first group that diverges. Verifying then needs the converted model plus about one layer
group, not the model twice. ``--verify-layers-per-group 0`` loads both whole models as before.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from megatron_rl.convert.support import ToolError

TOLERANCES = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
"""Fixed ``--verify`` bounds on the max |logit difference| (fp32; the floor of a derived bf16/fp16 bound)."""
GAP_FACTOR = 3.0
"""A bf16/fp16 forward passes when it is within GAP_FACTOR x HF's own low-precision-vs-fp32 gap of the
fp32 reference (two correct implementations round differently: Megatron measured 1.0-1.4x the gap)."""
DEFAULT_LAYERS_PER_GROUP = 1
"""Decoder layers whose HF weights are read at a time by the layer-group verify (the least memory;
each group's hidden states are compared, so the first wrong layer is named)."""
VERIFY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Question: what is 12 times 7? Answer:",
)


def verify_inputs(tokenizer, vocab_size: int, multiple: int) -> tuple[torch.Tensor, list[int]]:
    """Fixed prompts as right-padded ids ``[prompts, seq]`` (seq a multiple of ``multiple``,
    for sequence parallelism) and their lengths. Without a tokenizer: fixed random ids."""
    if tokenizer is not None:
        prompts = [tokenizer.encode(p, add_special_tokens=False)[:64] for p in VERIFY_PROMPTS]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (16, 11, 7)]
    lengths = [len(p) for p in prompts]
    seq = -(-max(lengths) // multiple) * multiple
    ids = torch.zeros(len(prompts), seq, dtype=torch.long)  # pad id 0: causal attention never looks right
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids, lengths


# ------------------------------------------------------------------------------------------
# Logits for --verify.
# ------------------------------------------------------------------------------------------
def megatron_logits(chunks, mesh, input_ids: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """Full-vocabulary float32 logits ``[b, s, vocab_size]`` of a sharded model, on global rank 0
    (None elsewhere); collective. Runs the chunks stage by stage (virtual stages in order) with
    explicit send/recv over the pipeline group, then gathers the vocab-parallel logits over TP."""
    import torch.distributed as dist

    device = next(chunks[0].parameters()).device
    config = chunks[0].config
    pp, stage, pp_ranks = mesh.size("pp"), mesh.pp_rank, mesh.ranks("pp")
    b, s = input_ids.shape
    input_ids = input_ids.to(device)
    position_ids = torch.arange(s, device=device).expand(b, s)
    local_s = s // mesh.size("tp") if config.sequence_parallel else s
    logits = None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            chunk.eval()
            first, last = v == 0 and stage == 0, v == len(chunks) - 1 and stage == pp - 1
            if not first:
                hidden = torch.empty(local_s, b, config.hidden_size, dtype=config.params_dtype, device=device)
                dist.recv(hidden, src=pp_ranks[stage - 1] if stage > 0 else pp_ranks[-1])
                chunk.set_input_tensor(hidden)
            out = chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
            if last:
                logits = out
            else:
                dist.send(out.contiguous(), dst=pp_ranks[stage + 1] if stage < pp - 1 else pp_ranks[0])
    if logits is not None:  # the vocab-parallel parts go to the TP group's first rank only
        logits = _gather_vocab_parts(logits.contiguous(), mesh)
        if logits is not None:
            logits = logits[..., :vocab_size].float().contiguous()
    # One holder of the full logits sends them to rank 0.
    holder = logits is not None and mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0
    holders = [None] * dist.get_world_size()
    dist.all_gather_object(holders, holder)
    src = holders.index(True)
    if src == dist.get_rank() == 0:
        return logits.cpu()
    if dist.get_rank() == src:
        dist.send(logits, dst=0)
    elif dist.get_rank() == 0:
        logits = torch.empty(b, s, vocab_size, dtype=torch.float32, device=device)
        dist.recv(logits, src=src)
        return logits.cpu()
    return None


def _gather_vocab_parts(part: torch.Tensor, mesh) -> Optional[torch.Tensor]:
    """``[b, s, V]`` logits from each TP rank's ``[b, s, V / tp]`` part on the TP group's first rank
    (None on the others); collective over the TP group. A gather, not an all-gather: the other ranks
    never hold the full logits (with a large vocabulary, the largest tensor of the verify)."""
    import torch.distributed as dist

    tp = mesh.size("tp")
    if tp == 1:
        return part
    dst = mesh.ranks("tp")[0]
    if mesh.tp_rank != 0:
        dist.gather(part, None, dst=dst, group=mesh.tp_group)
        return None
    parts = torch.empty((tp, *part.shape), dtype=part.dtype, device=part.device)
    dist.gather(part, list(parts.unbind(0)), dst=dst, group=mesh.tp_group)
    del part
    return parts.permute(1, 2, 0, 3).reshape(*parts.shape[1:3], -1)  # [b, s, tp * V / tp], rank-major


def hf_logits(hf_dir: str | os.PathLike, input_ids: torch.Tensor, weight_dtype: torch.dtype, compute_dtypes) -> Any:
    """Float32 logits of the HF checkpoint in ``hf_dir`` (transformers, eager attention, CPU):
    weights rounded to ``weight_dtype`` (the Megatron model's), forward in each of ``compute_dtypes``
    (one dtype: one tensor; a tuple: a tuple of tensors, the model loaded once)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    single = isinstance(compute_dtypes, torch.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=weight_dtype, attn_implementation="eager", local_files_only=True
    ).eval()
    outs = []
    with torch.no_grad():
        for dtype in (compute_dtypes,) if single else compute_dtypes:
            model = model.to(dtype)  # an upcast of the rounded weights is exact; downcasts follow upcasts only
            outs.append(model(input_ids=input_ids).logits.float())
    del model
    return outs[0] if single else tuple(outs)


def max_logit_diff(a: torch.Tensor, b: torch.Tensor, lengths: list[int]) -> float:
    """Max |a - b| over the real (unpadded) positions of each prompt."""
    return max(float((a[i, :n] - b[i, :n]).abs().max()) for i, n in enumerate(lengths))


def mean_logit_diff(a: torch.Tensor, b: torch.Tensor, lengths: list[int]) -> float:
    """Mean over the real positions of the per-token max |a - b| (a few tokens whose MoE routing a
    rounding flipped move the max, not this; a wrong mapping moves every token)."""
    per_token = torch.cat([(a[i, :n] - b[i, :n]).abs().amax(dim=-1) for i, n in enumerate(lengths)])
    return float(per_token.mean())


class VerifySettings(list):
    """The compute dtypes of ``--verify``'s Megatron forwards (a list, float32 first), carrying
    ``layers_per_group`` (0: whole models) to the ranks' ``verify_forwards``."""

    def __init__(self, dtypes, layers_per_group: int = 0):
        super().__init__(dtypes)
        self.layers_per_group = layers_per_group


class ForwardResults(dict):
    """{compute dtype: Megatron float32 logits} from ``verify_forwards``, carrying ``hidden``
    ({dtype: {last layer of each group: hidden states}}) and ``layers_per_group`` to ``check_logits``."""

    def __init__(self, logits: dict, hidden: Optional[dict] = None, layers_per_group: int = 0):
        super().__init__(logits)
        self.hidden, self.layers_per_group = hidden or {}, layers_per_group


def add_verify_args(p) -> None:
    """--verify / --verify-dtype / --tolerance / --verify-layers-per-group (both converters)."""
    p.add_argument("--verify", action="store_true", help="compare logits with the other side on fixed prompts")
    p.add_argument(
        "--verify-dtype",
        choices=("fp32", "model", "both"),
        default="fp32",
        help="compute dtype of the Megatron forward: fp32 (default; the converted weights' values, "
        "upcast, so the check measures the mapping and not bf16 rounding), the model's own dtype "
        "(bf16/fp16: its per-token mean |logit diff| from HF's fp32 forward of the same weights must be "
        f"within {GAP_FACTOR:g} x that of HF's own bf16 forward on the same prompts, printed), or both",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="bound on max |logit diff| in every dtype (default: 1e-4 for fp32 compute; for bf16/fp16 "
        f"compute a bound on the per-token mean, {GAP_FACTOR:g} x HF's own gap, at least 2e-2)",
    )
    p.add_argument(
        "--verify-layers-per-group",
        type=int,
        default=DEFAULT_LAYERS_PER_GROUP,
        metavar="N",
        help="verify layer group by layer group: HF's reference reads the weights of N decoder layers at a "
        "time from the safetensors and the Megatron forward runs on the converted model (another "
        "dtype one module at a time), so verifying needs about the checkpoint plus one group in RAM; "
        "the hidden states after each group are compared too and a failure names the first group "
        f"that diverges (default {DEFAULT_LAYERS_PER_GROUP}; 0: both whole models at once, about "
        "twice the checkpoint or more)",
    )


def verify_settings(args, model_dtype: str) -> VerifySettings:
    """Compute dtypes of the Megatron forwards ``--verify`` runs (fp32 first), with the group size;
    a ``ValueError`` naming ``--verify-layers-per-group`` when it is negative."""
    from megatron_rl.convert.verify_hf import layer_groups

    per_group = getattr(args, "verify_layers_per_group", 0)
    layer_groups(1, per_group)  # checks it
    dtypes = {"fp32": ["float32"], "model": [model_dtype], "both": ["float32", model_dtype]}[args.verify_dtype]
    return VerifySettings(dict.fromkeys(dtypes), per_group)


def _references(hf_dir, input_ids: torch.Tensor, weight_dtype: torch.dtype, low: list[str], layers_per_group: int):
    """HF's logits [float32, *low] and, layer group by layer group, its hidden states (else Nones)."""
    dtypes = (torch.float32, *(getattr(torch, d) for d in low))
    if not layers_per_group:
        return list(hf_logits(hf_dir, input_ids, weight_dtype, dtypes)), [None] * len(dtypes)
    from megatron_rl.convert.verify_hf import hf_stream_forward

    runs = [hf_stream_forward(hf_dir, input_ids, weight_dtype, d, layers_per_group) for d in dtypes]
    return [r[0] for r in runs], [r[1] for r in runs]


def check_logits(
    logits: dict,
    hf_dir: str | os.PathLike,
    input_ids: torch.Tensor,
    weight_dtype: torch.dtype,
    lengths: list[int],
    tolerance: Optional[float],
) -> dict:
    """Compare the Megatron ``logits`` (compute dtype name -> tensor) with the HF model in ``hf_dir``;
    print one verify line per dtype; a ``ToolError`` if one fails. Returns {dtype: diff}.

    The reference is HF's float32 forward of the same (rounded) weights. A float32 forward must
    match it within ``tolerance`` (default 1e-4). A bf16/fp16 forward is compared like with like:
    its per-token mean |logit diff| (``mean_logit_diff``: robust to the few tokens whose MoE routing
    a rounding flips, which dominate the max) must stay within ``GAP_FACTOR`` x the same figure of
    HF's own forward in that dtype on the same prompts (at least ``TOLERANCES[dtype]``); the max
    is printed beside it. A given ``tolerance`` bounds the max instead, in every dtype.

    ``logits`` from the layer-group verify (a ``ForwardResults`` with ``layers_per_group`` >= 1):
    HF's forwards stream their weights group by group, and each group's hidden states are compared
    too (``megatron_rl.convert.verify_groups.compare_groups``: one more line per dtype); the logits stay
    the verdict, and a failure names the first layer group that diverges."""
    per_group = getattr(logits, "layers_per_group", 0)
    low = [d for d in logits if d != "float32"]
    refs, ref_hidden = _references(hf_dir, input_ids, weight_dtype, low, per_group)
    reference, diffs, failed = refs[0], {}, []
    for dtype, mine in logits.items():
        diff = max_logit_diff(mine, reference, lengths)
        diffs[dtype] = diff
        if dtype == "float32" or tolerance is not None:
            bound = tolerance if tolerance is not None else TOLERANCES["float32"]
            ok, how = diff <= bound, (" (--tolerance)" if tolerance is not None else "")
            line = f"max |logit diff| = {diff:.3e}"
        else:
            own = refs[1 + low.index(dtype)]
            gap, mean_gap = max_logit_diff(own, reference, lengths), mean_logit_diff(own, reference, lengths)
            mean = mean_logit_diff(mine, reference, lengths)
            bound = max(GAP_FACTOR * mean_gap, TOLERANCES[dtype])
            ok = mean <= bound
            line = f"per-token mean |logit diff| = {mean:.3e} (max {diff:.3e})"
            how = (
                f" = max({GAP_FACTOR:g} x HF's own {dtype}-vs-float32 gap on these prompts, {TOLERANCES[dtype]:.0e}) "
                f"(that gap: per-token mean {mean_gap:.3e}, max {gap:.3e})"
            )
        print(
            f"verify ({dtype} forward): {line} over {len(lengths)} prompts ({sum(lengths)} tokens), tolerance "
            f"{bound:.3e}{how}: {'OK' if ok else 'FAILED'}",
            flush=True,
        )
        where = None
        if per_group:
            from megatron_rl.convert.verify_groups import compare_groups
            from megatron_rl.convert.verify_hf import layer_groups

            groups = layer_groups(max(ref_hidden[0]) + 1, per_group)  # HF's decoder layers
            own_hidden = None if dtype == "float32" else ref_hidden[1 + low.index(dtype)]
            group_line, where = compare_groups(dtype, logits.hidden[dtype], ref_hidden[0], own_hidden, groups, lengths)
            print(group_line, flush=True)
        if not ok:
            failed.append(
                f"{line.split(' = ')[0]} {line.split(' = ')[1].split(' ')[0]} of the {dtype} forward "
                f"exceeds the tolerance {bound:.3e}"
            )
            if per_group:
                failed[-1] += (
                    f" (first diverging: {where})"
                    if where
                    else " (the hidden states of every layer group agree: it arises after the last decoder "
                    "layer, in the final norm or the output layer)"
                )
    if failed:
        raise ToolError(f"--verify: {'; '.join(failed)}; the output was not written (raise --tolerance to accept it)")
    return diffs


def model_in_dtype(chunks, model_cfg, parallel_config, dtype: str, *, release: bool = False):
    """A model of ``parallel_config``'s layout with parameters in ``dtype`` holding the values of
    ``chunks`` (whose config is ``model_cfg``): ``chunks`` themselves when already in ``dtype``,
    else a fresh empty build (``megatron_rl.convert.streamed_model``) filled parameter by parameter (an upcast,
    or the downcast of an upcast: exact). ``release``: each source parameter's storage is freed
    once copied, so the two models never both exist in full (``chunks`` is unusable afterwards)."""
    import dataclasses

    from megatron_rl.convert.streamed_model import build_empty_model

    if model_cfg.params_dtype == dtype:
        return chunks
    copies = build_empty_model(dataclasses.replace(model_cfg, params_dtype=dtype), parallel_config)
    with torch.no_grad():
        for copy, chunk in zip(copies, chunks):
            params, buffers = dict(chunk.named_parameters()), dict(chunk.named_buffers())
            for name, buf in copy.named_buffers():  # a router's loaded expert bias
                buf.copy_(buffers[name])
            for name, param in copy.named_parameters():
                param.copy_(params[name])
                if release:
                    params[name].data = torch.empty(0, dtype=params[name].dtype)
    return copies


def verify_forwards(
    chunks, model_cfg, parallel_config, mesh, input_ids: torch.Tensor, dtypes: list[str], *, release: bool = False
) -> dict:
    """{compute dtype: full float32 logits on rank 0 (None elsewhere)} of the model in each dtype
    (in that order); collective. ``release``: ``chunks`` is given up (``model_in_dtype``), so a
    verify in another dtype holds one model at a time -- the float32 one at most.

    ``dtypes`` from ``verify_settings`` with ``layers_per_group`` >= 1: the layer-group verify
    (``megatron_rl.convert.verify_groups.grouped_forwards``: ``chunks`` kept, another dtype one module at
    a time), returning a ``ForwardResults`` with the groups' hidden states; ``release`` is moot."""
    import dataclasses

    per_group = getattr(dtypes, "layers_per_group", 0)
    if per_group:
        from megatron_rl.convert.verify_groups import grouped_forwards

        logits, hidden = grouped_forwards(chunks, model_cfg, parallel_config, mesh, input_ids, list(dtypes), per_group)
        return ForwardResults(logits, hidden, per_group)
    out, current, cfg = {}, chunks, model_cfg
    for dtype in dtypes:
        nxt = model_in_dtype(current, cfg, parallel_config, dtype, release=release)
        if not release and current is not chunks:
            del current  # a converted copy: only the next one is needed
        current, cfg = nxt, dataclasses.replace(cfg, params_dtype=dtype)
        out[dtype] = megatron_logits(current, mesh, input_ids, model_cfg.vocab_size)
    return out
