"""Benchmark the HF export of a tensor-parallel model against a plain-copy floor.

A Qwen3-shaped Megatron GPT (random weights) is built at TP=2 on spawned gloo ranks (CPU).
``parallel.bridge.HFExporter.iter_weights`` then exports it under HF names, bucket by bucket
(rank 0 receives the other rank's shards and assembles the HF tensors: what the HF writer
does; ``--all-ranks`` makes every rank yield everything, as colocated weight sync does). The
floor is the same bytes produced with plain copies in the same run: every parameter's TP
shards, already on rank 0 (gathered once, untimed), joined with ``torch.cat`` (or ``clone``d
when unsplit) -- one read and one write of each byte, no communication, no re-layout. Floor
and export alternate ``--repeats`` times so both see the same machine load; medians are
reported. The default size (297 MB of float32 weights, 47 HF tensors) runs in about 20 s on
2 cores, most of it process start-up::

    python tools/bench_bridge.py
    python tools/bench_bridge.py --hidden 2048 --layers 16 --ffn 6144 --vocab 151936   # 1.5B-ish

The last line printed is one JSON object: ``bytes``, ``export_s``, ``floor_s``,
``export_over_floor`` (target <= 3) and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from parallel.bridge.export import DEFAULT_BUCKET_BYTES  # noqa: E402


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768, help="hidden size")
    p.add_argument("--ffn", type=int, default=2048, help="MLP width (per gate/up branch)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--heads", type=int, default=12, help="query heads (divisible by --tp)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (divisible by --tp: no padding rows)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (spawned gloo processes)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="parameter dtype")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / 2**20,
        help="export bucket bound in MiB (default: the bridge's)",
    )
    p.add_argument("--all-ranks", action="store_true", help="every rank yields every tensor (broadcasts)")
    p.add_argument("--repeats", type=int, default=5, help="timed exports (median reported)")
    args = p.parse_args(argv)
    for name in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "tp", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.bucket_mb <= 0:
        p.error(f"--bucket-mb={args.bucket_mb} must be > 0")
    if args.heads % args.tp or args.heads % args.kv_heads or args.vocab % args.tp:
        p.error(
            f"--heads={args.heads} and --vocab={args.vocab} must be divisible by --tp={args.tp}, "
            f"and --heads by --kv-heads={args.kv_heads}"
        )
    return args


def _floor_seconds(shards) -> tuple[float, int]:
    """Time to produce every full tensor from shards that are already local: ``torch.cat``
    along the partition dim, ``clone`` for unsplit ones; returns (seconds, bytes written)."""
    import torch

    start = time.perf_counter()
    out = [torch.cat(parts, dim) if dim is not None else parts[0].clone() for parts, dim in shards]
    seconds = time.perf_counter() - start
    nbytes = sum(t.numel() * t.element_size() for t in out)
    del out
    return seconds, nbytes


def run(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """One rank: build the model, gather the floor's inputs, alternate floor and export."""
    import torch
    import torch.distributed as dist

    from megatron_rl.models.families import get_family
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import ExportStats, HFExporter
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    pc = ParallelConfig(tensor_model_parallel_size=args.tp)
    mesh = init_mesh(pc, seed=0)
    model_cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        vocab_size=args.vocab,
        qk_layernorm=True,
        params_dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
    )
    chunks = build_model(model_cfg, build_transformer_config(model_cfg, pc))
    weight_map = get_family("Qwen3ForCausalLM").weight_map(model_cfg)
    exporter = HFExporter(chunks, weight_map, mesh=mesh)

    # The floor's inputs: every parameter's TP shards on rank 0 (all-gathered once, untimed).
    shards = []
    for _, param in sorted(chunks[0].named_parameters()):
        if getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(param) for _ in range(mesh.size("tp"))]
            dist.all_gather(parts, param.detach().contiguous(), group=mesh.tp_group)
            shards.append((parts, int(param.partition_dim)))
        else:
            shards.append(([param.detach()], None))
    if rank != 0:
        shards = []

    bucket_bytes = int(args.bucket_mb * 2**20)

    def export() -> tuple[float, ExportStats]:
        stats = ExportStats()
        dist.barrier()
        start = time.perf_counter()
        for _name, _tensor in exporter.iter_weights(bucket_bytes=bucket_bytes, all_ranks=args.all_ranks, stats=stats):
            pass
        seconds = time.perf_counter() - start
        dist.barrier()
        return seconds, stats

    export()  # warm-up: first-touch allocations, gloo connections
    floor, exported, stats, floor_bytes = [], [], None, 0
    for i in range(args.repeats):
        dist.barrier()
        if rank == 0:
            seconds, floor_bytes = _floor_seconds(shards)
            floor.append(seconds)
        seconds, stats = export()
        exported.append(seconds)
        if rank == 0:
            print(
                f"repeat {i}: export {exported[-1]:.4f} s ({stats.num_buckets} buckets), floor {floor[-1]:.4f} s",
                flush=True,
            )
    destroy_mesh(mesh)
    if rank != 0:
        return {}
    return {
        "bytes": stats.total_bytes,
        "floor_bytes": floor_bytes,
        "export_s": statistics.median(exported),
        "floor_s": statistics.median(floor),
        "num_tensors": stats.num_tensors,
        "num_buckets": stats.num_buckets,
        "max_live_bytes": stats.max_live_bytes,
    }


def main(argv=None) -> dict:
    import importlib

    from parallel.testing import run_distributed

    args = _parse(argv)
    # ``run`` must be importable by name in the spawned ranks: take it from this file as a module.
    module = importlib.import_module("tools.bench_bridge")
    out = run_distributed(module.run, args.tp, args, timeout_s=1800)[0]
    if out["bytes"] != out["floor_bytes"]:
        raise RuntimeError(f"export wrote {out['bytes']} bytes, the floor {out['floor_bytes']}: not the same bytes")
    result = {
        "bytes": out["bytes"],
        "export_s": out["export_s"],
        "floor_s": out["floor_s"],
        "export_over_floor": out["export_s"] / out["floor_s"],
        "num_tensors": out["num_tensors"],
        "num_buckets": out["num_buckets"],
        "max_live_bytes": out["max_live_bytes"],
        "tp": args.tp,
        "all_ranks": args.all_ranks,
        "bucket_mb": args.bucket_mb,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "model": dict(
            hidden=args.hidden,
            ffn=args.ffn,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
        ),
    }
    print(
        f"{out['bytes'] / 2**20:.1f} MiB at TP={args.tp}: export {out['export_s']:.4f} s, "
        f"cat/clone floor {out['floor_s']:.4f} s, ratio {result['export_over_floor']:.2f}"
    )
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
