"""Time one full actor training step (fwd + bwd + optimizer): the actor role's update_policy.

Runs a GRPO-style policy update on random tokens for a dense or MoE GPT at the sizes given,
on the current device (one rank), and reports tokens/s, model FLOP utilisation and peak
memory. Presets: ``tiny`` (CPU default), ``tiny-moe`` (CPU), ``dense-1b`` (h2048, 16 layers, GQA
16/8, SwiGLU 6144, vocab 151936 - the model of docs/benchmarks.md, "GPU reference figures") and ``moe`` (h1024, 8
layers, 16 experts top-2). Micro-batches are packed THD sequences (the engine's default);
``--padded`` runs them as padded rows (``megatron.use_remove_padding=False``). ``--offload`` also
times the engine's host-memory round trip (``offload_to_cpu`` + ``load_to_device`` of parameters,
gradient buffers and optimizer state; a no-op without CUDA) and checks a step still runs after it.
Prints, last, one JSON line.

    python tools/bench_train_step.py                         # tiny, CPU
    python tools/bench_train_step.py --preset dense-1b --seq 4096 --mbs 2 --dtype bf16   # GPU
    python tools/bench_train_step.py --preset dense-1b --seq 1024 --mbs 1 --dtype bf16 --offload
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

PRESETS = {
    "tiny": dict(
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2, vocab_size=2048
    ),
    "tiny-moe": dict(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=2048,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=128,
    ),
    "dense-1b": dict(
        num_layers=16,
        hidden_size=2048,
        ffn_hidden_size=6144,
        num_attention_heads=16,
        num_query_groups=8,
        vocab_size=151936,
    ),
    "moe": dict(
        num_layers=8,
        hidden_size=1024,
        ffn_hidden_size=4096,
        num_attention_heads=16,
        num_query_groups=8,
        vocab_size=151936,
        num_moe_experts=16,
        moe_router_topk=2,
        moe_ffn_hidden_size=1024,
    ),
}


def _flops_per_token(m: dict, seq: int) -> float:
    """Training FLOPs per token: 6 x active params + causal attention (as in docs/benchmarks.md)."""
    h, layers, ffn = m["hidden_size"], m["num_layers"], m["ffn_hidden_size"]
    head_dim = h // m["num_attention_heads"]
    kv = m["num_query_groups"] * head_dim
    attn = h * (h + 2 * kv) + h * h
    if m.get("num_moe_experts"):
        mlp = m["moe_router_topk"] * 3 * h * m["moe_ffn_hidden_size"] + h * m["num_moe_experts"]
    else:
        mlp = 3 * h * ffn
    active = layers * (attn + mlp) + h * m["vocab_size"]  # output layer; embedding lookup is free
    return 6 * active + 6 * layers * h * seq


def run(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.roles import build_role
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    model_kw = dict(
        PRESETS[args.preset],
        params_dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
        max_position_embeddings=max(args.seq, 128),
    )
    mesh = init_mesh(ParallelConfig(), seed=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.mbs * args.micro_batches
    actor = build_role(
        "actor",
        ModelConfig(**model_kw),
        mesh,
        ActorConfig(
            ppo_mini_batch_size=n,
            ppo_micro_batch_size_per_gpu=args.mbs,
            optim=OptimConfig(lr=1e-6),
            calculate_entropy=False,
        ),
        remove_padding=not args.padded,
    )
    prompt = args.seq // 4
    response = args.seq - prompt
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model_kw["vocab_size"], (n, args.seq), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(n, args.seq, dtype=torch.long),
        "responses": ids[:, prompt:],
        "response_mask": torch.ones(n, response, dtype=torch.long),
        "old_log_probs": torch.full((n, response), -2.0),
        "advantages": torch.randn(n, response, generator=g),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    times = []
    for step in range(args.warmup + args.steps):
        if device == "cuda":
            torch.cuda.synchronize()
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        actor.update_policy(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tokens = n * args.seq
    tflops = _flops_per_token(model_kw, args.seq) * tokens / step_s / 1e12
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    offload = _offload_round_trip(actor, batch, device) if args.offload else {}
    return {
        **offload,
        "preset": args.preset,
        "device": device,
        "dtype": args.dtype,
        "seq": args.seq,
        "mbs": args.mbs,
        "micro_batches": args.micro_batches,
        "step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(tokens / step_s, 1),
        "model_tflops": round(tflops, 3),
        "mfu": round(tflops / args.peak_tflops, 4) if args.peak_tflops else None,
        "peak_bytes": int(peak),
        "packed": not args.padded,
    }


def _offload_round_trip(actor, batch: dict, device: str) -> dict:
    """Time ``offload_to_cpu`` and ``load_to_device``; the device bytes they free and restore; one
    update afterwards (the optimizer state survived)."""
    engine = actor.engine

    def allocated() -> int:
        return torch.cuda.memory_allocated() if device == "cuda" else 0

    before = allocated()
    t0 = time.perf_counter()
    engine.offload_to_cpu()
    t1 = time.perf_counter()
    after_offload = allocated()
    engine.load_to_device()
    t2 = time.perf_counter()
    restored = allocated()
    metrics = actor.update_policy(batch)
    moved = before - after_offload
    return {
        "offload_s": round(t1 - t0, 4),
        "reload_s": round(t2 - t1, 4),
        "offloaded_bytes": int(moved),
        "restored_bytes": int(restored - after_offload),
        "offload_gb_per_s": round(moved / (t1 - t0) / 1e9, 2) if moved else None,
        "update_after_reload_ok": bool(math.isfinite(metrics["actor/grad_norm"])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (prompt = seq/4)")
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0 if torch.cuda.is_available() else 0.0,
        help="device peak for MFU (H100/H200 dense bf16: 989)",
    )
    p.add_argument("--padded", action="store_true", help="padded micro-batches instead of packed THD sequences")
    p.add_argument("--offload", action="store_true", help="also time the host-memory offload round trip")
    args = p.parse_args(argv)
    for name in ("seq", "mbs", "micro_batches", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if "RANK" in os.environ:  # launched by torchrun
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        result = run(dist.get_rank(), dist.get_world_size(), args)
    else:
        from parallel.testing import run_distributed

        result = run_distributed(run, 1, args, timeout_s=3600)[0]
    print(
        f"{result['preset']}: {result['step_ms']} ms/step, {result['tokens_per_s']} tokens/s, "
        f"{result['model_tflops']} TFLOP/s, peak {result['peak_bytes'] / 2**30:.2f} GiB",
        file=sys.stderr,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
