"""Sequence packing + token-budget micro-batches vs padded micro-batches: one actor update each.

An RL-shaped batch -- prompts uniform in [32, 256] tokens, responses log-normal (mean about a
quarter of the 2,048-token limit, clipped at it) -- goes through one actor ``update_policy``
(forward + backward + optimizer step) twice, in the same process on the same weights:

* ``padded``: ``megatron.use_remove_padding=False``, ``ppo_micro_batch_size_per_gpu`` rows per
  micro-batch, each padded to its longest row (what every micro-batch cost before packing);
* ``packed``: ``use_remove_padding=True`` + ``use_dynamic_bsz`` with a budget ``B`` = micro-batch
  rows x the longest possible row, i.e. the most tokens a padded micro-batch can hold.

Printed: the padding fraction of the padded run (padding tokens / tokens it processes), the ideal
speed-up ``1 / (1 - padding fraction)`` (all padding FLOPs removed, nothing else gained), the
measured speed-up (padded time / packed time; timings alternate and the median is kept) and the
peak memory of one micro-batch each: a packed budget-``B`` micro-batch vs a padded micro-batch
holding ``B`` tokens (``peak_ratio``, packed over padded; growth over the parameters, gradients and
optimizer state, which both share). Memory: on CPU the exact high-water mark of live tensor bytes
(``tools.measure_memory.StorageTracker``), on CUDA ``torch.cuda.max_memory_allocated``.

    python tools/bench_packing.py                        # CPU: a small Qwen3-shaped model
    python tools/bench_packing.py --preset qwen3-0.6b --dtype bf16   # one GPU
    python tools/bench_packing.py --smoke                # seconds: the test suite's run

The last line printed is one JSON object (``padding_fraction``, ``ideal_speedup``, ``speedup``,
``peak_ratio``, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESETS = {
    "smoke": dict(
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=32,
        vocab_size=256,
    ),
    "cpu-small": dict(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=384,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        vocab_size=2048,
    ),
    "qwen3-0.6b": dict(
        num_layers=28,
        hidden_size=1024,
        ffn_hidden_size=3072,
        num_attention_heads=16,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=151936,
    ),
}
"""Qwen3-shaped (RMSNorm, q/k norm, GQA, SwiGLU, untied head): a CPU size and Qwen3-0.6B for GPUs."""


def make_workload(
    num_samples: int, prompt_range: tuple[int, int], max_response: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_lengths, response_lengths)``: prompts uniform in ``prompt_range``; responses
    log-normal (sigma 1) with median ``max_response / 4 / e^0.5`` -- mean about a quarter of the
    limit -- clipped to ``[1, max_response]``."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt_range[0], prompt_range[1] + 1, (num_samples,), generator=g)
    mu = math.log(max_response / 4) - 0.5
    normal = torch.randn(num_samples, generator=g, dtype=torch.float64)
    responses = torch.exp(mu + normal).round().clamp(1, max_response).long()
    return prompts, responses


def make_batch(
    prompts: torch.Tensor, responses: torch.Tensor, max_prompt: int, max_response: int, vocab: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """verl's layout: left-padded prompts, right-padded responses, advantages and old log-probs."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompts)
    prompt_mask = (torch.arange(max_prompt)[None] >= max_prompt - prompts[:, None]).long()
    response_mask = (torch.arange(max_response)[None] < responses[:, None]).long()
    mask = torch.cat([prompt_mask, response_mask], 1)
    ids = torch.randint(1, vocab, (n, max_prompt + max_response), generator=g) * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "responses": ids[:, max_prompt:],
        "response_mask": response_mask,
        "advantages": torch.randn(n, max_response, generator=g) * response_mask,
        "old_log_probs": (-torch.rand(n, max_response, generator=g) - 6.0) * response_mask,
    }


def _select(batch: dict, rows) -> dict:
    index = torch.as_tensor(rows, dtype=torch.long)
    return {k: v[index] for k, v in batch.items()}


def _actor(model_kw: dict, mesh, *, packed: bool, rows: int, micro: int, budget: int):
    from megatron_rl.config import ActorConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.roles import build_role

    cfg = dict(
        ppo_mini_batch_size=rows,
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=micro,
        calculate_entropy=False,
        use_dynamic_bsz=packed,
        ppo_max_token_len_per_gpu=budget,
        optim={"optimizer": "sgd", "lr": 0.0, "weight_decay": 0.0, "clip_grad": 1.0},
    )
    return build_role("actor", ModelConfig(**model_kw), mesh, ActorConfig.from_dict(cfg), remove_padding=packed)


def _peak_of_update(actor, batch: dict, device: str) -> int:
    """Peak memory of one ``update_policy`` above what exists before it (parameters, gradients,
    optimizer state): live tensor bytes on CPU, allocator bytes on CUDA."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        actor.update_policy(batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from tools.measure_memory import StorageTracker, _static_tensors

    tracker = StorageTracker()
    for tensor in _static_tensors(actor.engine):
        tracker.register(tensor)
    static = tracker.current
    with tracker:
        actor.update_policy(batch)
    return tracker.peak - static


def run(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from megatron_rl.engine.batching import fixed_micro_batches, token_budget_micro_batches
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_len = args.max_prompt + args.max_response
    model_kw = dict(
        PRESETS[args.preset],
        params_dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
        max_position_embeddings=max_len,
        qk_layernorm=True,
    )
    prompts, responses = make_workload(args.samples, (args.min_prompt, args.max_prompt), args.max_response, args.seed)
    batch = make_batch(prompts, responses, args.max_prompt, args.max_response, model_kw["vocab_size"], args.seed)
    batch = {k: v.to(device) for k, v in batch.items()}
    n, budget = args.samples, args.micro_batch_size * max_len
    lengths = (prompts + responses).tolist()
    valid = sum(lengths)
    padded_tokens = sum(
        len(mb) * max(lengths[i] for i in mb) for mb in fixed_micro_batches(n, args.micro_batch_size).indices
    )
    packed_plan = token_budget_micro_batches(lengths, budget)

    mesh = init_mesh(ParallelConfig(), seed=args.seed)
    padded = _actor(model_kw, mesh, packed=False, rows=n, micro=args.micro_batch_size, budget=budget)
    packed = _actor(model_kw, mesh, packed=True, rows=n, micro=args.micro_batch_size, budget=budget)
    with torch.no_grad():  # the same weights (and lr 0: they stay the same)
        for (_, p), (_, q) in zip(padded.engine.named_parameters(), packed.engine.named_parameters()):
            q.copy_(p)
    warm = _select(batch, range(min(n, 2 * args.micro_batch_size)))
    for actor in (padded, packed):  # a mini-batch larger than the batch is the whole batch
        actor.update_policy(warm)  # first touch of every kernel and buffer, outside the timings
    times = {"padded": [], "packed": []}
    for _ in range(args.repeats):
        for name, actor in (("padded", padded), ("packed", packed)):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            actor.update_policy(batch)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    padded_s, packed_s = statistics.median(times["padded"]), statistics.median(times["packed"])

    # Peak memory of one micro-batch each: a padded one holding B tokens (micro_batch_size rows, one of
    # the longest possible length) vs a packed one of the workload's rows filled up to B tokens.
    full = make_batch(
        torch.tensor([args.max_prompt]),
        torch.tensor([args.max_response]),
        args.max_prompt,
        args.max_response,
        model_kw["vocab_size"],
        args.seed + 1,
    )
    rows = _select(batch, range(args.micro_batch_size - 1))
    padded_mb = {k: torch.cat([rows[k], full[k].to(device)]) for k in batch}
    chosen, filled = [], 0
    for i, length in enumerate(lengths):  # first fit: a packed micro-batch as close to B tokens as rows allow
        if filled + length <= budget:
            chosen.append(i)
            filled += length
    packed_mb = _select(batch, chosen)
    peaks = {}
    for name, actor, mb in (("padded", padded, padded_mb), ("packed", packed, packed_mb)):
        peaks[name] = _peak_of_update(actor, mb, device)
    padding_fraction = 1.0 - valid / padded_tokens
    ideal = 1.0 / (1.0 - padding_fraction)
    speedup = padded_s / packed_s
    return {
        "preset": args.preset,
        "device": device,
        "dtype": args.dtype,
        "samples": n,
        "micro_batch_size": args.micro_batch_size,
        "token_budget": budget,
        "valid_tokens": valid,
        "padded_tokens": padded_tokens,
        "mean_response": round(float(responses.float().mean()), 1),
        "padded_micro_batches": math.ceil(n / args.micro_batch_size),
        "packed_micro_batches": len(packed_plan),
        "padding_fraction": round(padding_fraction, 4),
        "ideal_speedup": round(ideal, 3),
        "padded_s": round(padded_s, 6),
        "packed_s": round(packed_s, 6),
        "speedup": round(speedup, 3),
        "speedup_over_ideal": round(speedup / ideal, 3),
        "padded_mb_tokens": int(padded_mb["attention_mask"].shape[0] * max_len),
        "packed_mb_tokens": int(packed_mb["attention_mask"].sum()),
        "padded_peak_bytes": int(peaks["padded"]),
        "packed_peak_bytes": int(peaks["packed"]),
        "peak_ratio": round(peaks["packed"] / peaks["padded"], 4),
    }


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-response", type=int, default=2048)
    p.add_argument(
        "--micro-batch-size", type=int, default=4, help="rows per padded micro-batch; budget = this x max length"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed updates of each kind, alternating (median kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="16 short samples on the smoke preset (seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.samples, args.min_prompt, args.max_prompt, args.max_response, args.repeats = (
            "smoke",
            16,
            4,
            16,
            64,
            1,
        )
    for name in ("samples", "min_prompt", "max_prompt", "max_response", "micro_batch_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt={args.min_prompt} must be <= --max-prompt={args.max_prompt}")
    if args.samples % args.micro_batch_size:
        p.error(f"--samples={args.samples} must be a multiple of --micro-batch-size={args.micro_batch_size}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    from parallel.testing import run_distributed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    result = run_distributed(run, 1, args, backend=backend, timeout_s=3600)[0]
    print(
        f"padding {result['padding_fraction']:.1%} -> ideal x{result['ideal_speedup']:.2f}; measured "
        f"x{result['speedup']:.2f} ({result['padded_s']:.2f} s padded vs {result['packed_s']:.2f} s packed, "
        f"{result['speedup_over_ideal']:.2f} of ideal); peak of a {result['token_budget']}-token micro-batch: "
        f"packed / padded = {result['peak_ratio']:.3f}",
        file=sys.stderr,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
