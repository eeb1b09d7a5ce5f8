"""parallel.bridge mechanics: the grouped-QKV layout, the HF reader's checks, bad input (each a
clear error raised on every rank alike), the atomic HF writer, the bucket bound with oversize
parameters and dtype casts, rank-0-only vs all-rank export, and a critic's ignored head.

Family-by-family numerics (logits, round trips, checkpoints across layouts) are in
tests/megatron_rl/models/test_families.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parallel.bridge import HFCheckpointReader, WeightMap, WeightRule, check_layout
from parallel.bridge.rules import qkv_runs
from parallel.config import ParallelConfig
from parallel.testing import run_distributed
from tests.megatron_rl.models.test_families import (
    CASES,
    build_hf_model,
    make_input_ids,
    read_hf_tensors,
    save_hf_model,
)


# ---------------------------------------------------------------------------------------------
# Pure layout and validation tests (no ranks).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,groups,tp", [(8, 4, 2), (8, 2, 2), (4, 1, 2), (8, 2, 4), (6, 3, 1)])
def testqkv_runs_reproduce_megatron_grouped_layout(heads, groups, tp):
    """Shard k of the grouped layout, assembled from q/k/v by qkv_runs, equals the reference
    Megatron layout [q heads of group g, k_g, v_g] split evenly over TP (also when TP exceeds
    the number of groups and a shard holds part of a group)."""
    d, hidden = 4, 3
    wm = WeightMap(rules=(), vocab_size=1, num_attention_heads=heads, num_query_groups=groups, head_dim=d)
    q = torch.randn(heads * d, hidden)
    k = torch.randn(groups * d, hidden)
    v = torch.randn(groups * d, hidden)
    per = heads // groups * d
    reference = torch.cat(
        [torch.cat([q[g * per : (g + 1) * per], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]) for g in range(groups)]
    )
    rows = reference.shape[0] // tp
    for shard in range(tp):
        built = torch.full((rows, hidden), float("nan"))
        for which, hf_row, row, length in qkv_runs(shard * rows, (shard + 1) * rows, wm):
            built[row - shard * rows : row - shard * rows + length] = (q, k, v)[which][hf_row : hf_row + length]
        assert torch.equal(built, reference[shard * rows : (shard + 1) * rows]), shard


def test_weight_rule_validation():
    with pytest.raises(ValueError, match=r"transform 'qkv' takes 3 HF names, got \['a'\]"):
        WeightRule("x.{layer}.w", ("a",), "qkv")
    with pytest.raises(ValueError, match=r"transform='fuse' is not allowed; choose one of"):
        WeightRule("x.w", "a", "fuse")
    with pytest.raises(ValueError, match=r"placeholders must be among \['layer', 'expert'\]"):
        WeightRule("x.{layer}.w", "a.{expert}.w")
    rule = WeightRule(
        "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight",
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
    )
    assert rule.is_expert
    assert rule.match("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight") == (
        "model.layers.3.mlp.experts.7.down_proj.weight",
    )
    assert rule.match("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight.x") is None
    with pytest.raises(ValueError, match=r"Megatron names with more than one rule: \['a'\]"):
        WeightMap(
            rules=(WeightRule("a", "x"), WeightRule("a", "y")),
            vocab_size=1,
            num_attention_heads=1,
            num_query_groups=1,
            head_dim=1,
        )


def test_layout_that_does_not_fit_the_model():
    from megatron_rl.models.families import get_family

    cfg = CASES["mixtral"][0]
    model_cfg = get_family(cfg).model_config(cfg)
    assert (
        check_layout(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 4, model_cfg)["dp"]
        == 2
    )
    with pytest.raises(ValueError, match=r"^num_layers=4 is not divisible by pipeline_model_parallel_size=3$"):
        check_layout(ParallelConfig(pipeline_model_parallel_size=3), 3, model_cfg)
    with pytest.raises(ValueError, match=r"^num_experts=4 is not divisible by expert_model_parallel_size=3$"):
        check_layout({"expert_model_parallel_size": 3}, 3, model_cfg)
    with pytest.raises(ValueError, match=r"^num_attention_heads=4 is not divisible by tensor_model_parallel_size=3$"):
        check_layout(ParallelConfig(tensor_model_parallel_size=3), 3, model_cfg)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    path, _ = save_hf_model("qwen2", tmp_path_factory.mktemp("qwen2") / "hf")
    return path


def test_reader_reads_only_requested_slices(qwen2_dir):
    source = read_hf_tensors(qwen2_dir)
    with HFCheckpointReader(qwen2_dir) as reader:
        assert sorted(reader.keys()) == sorted(source)
        name = "model.layers.1.mlp.down_proj.weight"
        assert reader.shape(name) == (64, 96)
        part = reader.read(name, 1, 48, 96)
        assert torch.equal(part, source[name][:, 48:])
        assert reader.bytes_read == 64 * 48 * 4
        # Read in place, the target stays releasable: the engine's offload frees a loaded
        # parameter with storage.resize_(0) (Tensor.numpy() would have pinned its storage).
        out = torch.empty(64, 96)
        reader.read(name, out=out)
        assert torch.equal(out, source[name])
        out.untyped_storage().resize_(0)
        assert out.untyped_storage().nbytes() == 0


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_reader_missing_shard_files(qwen2_dir, tmp_path):
    broken = _copy(qwen2_dir, tmp_path / "broken")
    files = sorted(f.name for f in broken.glob("model-*.safetensors"))
    for f in files[1:3]:
        (broken / f).unlink()
    with pytest.raises(FileNotFoundError) as info:
        HFCheckpointReader(broken)
    assert f"2 of {len(files)} shard files are missing from {broken}: {files[1:3]}" in str(info.value)
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        HFCheckpointReader(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCheckpointReader(tmp_path / "nowhere")


def test_reader_truncated_and_corrupt_files(qwen2_dir, tmp_path):
    truncated = _copy(qwen2_dir, tmp_path / "truncated")
    victim = sorted(truncated.glob("model-*.safetensors"))[2]
    data = victim.read_bytes()
    victim.write_bytes(data[:-1000])
    with pytest.raises(ValueError) as info:
        HFCheckpointReader(truncated)
    assert f"{victim}: truncated or corrupt safetensors file ({len(data) - 1000} bytes)" in str(info.value)
    victim.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"truncated or corrupt safetensors file \(64 bytes\)"):
        HFCheckpointReader(truncated)
    bad_index = _copy(qwen2_dir, tmp_path / "bad_index")
    index = json.loads((bad_index / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.down_proj.weight"] = index["weight_map"]["model.norm.weight"]
    if index["weight_map"]["model.norm.weight"] == index["weight_map"]["model.embed_tokens.weight"]:
        pytest.skip("layout of this save puts both in one file")
    (bad_index / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists \['model.layers.0.mlp.down_proj.weight'\] in model-"):
        HFCheckpointReader(bad_index)


# ---------------------------------------------------------------------------------------------
# Collective behaviour on two gloo ranks (one spawn for everything).
# ---------------------------------------------------------------------------------------------
def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message per rank
        return type(exc).__name__, str(exc)
    return None


def bridge_ranks(rank, world_size, model_cfgs, dirs, work_dir):
    import dataclasses

    import torch.distributed as dist

    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import ExportStats, HFExporter, export_hf_weights, load_hf_checkpoint, save_hf_checkpoint
    from parallel.mesh import destroy_mesh, init_mesh
    from tests.megatron_rl.models.test_families import pipeline_logits

    work = Path(work_dir)
    out: dict = {}
    pc = ParallelConfig(tensor_model_parallel_size=2)
    mesh = init_mesh(pc, seed=1234)
    qwen2 = model_cfgs["qwen2"]
    family = get_family("Qwen2ForCausalLM")
    wm = family.weight_map(qwen2)

    def build(cfg, head="lm"):
        return build_model(cfg, build_transformer_config(cfg, pc), head=head)

    chunks = build(qwen2)
    load_hf_checkpoint(chunks, wm, dirs["qwen2"], mesh=mesh)
    source = read_hf_tensors(dirs["qwen2"])
    out["logits"] = pipeline_logits(chunks, mesh, make_input_ids(), qwen2.vocab_size)

    # --- bad input: every rank raises the same clear error -----------------------------------------
    wide = dataclasses.replace(qwen2, ffn_hidden_size=128)
    out["shape"] = _catch(lambda: load_hf_checkpoint(build(wide), family.weight_map(wide), dirs["qwen2"], mesh=mesh))
    out["missing"] = _catch(lambda: load_hf_checkpoint(chunks, wm, dirs["no_norm"], mesh=mesh))
    out["truncated"] = _catch(lambda: load_hf_checkpoint(chunks, wm, dirs["truncated"], mesh=mesh))
    out["missing_file"] = _catch(lambda: load_hf_checkpoint(chunks, wm, dirs["missing_file"], mesh=mesh))
    llama_like = dataclasses.replace(qwen2, add_qkv_bias=False)
    llama_wm = get_family("LlamaForCausalLM").weight_map(llama_like)
    out["unexpected"] = _catch(lambda: load_hf_checkpoint(build(llama_like), llama_wm, dirs["qwen2"], mesh=mesh))

    # --- the HF writer: single file, refusal to overwrite, no partial output on failure -------------
    single = save_hf_checkpoint(
        chunks,
        wm,
        work / "single",
        {"model_type": "qwen2"},
        mesh=mesh,
        extra_files=[Path(dirs["qwen2"]) / "generation_config.json"],
    )
    out["single_listing"] = sorted(p.name for p in single.iterdir())
    out["exists"] = _catch(lambda: save_hf_checkpoint(chunks, wm, single, {}, mesh=mesh))
    out["bad_config"] = _catch(
        lambda: save_hf_checkpoint(chunks, wm, work / "failed", {"bad": object()}, mesh=mesh, max_shard_bytes=40_000)
    )
    out["missing_extra"] = _catch(
        lambda: save_hf_checkpoint(chunks, wm, work / "failed", {}, mesh=mesh, extra_files=[work / "no_tokenizer.json"])
    )
    replaced = save_hf_checkpoint(
        chunks, wm, single, json.loads((Path(dirs["qwen2"]) / "config.json").read_text()), mesh=mesh, overwrite=True
    )
    reloaded = build(qwen2)
    load_hf_checkpoint(reloaded, wm, replaced, mesh=mesh)
    out["single_file_logits_equal"] = bool(
        torch.equal(pipeline_logits(reloaded, mesh, make_input_ids(), qwen2.vocab_size), out["logits"])
    )

    # --- export: oversize buckets, casts, rank 0 only vs all ranks -------------------------------
    def export(**kw):
        stats = ExportStats()
        got = {n: t.clone() for n, t in export_hf_weights(chunks, wm, mesh=mesh, stats=stats, **kw)}
        return got, stats

    tiny, tiny_stats = export(bucket_bytes=1000, all_ranks=True)
    cast, cast_stats = export(bucket_bytes=3000, all_ranks=True, dtype=torch.bfloat16)
    rank0, _ = export(bucket_bytes=10_000)
    out["tiny"] = dict(
        equal=all(torch.equal(tiny[n], source[n]) for n in source) and sorted(tiny) == sorted(source),
        buckets=tiny_stats.num_buckets,
        tensors=tiny_stats.num_tensors,
        live=tiny_stats.max_live_bytes,
        item=tiny_stats.max_item_bytes,
    )
    out["cast"] = dict(
        equal=all(cast[n].dtype == torch.bfloat16 and torch.equal(cast[n], source[n].bfloat16()) for n in source),
        live=cast_stats.max_live_bytes,
        bound=cast_stats.bucket_bytes + cast_stats.max_item_bytes,
    )
    out["rank0_count"] = len(rank0)
    out["planned"] = [(i.name, i.shape) for i in HFExporter(chunks, wm, mesh=mesh).tensors]

    # --- a critic: the value head is ignored on load and export ----------------------------------
    critic = build(qwen2, head="scalar")
    head_before = critic[0].output_layer.weight.detach().clone()
    load_hf_checkpoint(critic, wm, dirs["qwen2"], mesh=mesh, ignore=(r"output_layer\.",))
    names = [n for n, _ in export_hf_weights(critic, wm, mesh=mesh, all_ranks=True, ignore=(r"output_layer\.",))]
    out["critic"] = dict(
        head_untouched=bool(torch.equal(critic[0].output_layer.weight, head_before)),
        names_equal=sorted(names) == sorted(source),
        unignored=_catch(lambda: load_hf_checkpoint(critic, wm, dirs["qwen2"], mesh=mesh)),
    )
    destroy_mesh(mesh)
    dist.barrier()
    return out


def test_bridge_on_two_ranks(qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.families import get_family
    from safetensors.torch import save_file

    source = read_hf_tensors(qwen2_dir)
    # A checkpoint that lacks one tensor (its shard rewritten without it, index updated).
    no_norm = _copy(qwen2_dir, tmp_path / "no_norm")
    index = json.loads((no_norm / "model.safetensors.index.json").read_text())
    shard_name = index["weight_map"].pop("model.layers.1.input_layernorm.weight")
    save_file(
        {n: source[n] for n, f in index["weight_map"].items() if f == shard_name},
        no_norm / shard_name,
        metadata={"format": "pt"},
    )
    (no_norm / "model.safetensors.index.json").write_text(json.dumps(index))
    truncated = _copy(qwen2_dir, tmp_path / "truncated")
    victim = sorted(truncated.glob("model-*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-8])
    missing_file = _copy(qwen2_dir, tmp_path / "missing_file")
    gone = sorted(missing_file.glob("model-*.safetensors"))[0]
    gone.unlink()

    qwen2 = get_family(qwen2_dir).model_config(qwen2_dir, make_vocab_size_divisible_by=64)
    dirs = {
        k: str(v)
        for k, v in dict(qwen2=qwen2_dir, no_norm=no_norm, truncated=truncated, missing_file=missing_file).items()
    }
    results = run_distributed(bridge_ranks, 2, {"qwen2": qwen2}, dirs, str(tmp_path), timeout_s=240)
    r0, r1 = results

    for key in ("shape", "missing", "truncated", "missing_file", "unexpected", "exists", "bad_config", "missing_extra"):
        assert r0[key] is not None and r0[key] == r1[key], key  # the same error on every rank
    assert r0["shape"] == (
        "ValueError",
        "HF tensor 'model.layers.0.mlp.gate_proj.weight' has shape [96, 64] but "
        "the model config expects [128, 64] (Megatron parameter "
        "'decoder.layers.0.mlp.linear_fc1.weight')\nHF tensor 'model.layers.0.mlp.up_proj.weight' "
        "has shape [96, 64] but the model config expects [128, 64] (Megatron parameter "
        "'decoder.layers.0.mlp.linear_fc1.weight')\n"
        "HF tensor 'model.layers.0.mlp.down_proj.weight' has shape [64, 96] but the model config "
        "expects [64, 128] (Megatron parameter 'decoder.layers.0.mlp.linear_fc2.weight')\n"
        "HF tensor 'model.layers.1.mlp.gate_proj.weight' has shape [96, 64] but the model config "
        "expects [128, 64] (Megatron parameter 'decoder.layers.1.mlp.linear_fc1.weight')\n"
        "HF tensor 'model.layers.1.mlp.up_proj.weight' has shape [96, 64] but the model config "
        "expects [128, 64] (Megatron parameter 'decoder.layers.1.mlp.linear_fc1.weight')\n"
        "HF tensor 'model.layers.1.mlp.down_proj.weight' has shape [64, 96] but the model config "
        "expects [64, 128] (Megatron parameter 'decoder.layers.1.mlp.linear_fc2.weight')\n"
        "HF tensor 'model.layers.2.mlp.gate_proj.weight' has shape [96, 64] but the model config "
        "expects [128, 64] (Megatron parameter 'decoder.layers.2.mlp.linear_fc1.weight')\n"
        "HF tensor 'model.layers.2.mlp.up_proj.weight' has shape [96, 64] but the model config "
        "expects [128, 64] (Megatron parameter 'decoder.layers.2.mlp.linear_fc1.weight') "
        "(and 4 more)",
    )
    assert r0["missing"] == (
        "ValueError",
        f"{no_norm}: the model needs HF tensors the checkpoint lacks: ['model.layers.1.input_layernorm.weight']",
    )
    assert r0["truncated"][0] == "ValueError"
    assert r0["truncated"][1].startswith(f"{victim}: truncated or corrupt safetensors file")
    assert r0["missing_file"][0] == "FileNotFoundError" and f"['{gone.name}']" in r0["missing_file"][1]
    assert r0["unexpected"][0] == "ValueError" and r0["unexpected"][1].startswith(
        f"{qwen2_dir}: HF tensors that no weight rule of this model accounts for (wrong family or config?): "
        "['model.layers.0.self_attn.k_proj.bias', 'model.layers.0.self_attn.q_proj.bias',"
    )

    single = tmp_path / "single"
    assert r0["single_listing"] == ["config.json", "generation_config.json", "model.safetensors"]
    assert r0["exists"] == ("FileExistsError", f"output directory {single} exists; pass overwrite=True to replace it")
    assert (
        r0["bad_config"][0] == "OSError"
        and "TypeError: Object of type object is not JSON serializable" in r0["bad_config"][1]
    )
    assert r0["missing_extra"] == ("FileNotFoundError", f"extra file {tmp_path / 'no_tokenizer.json'} does not exist")
    # Failed saves leave neither the output directory nor a temporary one behind.
    assert not (tmp_path / "failed").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # One file, no index; it loads in transformers and gives HF's own logits exactly.
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    assert r0["single_file_logits_equal"]
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32, attn_implementation="eager").eval()
    original = build_hf_model("qwen2")
    assert all(torch.equal(t, original.state_dict()[n]) for n, t in hf.state_dict().items())
    with torch.no_grad():
        ids = make_input_ids()
        assert torch.equal(hf(ids).logits, original(ids).logits)
        assert (r0["logits"] - original(ids).logits).abs().max() < 1e-4

    for r in results:
        tiny = r["tiny"]
        # bucket_bytes=1000 is below every parameter: one parameter per bucket, chunked staging,
        # and still never more than the bucket plus one parameter alive.
        # One bucket per Megatron parameter: per layer, QKV weight and bias make 3 HF tensors
        # each and fc1 makes 2.
        assert tiny["equal"] and tiny["buckets"] == len(r["planned"]) - 4 * (2 + 2 + 1)
        assert tiny["live"] <= 1000 + tiny["item"], tiny
        assert r["cast"]["equal"] and r["cast"]["live"] <= r["cast"]["bound"], r["cast"]
        assert r["critic"]["head_untouched"] and r["critic"]["names_equal"], r["critic"]
        assert (
            r["critic"]["unignored"][0] == "ValueError"
            and "HF tensor 'model.embed_tokens.weight' has shape "
            "[97, 64] but the model config expects [1, 64] (Megatron parameter 'output_layer.weight')"
            in r["critic"]["unignored"][1]
        )
    assert r0["planned"] == r1["planned"] and len(r0["planned"]) == len(source)
    assert r0["rank0_count"] == len(source) and r1["rank0_count"] == 0
