"""Benchmark LoRA against full fine-tuning of the same actor, in one run.

A Qwen3-shaped GPT (``--layers`` x ``--hidden``, inline config, float32 on CPU) is built twice on
``--tp`` spawned gloo ranks: once trainable in full, once with rank-``--rank`` adapters on all four
Megatron linears (``MegatronEngine(lora=...)``). Each takes ``--steps`` Adam policy updates
(``Actor.update_policy``) on the same random batch. Reported per rank 0:

- resident bytes by part (``MegatronEngine.resident_bytes``: params, grads, optimizer), and the
  adapters' own parameter bytes (LoRA: the gradient buffer and the Adam state hold only these);
- the median update seconds;
- the weight-sync export (``ActorWeightSync`` plan, HF names, merged for LoRA with ``lora.merge:
  true``): bytes and the median seconds of one full export pass (no engine on the other side; the
  transports and vLLM's reload are ``tools/bench_weight_sync.py``'s).

The last line printed is one JSON object with both rows and the ratios. CPU default (~30 MB)::

    python tools/bench_lora.py [--tp 2] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (spawned gloo ranks)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64, help="prompt + response tokens per row")
    p.add_argument("--steps", type=int, default=3, help="timed updates (median reported)")
    args = p.parse_args(argv)
    for name in ("tp", "layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "rank", "batch", "seq", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def _run(rank, world_size, args, lora_rank):
    import torch

    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.lora import LoRAConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import Actor
    from megatron_rl.rollout.weight_sync import ActorWeightSync
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    mesh = init_mesh(ParallelConfig(tensor_model_parallel_size=world_size), seed=1)
    model_cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                            num_attention_heads=args.heads, num_query_groups=args.kv_heads, vocab_size=args.vocab,
                            qk_layernorm=True, max_position_embeddings=max(64, args.seq))
    optim = {"optimizer": "adam", "lr": 1e-4, "weight_decay": 0.0, "clip_grad": 1.0}
    lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank, merge=True) if lora_rank else None
    engine = MegatronEngine(model_cfg, mesh, trainable=True, optim=OptimConfig.from_dict(optim), lora=lora,
                            name="actor")
    actor = Actor(engine, ActorConfig.from_dict({"ppo_mini_batch_size": args.batch,
                                                 "ppo_micro_batch_size_per_gpu": args.batch, "optim": optim}))
    g = torch.Generator().manual_seed(0)
    response = args.seq // 2
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, -response:],
             "response_mask": torch.ones(args.batch, response, dtype=torch.long),
             "advantages": torch.randn(args.batch, response, generator=g)}
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    update_s = []
    for _ in range(args.steps):
        start = time.perf_counter()
        actor.update_policy(batch)
        update_s.append(time.perf_counter() - start)
    sync = ActorWeightSync.from_engine(engine, get_family("Qwen3ForCausalLM").weight_map(model_cfg), mesh=mesh,
                                       bucket_megabytes=64.0)
    export_s = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for _ in sync.iter_weights():
            pass
        export_s.append(time.perf_counter() - start)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in engine.named_parameters() if ".lora_" in n)
    row = {"lora_rank": lora_rank, "resident": engine.resident_bytes(), "adapter_param_bytes": adapter_bytes,
           "update_s": statistics.median(update_s), "sync_bytes": sync.num_bytes,
           "export_s": statistics.median(export_s)}
    destroy_mesh(mesh)
    return row


def main(argv=None) -> dict:
    from parallel.testing import run_distributed

    args = _parse(argv)
    rows = [run_distributed(_run, args.tp, args, r, timeout_s=1800)[0] for r in (0, args.rank)]
    full, lora = rows
    print(f"{'run':<10} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'adapters MB':>12} {'update s':>9} "
          f"{'sync MB':>8} {'export s':>9}")
    for name, r in (("full", full), (f"lora r={args.rank}", lora)):
        res = r["resident"]
        print(f"{name:<10} {res.get('params', 0) / 2**20:>10.2f} {res.get('grads', 0) / 2**20:>9.2f} "
              f"{res.get('optimizer', 0) / 2**20:>9.2f} {r['adapter_param_bytes'] / 2**20:>12.3f} "
              f"{r['update_s']:>9.3f} {r['sync_bytes'] / 2**20:>8.2f} {r['export_s']:>9.3f}")
    out = {"tp": args.tp, "full": full, "lora": lora,
           "grads_ratio": lora["resident"].get("grads", 0) / max(1, full["resident"].get("grads", 0)),
           "optimizer_ratio": lora["resident"].get("optimizer", 0) / max(1, full["resident"].get("optimizer", 0)),
           "update_ratio": lora["update_s"] / full["update_s"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
