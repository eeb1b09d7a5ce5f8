"""``--verify`` of both converters: fixed prompts, Megatron's and HF's logits, and the tolerances.

The reference is HF's float32 forward of the same (rounded) weights; a bf16/fp16 Megatron
forward is judged against HF's own forward in that dtype (``check_logits``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from tools.convert_common import ToolError

TOLERANCES = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
"""Fixed ``--verify`` bounds on the max |logit difference| (fp32; the floor of a derived bf16/fp16 bound)."""
GAP_FACTOR = 3.0
"""A bf16/fp16 forward passes when it is within GAP_FACTOR x HF's own low-precision-vs-fp32 gap of the
fp32 reference (two correct implementations round differently: Megatron measured 1.0-1.4x the gap)."""
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
    if logits is not None:
        parts = [torch.empty_like(logits) for _ in range(mesh.size("tp"))]
        dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
        logits = torch.cat(parts, dim=-1)[..., :vocab_size].float().contiguous()
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


def hf_logits(hf_dir: str | os.PathLike, input_ids: torch.Tensor, weight_dtype: torch.dtype,
              compute_dtypes) -> Any:
    """Float32 logits of the HF checkpoint in ``hf_dir`` (transformers, eager attention, CPU):
    weights rounded to ``weight_dtype`` (the Megatron model's), forward in each of ``compute_dtypes``
    (one dtype: one tensor; a tuple: a tuple of tensors, the model loaded once)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    single = isinstance(compute_dtypes, torch.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=weight_dtype, attn_implementation="eager",
                                                 local_files_only=True).eval()
    outs = []
    with torch.no_grad():
        for dtype in ((compute_dtypes,) if single else compute_dtypes):
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


def add_verify_args(p) -> None:
    """--verify / --verify-dtype / --tolerance (both converters)."""
    p.add_argument("--verify", action="store_true", help="compare logits with the other side on fixed prompts")
    p.add_argument("--verify-dtype", choices=("fp32", "model", "both"), default="fp32",
                   help="compute dtype of the Megatron forward: fp32 (default; the converted weights' values, "
                        "upcast, so the check measures the mapping and not bf16 rounding), the model's own dtype "
                        "(bf16/fp16: its per-token mean |logit diff| from HF's fp32 forward of the same weights must be "
                        f"within {GAP_FACTOR:g} x that of HF's own bf16 forward on the same prompts, printed), or both")
    p.add_argument("--tolerance", type=float, default=None,
                   help="bound on max |logit diff| in every dtype (default: 1e-4 for fp32 compute; for bf16/fp16 "
                        f"compute a bound on the per-token mean, {GAP_FACTOR:g} x HF's own gap, at least 2e-2)")


def verify_settings(args, model_dtype: str) -> list[str]:
    """Compute dtypes of the Megatron forwards ``--verify`` runs (fp32 first)."""
    dtypes = {"fp32": ["float32"], "model": [model_dtype], "both": ["float32", model_dtype]}[args.verify_dtype]
    return list(dict.fromkeys(dtypes))


def check_logits(logits: dict, hf_dir: str | os.PathLike, input_ids: torch.Tensor, weight_dtype: torch.dtype,
                 lengths: list[int], tolerance: Optional[float]) -> dict:
    """Compare the Megatron ``logits`` (compute dtype name -> tensor) with the HF model in ``hf_dir``;
    print one verify line per dtype; a ``ToolError`` if one fails. Returns {dtype: diff}.

    The reference is HF's float32 forward of the same (rounded) weights. A float32 forward must
    match it within ``tolerance`` (default 1e-4). A bf16/fp16 forward is compared like with like:
    its per-token mean |logit diff| (``mean_logit_diff``: robust to the few tokens whose MoE routing
    a rounding flips, which dominate the max) must stay within ``GAP_FACTOR`` x the same figure of
    HF's own forward in that dtype on the same prompts (at least ``TOLERANCES[dtype]``); the max
    is printed beside it. A given ``tolerance`` bounds the max instead, in every dtype."""
    low = [d for d in logits if d != "float32"]
    refs = hf_logits(hf_dir, input_ids, weight_dtype,
                     (torch.float32, *(getattr(torch, d) for d in low)))
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
            how = (f" = max({GAP_FACTOR:g} x HF's own {dtype}-vs-float32 gap on these prompts, {TOLERANCES[dtype]:.0e}) "
                   f"(that gap: per-token mean {mean_gap:.3e}, max {gap:.3e})")
        print(f"verify ({dtype} forward): {line} over {len(lengths)} prompts ({sum(lengths)} tokens), tolerance "
              f"{bound:.3e}{how}: {'OK' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(f"{line.split(' = ')[0]} {line.split(' = ')[1].split(' ')[0]} of the {dtype} forward "
                          f"exceeds the tolerance {bound:.3e}")
    if failed:
        raise ToolError(f"--verify: {'; '.join(failed)}; the output was not written (raise --tolerance to accept "
                        f"it)")
    return diffs


def model_in_dtype(chunks, model_cfg, parallel_config, dtype: str, *, release: bool = False):
    """A model of ``parallel_config``'s layout with parameters in ``dtype`` holding the values of
    ``chunks`` (whose config is ``model_cfg``): ``chunks`` themselves when already in ``dtype``,
    else a fresh empty build (``tools.convert_stream``) filled parameter by parameter (an upcast,
    or the downcast of an upcast: exact). ``release``: each source parameter's storage is freed
    once copied, so the two models never both exist in full (``chunks`` is unusable afterwards)."""
    import dataclasses

    from tools.convert_stream import build_empty_model

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


def verify_forwards(chunks, model_cfg, parallel_config, mesh, input_ids: torch.Tensor, dtypes: list[str], *,
                    release: bool = False) -> dict:
    """{compute dtype: full float32 logits on rank 0 (None elsewhere)} of the model in each dtype
    (in that order); collective. ``release``: ``chunks`` is given up (``model_in_dtype``), so a
    verify in another dtype holds one model at a time -- the float32 one at most."""
    import dataclasses

    out, current, cfg = {}, chunks, model_cfg
    for dtype in dtypes:
        nxt = model_in_dtype(current, cfg, parallel_config, dtype, release=release)
        if not release and current is not chunks:
            del current  # a converted copy: only the next one is needed
        current, cfg = nxt, dataclasses.replace(cfg, params_dtype=dtype)
        out[dtype] = megatron_logits(current, mesh, input_ids, model_cfg.vocab_size)
    return out

