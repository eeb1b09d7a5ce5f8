"""Model families end to end: a tiny random HF model per family, loaded into Megatron at several
layouts through parallel.bridge, must reproduce HF's logits, export back to HF bit for bit, and
survive a Megatron distributed checkpoint saved at TP=2 and loaded at other layouts.

Adding a family = its module in megatron_rl/models + one row in ``CASES``. The ``pp2_3+1`` layout is
an uneven pipeline split (``num_layers_in_first_pipeline_stage=3``): the bridge's layer offsets, the
dist checkpoint and the export follow it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed

LOGIT_TOL = 1e-4
BATCH, SEQ = 2, 24
VOCAB = 97  # odd, so the embedding and output layer carry padding rows
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# family -> (HF config.json, layouts beyond TP=2 / TP=1 / PP=2, from LAYOUTS)
CASES = {
    # head_dim 32 != hidden/heads, Llama-3.1 RoPE scaling, plus an interleaved (VPP) layout.
    "llama": (
        dict(
            _BASE,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            head_dim=32,
            max_position_embeddings=131072,
            rope_parameters=LLAMA3_ROPE,
        ),
        ["vpp2", "pp2_3+1"],
    ),
    # QKV bias, tied embeddings (the last PP stage holds a copy of the embedding).
    "qwen2": (
        dict(
            _BASE,
            model_type="qwen2",
            architectures=["Qwen2ForCausalLM"],
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        [],
    ),
    # QK-norm; a single KV head, so at TP=2 each rank holds half of one query group.
    "qwen3": (
        dict(
            _BASE,
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            num_key_value_heads=1,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        [],
    ),
    # Routed experts, softmax -> top-k without renormalisation (norm_topk_prob=False).
    "qwen3_moe": (
        dict(
            _BASE,
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
        ),
        ["ep2", "pp2_3+1"],
    ),
    # Routed experts with renormalised top-k; hub names block_sparse_moe / w1 w3 w2.
    "mixtral": (
        dict(
            _BASE,
            model_type="mixtral",
            architectures=["MixtralForCausalLM"],
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        ["ep2"],
    ),
    # Qwen1.5-MoE: QKV bias, softmax top-k (no renormalisation), a shared expert scaled by
    # sigmoid(shared_expert_gate), layer 1 dense (mlp_only_layers); an uneven PP split (3 + 1).
    "qwen2_moe": (
        dict(
            _BASE,
            model_type="qwen2_moe",
            architectures=["Qwen2MoeForCausalLM"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        ["ep2", "pp2_3+1"],
    ),
}


def build_hf_model(name: str, seed: int = 0):
    """A tiny random float32 HF model of family ``name`` with O(1) activations.

    Default init (std 0.02, norms 1) gives logits so small that a wrong mapping could hide
    under 1e-4, so every weight is redrawn: matrices ~ N(0, 0.1^2), norms ~ N(1, 0.1^2).
    """
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.families import load_hf_config

    config = load_hf_config(CASES[name][0])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and "norm" in pname:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1 if "gate.weight" not in pname else 0.5)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def make_input_ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def save_hf_model(name: str, directory: Path, *, max_shard_size: str = "60KB") -> tuple[Path, torch.Tensor]:
    """Save the tiny model (sharded, with an index) and return (dir, HF logits on fixed ids)."""
    model = build_hf_model(name)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    with torch.no_grad():
        logits = model(make_input_ids()).logits.float()
    return directory, logits


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------------------------------------
# Code run on the spawned ranks.
# ---------------------------------------------------------------------------------------------
def pipeline_logits(chunks, mesh, input_ids: torch.Tensor, vocab: int):
    """Full-vocabulary logits [b, s, vocab] on the last pipeline stage (None elsewhere).

    Runs the chunks stage by stage (and virtual stage by virtual stage) with explicit
    send/recv over the pipeline group, then gathers the vocab-parallel logits over TP.
    """
    import torch.distributed as dist

    pp, stage, pp_ranks = mesh.size("pp"), mesh.pp_rank, mesh.ranks("pp")
    b, s = input_ids.shape
    position_ids = torch.arange(s).expand(b, s)
    hidden_size = chunks[0].config.hidden_size
    logits = None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            for st in range(pp):
                if st != stage:
                    continue
                first, last = v == 0 and st == 0, v == len(chunks) - 1 and st == pp - 1
                if not first:
                    hidden = torch.empty(s, b, hidden_size)
                    dist.recv(hidden, src=pp_ranks[st - 1] if st > 0 else pp_ranks[-1])
                    chunk.set_input_tensor(hidden)
                out = chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
                if last:
                    logits = out
                else:
                    dist.send(out.contiguous(), dst=pp_ranks[st + 1] if st < pp - 1 else pp_ranks[0])
    if logits is None:
        return None
    parts = [torch.empty_like(logits) for _ in range(mesh.size("tp"))]
    dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


def _export_check(chunks, weight_map, mesh, source: dict, *, bucket_bytes: int, all_ranks: bool) -> dict:
    """Export through the bucketed generator; compare with the source HF tensors bit for bit."""
    import torch.distributed as dist

    from parallel.bridge import ExportStats, export_hf_weights

    stats = ExportStats()
    got = {}
    for name, tensor in export_hf_weights(
        chunks, weight_map, mesh=mesh, bucket_bytes=bucket_bytes, all_ranks=all_ranks, stats=stats
    ):
        got[name] = tensor.clone()
    if not (all_ranks or dist.get_rank() == 0):
        return {"yielded": len(got)}
    return {
        "names_equal": sorted(got) == sorted(source),
        "not_bit_equal": sorted(n for n in source if n in got and not torch.equal(got[n], source[n])),
        "max_live_bytes": stats.max_live_bytes,
        "bound": stats.bucket_bytes + stats.max_item_bytes,
        "num_buckets": stats.num_buckets,
        "max_item_bytes": stats.max_item_bytes,
    }


def _tp2_checks(rank, chunks, mesh, case, source, work_dir) -> dict:
    """TP=2: HF load (sliced reads), logits, the HF writer round trip, a dist checkpoint."""
    import json

    from parallel.bridge import ExportStats, load_hf_checkpoint, save_hf_checkpoint
    from parallel.checkpoint import save_model

    name, model_cfg, weight_map, hf_dir = case["name"], case["model_cfg"], case["weight_map"], case["hf_dir"]
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    report = load_hf_checkpoint(chunks, weight_map, hf_dir, mesh=mesh)
    logits = pipeline_logits(chunks, mesh, case["input_ids"], model_cfg.vocab_size)
    stats = ExportStats()
    out_dir = save_hf_checkpoint(
        chunks,
        weight_map,
        Path(work_dir) / name / "hf_out",
        hf_config,
        mesh=mesh,
        max_shard_bytes=50_000,
        bucket_bytes=30_000,
        stats=stats,
    )
    res = {"diff": _max_diff(logits, case["hf_logits"]), "read_fraction": report.bytes_read / report.checkpoint_bytes}
    if rank == 0:
        written = read_hf_tensors(out_dir)
        res.update(
            names_equal=sorted(written) == sorted(source),
            not_bit_equal=sorted(n for n in source if n in written and not torch.equal(written[n], source[n])),
            num_files=len(list(out_dir.glob("*.safetensors"))),
            index=(out_dir / "model.safetensors.index.json").is_file(),
            config_equal=json.loads((out_dir / "config.json").read_text()) == hf_config,
            max_live_bytes=stats.max_live_bytes,
            bound=stats.bucket_bytes + stats.max_item_bytes,
        )
    save_model(chunks, Path(work_dir) / name / "mcore_tp2")
    return res


def _layout_checks(chunks, mesh, case, source, work_dir, *, all_ranks: bool) -> dict:
    """Another layout: the TP=2 dist checkpoint and the HF checkpoint give identical logits,
    both match HF, and the export reproduces the HF tensors bit for bit."""
    from parallel.bridge import load_hf_checkpoint
    from parallel.checkpoint import load_model

    vocab = case["model_cfg"].vocab_size
    load_model(chunks, Path(work_dir) / case["name"] / "mcore_tp2")
    from_ckpt = pipeline_logits(chunks, mesh, case["input_ids"], vocab)
    load_hf_checkpoint(chunks, case["weight_map"], case["hf_dir"], mesh=mesh)
    from_hf = pipeline_logits(chunks, mesh, case["input_ids"], vocab)
    res = _export_check(chunks, case["weight_map"], mesh, source, bucket_bytes=20_000, all_ranks=all_ranks)
    if from_hf is not None:
        res.update(diff=_max_diff(from_hf, case["hf_logits"]), ckpt_equal=bool(torch.equal(from_ckpt, from_hf)))
    return res


LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "tp1": dict(tensor_model_parallel_size=1),
    "pp2": dict(pipeline_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "vpp2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    # An uneven split (megatron.override_transformer_config), 3 + 1 of the 4 layers.
    "pp2_3+1": dict(pipeline_model_parallel_size=2, transformer={"num_layers_in_first_pipeline_stage": 3}),
}


def matrix_ranks(rank, world_size, cases, work_dir):
    """All families in one spawn, layout by layout (process start and mesh set-up dominate the
    cost). ``cases`` carry the ModelConfig from the parent, so ranks need not import transformers.
    A failure is recorded per family and layout (both ranks fail alike at build time)."""
    import traceback

    import torch.distributed as dist

    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import check_layout
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    results: dict = {c["name"]: {} for c in cases}
    sources = {c["name"]: read_hf_tensors(c["hf_dir"]) for c in cases}
    for c in cases:
        family = get_family(c["architecture"])
        results[c["name"]]["family"] = family.name
        c["weight_map"] = family.weight_map(c["model_cfg"])
    for label, par in LAYOUTS.items():
        todo = [c for c in cases if label in c["layouts"]]
        par = dict(par)
        overrides = par.pop("transformer", {})  # TransformerConfig fields, not ParallelConfig ones
        pc = ParallelConfig(**par)
        mesh = init_mesh(pc, seed=1234)
        for c in todo:
            try:
                check_layout(pc, world_size, c["model_cfg"], overrides)
                chunks = build_model(c["model_cfg"], build_transformer_config(c["model_cfg"], pc, **overrides))
                if overrides:  # the split really is uneven: 3 layers on stage 0, 1 on stage 1
                    assert len(chunks[0].decoder.layers) == (3 if mesh.pp_rank == 0 else 1), label
                if label == "tp2":
                    res = _tp2_checks(rank, chunks, mesh, c, sources[c["name"]], work_dir)
                else:
                    res = _layout_checks(chunks, mesh, c, sources[c["name"]], work_dir, all_ranks=label != "tp1")
            except Exception:  # noqa: BLE001 - reported per family and layout; the others still run
                res = {"error": traceback.format_exc()}
            results[c["name"]][label] = res
        destroy_mesh(mesh)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Per family: HF logits, and the per-rank results of every layout (one spawn for all)."""
    from megatron_rl.models.families import get_family

    work = tmp_path_factory.mktemp("families")
    cases, hf = [], {}
    for name, (cfg, extra) in CASES.items():
        hf_dir, hf_logits = save_hf_model(name, work / name / "hf")
        hf[name] = (hf_dir, hf_logits)
        cases.append(
            dict(
                name=name,
                architecture=cfg["architectures"][0],
                hf_dir=str(hf_dir),
                hf_logits=hf_logits,
                # qwen2: 97 rows at TP=1, 98 at TP=2 (dist checkpoint across paddings);
                # the others: 128 rows at both.
                model_cfg=get_family(hf_dir).model_config(
                    hf_dir, make_vocab_size_divisible_by=1 if name == "qwen2" else 64
                ),
                input_ids=make_input_ids(),
                layouts=["tp2", "tp1", "pp2", *extra],
            )
        )
    results = run_distributed(matrix_ranks, 2, cases, str(work), timeout_s=400)
    return hf, results


@pytest.mark.parametrize("name", sorted(CASES))
def test_family_matches_hf_across_layouts(name, matrix):
    hf, results = matrix
    hf_dir, hf_logits = hf[name]
    assert (hf_dir / "model.safetensors.index.json").is_file()  # the sharded-index path is exercised
    assert float(hf_logits.std()) > 0.3  # O(1) logits: a 1e-4 tolerance means something
    per_rank = [r[name] for r in results]
    assert per_rank[0]["family"] == name
    for r in per_rank:
        for label, res in r.items():
            assert not (isinstance(res, dict) and "error" in res), f"{name} at {label}:\n{res['error']}"
    tp2 = per_rank[0]["tp2"]
    for r in per_rank:
        assert r["tp2"]["diff"] < LOGIT_TOL, (name, r["tp2"]["diff"])
        # Each TP rank reads its own slices: about half of the checkpoint, never all of it.
        assert r["tp2"]["read_fraction"] < 0.75, r["tp2"]["read_fraction"]
    assert tp2["names_equal"] and tp2["not_bit_equal"] == [], tp2
    assert tp2["config_equal"] and tp2["index"] and tp2["num_files"] > 1
    assert tp2["max_live_bytes"] <= tp2["bound"], tp2
    for label in ["tp1", "pp2", *CASES[name][1]]:
        layout = [r[label] for r in per_rank]
        with_logits = [r for r in layout if "diff" in r]
        assert with_logits, label
        for r in with_logits:
            assert r["diff"] < LOGIT_TOL, (name, label, r["diff"])
            assert r["ckpt_equal"], (name, label)  # TP=2 checkpoint == HF weights at this layout
        exporters = [r for r in layout if "names_equal" in r]
        assert len(exporters) == (1 if label == "tp1" else 2), label
        for r in exporters:
            assert r["names_equal"] and r["not_bit_equal"] == [], (name, label, r)
            assert r["num_buckets"] > 3 and r["max_live_bytes"] <= r["bound"], (name, label, r)


# ---------------------------------------------------------------------------------------------
# Config translation (no ranks needed).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_config_translation(name):
    from megatron_rl.models.families import get_family

    cfg = CASES[name][0]
    family = get_family(cfg)
    assert family.name == name
    m = family.model_config(cfg)
    assert (m.num_layers, m.hidden_size, m.vocab_size) == (4, 64, VOCAB)
    assert m.num_attention_heads == 4 and m.num_query_groups == cfg["num_key_value_heads"]
    assert m.head_dim == cfg.get("head_dim", 16)
    assert m.layernorm_epsilon == 1e-5 and m.normalization == "RMSNorm" and m.swiglu
    assert m.tie_word_embeddings == cfg["tie_word_embeddings"]
    assert m.add_qkv_bias == name.startswith("qwen2")
    assert m.qk_layernorm == name.startswith("qwen3")
    assert m.rope_scaling == (name == "llama")
    if name == "llama":
        assert (m.rotary_base, m.rope_scaling_factor) == (500000.0, 8.0)
    if name in ("qwen3_moe", "mixtral", "qwen2_moe"):
        assert (m.num_moe_experts, m.moe_router_topk) == (4, 2)
        assert m.moe_ffn_hidden_size == (48 if name == "mixtral" else 32)
        # qwen3_moe / qwen2_moe here: norm_topk_prob=False -> softmax before top-k; Mixtral renormalises.
        assert m.moe_router_pre_softmax == (name != "mixtral")
        assert m.moe_aux_loss_coeff == 0.0  # output_router_logits=False: HF adds no aux loss
        if name == "qwen2_moe":  # the gated shared expert; layer 1 dense (mlp_only_layers=[1])
            assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate) == (48, True)
            assert m.moe_layer_freq == (1, 0, 1, 1) and m.ffn_hidden_size == 96
    else:
        assert m.num_moe_experts is None and m.ffn_hidden_size == 96


def test_weight_rules_cover_every_hf_tensor(tmp_path):
    """Every tensor of each tiny HF checkpoint (as save_pretrained writes it) is produced by an
    exported rule."""
    from megatron_rl.models.families import get_family

    for name, (cfg, _) in CASES.items():
        family = get_family(cfg)
        wm = family.weight_map(family.model_config(cfg))
        build_hf_model(name).save_pretrained(tmp_path / name)
        hf_names = set(read_hf_tensors(tmp_path / name))
        covered = []
        for rule in wm.rules:
            if not rule.export:
                continue
            for layer in range(4):
                for expert in range(4):
                    covered.extend(n.format(layer=layer, expert=expert) for n in rule.hf)
        covered_set = set(covered)
        assert hf_names <= covered_set, (name, sorted(hf_names - covered_set))


def test_llama3_rope_scaling_equals_hf():
    """Megatron's rope_scaling inverse frequencies equal HF's llama3 ones (and differ from plain)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_rl.models.families import get_family, load_hf_config

    hf_cfg = load_hf_config(CASES["llama"][0])
    m = get_family(hf_cfg).model_config(hf_cfg)
    hf_inv, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
    rope = RotaryEmbedding(
        kv_channels=m.head_dim,
        rotary_percent=1.0,
        rotary_base=int(m.rotary_base),
        rope_scaling=m.rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        use_cpu_initialization=True,
    )
    plain = RotaryEmbedding(
        kv_channels=m.head_dim, rotary_percent=1.0, rotary_base=int(m.rotary_base), use_cpu_initialization=True
    )
    assert scale == 1.0
    # exact: Megatron's _apply_scaling is adapted from HF's llama3 code, the same float32 ops in the same order
    assert torch.equal(rope.inv_freq, hf_inv)
    assert float((plain.inv_freq - hf_inv).abs().max()) > 1e-4  # scaling really changes something


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("low_freq_factor", 2.0, "rope_parameters.low_freq_factor=2.0 is not supported"),
        ("high_freq_factor", 8.0, "rope_parameters.high_freq_factor=8.0 is not supported"),
        ("original_max_position_embeddings", 4096, "rope_parameters.original_max_position_embeddings=4096"),
        ("rope_type", "yarn", "rope_parameters.rope_type='yarn' is not supported; allowed: 'default' or 'llama3'"),
        ("rope_theta", 10000.5, "rope_theta=10000.5 is not supported; allowed: an integer value"),
    ],
)
def test_unrepresentable_rope_is_rejected(field, value, message):
    from megatron_rl.models.families import get_family

    cfg = dict(CASES["llama"][0], rope_parameters=dict(LLAMA3_ROPE, **{field: value}))
    if field == "rope_type":
        cfg["rope_parameters"].update(beta_fast=32.0, beta_slow=1.0)
    with pytest.raises(ValueError) as info:
        get_family(cfg).model_config(cfg)
    assert message in str(info.value) and str(info.value).startswith("llama: ")


@pytest.mark.parametrize(
    "name,changes,message",
    [
        ("llama", dict(attention_bias=True), "llama: HF config attention_bias=True is not supported; allowed: False"),
        ("llama", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; allowed: 'silu' (SwiGLU)"),
        ("qwen2", dict(use_sliding_window=True), "qwen2: HF config use_sliding_window=True is not supported"),
        ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported; allowed: 1"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1] is not supported"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 is not supported"),
        ("mixtral", dict(sliding_window=4096), "mixtral: HF config sliding_window=4096 is not supported"),
    ],
)
def test_unrepresentable_configs_are_rejected(name, changes, message):
    from megatron_rl.models.families import get_family

    cfg = dict(CASES[name][0], **changes)
    with pytest.raises(ValueError) as info:
        get_family(cfg).model_config(cfg)
    assert message in str(info.value)


def test_legacy_rope_scaling_keys_and_overrides():
    """A pre-v5 config.json (rope_theta + rope_scaling) maps the same; overrides cannot change
    the architecture."""
    from megatron_rl.models.families import get_family

    legacy = {k: v for k, v in CASES["llama"][0].items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    m = get_family(legacy).model_config(legacy, params_dtype="bfloat16")
    assert (m.rope_scaling, m.rope_scaling_factor, m.rotary_base, m.params_dtype) == (True, 8.0, 500000.0, "bfloat16")
    with pytest.raises(ValueError, match=r"llama: overrides \['hidden_size'\] would change the architecture"):
        get_family(legacy).model_config(legacy, hidden_size=128)


def test_unknown_architecture_lists_supported_families():
    from megatron_rl.models.families import get_family

    with pytest.raises(ValueError) as info:
        get_family({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    msg = str(info.value)
    assert msg.startswith("HF architectures ['GPT2LMHeadModel'] are not supported; supported families: ")
    for fam, arch in [
        ("llama", "LlamaForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
        ("mixtral", "MixtralForCausalLM"),
    ]:
        assert f"{fam}: {arch}" in msg
    for fam, arch in [
        ("qwen2_moe", "Qwen2MoeForCausalLM"),
        ("deepseek_v3", "DeepseekV3ForCausalLM"),
        ("glm4_moe", "Glm4MoeForCausalLM"),
    ]:
        assert f"{fam}: {arch}" in msg
    assert math.isclose(len(CASES), 6)


def test_hf_key_overrides_as_verl_applies_them():
    """verl's ``model.override_config``: HF config keys (top level or under ``model_config``) are set on the
    HF config before it is read; ModelConfig fields stay overrides; a key that is neither is refused by name,
    and an HF key that would change the weights' shapes is refused."""
    from megatron_rl.models.families import get_family

    cfg = CASES["qwen2"][0]
    family = get_family(cfg)
    m = family.model_config(
        cfg, max_position_embeddings=32768, model_config={"attention_dropout": 0.0}, params_dtype="bfloat16"
    )
    assert (m.max_position_embeddings, m.params_dtype) == (32768, "bfloat16")
    assert family.model_config(cfg).max_position_embeddings == 256  # the dict itself is not changed
    with pytest.raises(
        ValueError,
        match=r"model.override_config: \['no_such_key'\] are neither keys of the qwen2 "
        r"HF config nor ModelConfig fields",
    ):
        family.model_config(cfg, no_such_key=1)
    with pytest.raises(
        ValueError,
        match=r"qwen2: overrides \['num_hidden_layers'\] would change the architecture "
        r"read from the HF config \(num_layers: 4 -> 2\)",
    ):
        family.model_config(cfg, model_config={"num_hidden_layers": 2})
    with pytest.raises(ValueError, match=r"model_config=3 must be a mapping of HF config keys"):
        family.model_config(cfg, model_config=3)


QWEN15_MOE_A27B = dict(  # Qwen/Qwen1.5-MoE-A2.7B config.json (verl's Qwen1.5-MoE PPO example)
    architectures=["Qwen2MoeForCausalLM"],
    model_type="qwen2_moe",
    hidden_size=2048,
    intermediate_size=5632,
    max_position_embeddings=8192,
    max_window_layers=21,
    moe_intermediate_size=1408,
    norm_topk_prob=False,
    num_attention_heads=16,
    num_experts=60,
    num_experts_per_tok=4,
    num_hidden_layers=24,
    num_key_value_heads=16,
    decoder_sparse_step=1,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    shared_expert_intermediate_size=5632,
    sliding_window=32768,
    tie_word_embeddings=False,
    use_sliding_window=False,
    vocab_size=151936,
)


def test_qwen15_moe_a27b_parameters_equal_hf():
    """The published Qwen1.5-MoE-A2.7B config: the family's count (and the planner's, which reads
    ``layer_params``: routed and shared experts, the shared-expert gate) equals HF's model, 14.316 B."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.families import get_family, load_hf_config
    from megatron_rl.planner import count_params

    m = get_family(QWEN15_MOE_A27B).model_config(QWEN15_MOE_A27B)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(load_hf_config(QWEN15_MOE_A27B))
    hf_count = sum(p.numel() for p in hf.parameters())
    assert hf_count == 14_315_784_192
    assert m.num_params() == sum(count_params(m)) == hf_count
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_router_pre_softmax, m.moe_shared_expert_gate) == (
        60,
        4,
        True,
        True,
    )
