"""DeepSeek-V3 and GLM-4.5 end to end: tiny random HF models with their real structural features
(MLA with a query LoRA and YaRN, first-k dense layers, sigmoid routing with an expert bias,
group-limited routing, a routed scaling factor, shared experts; GLM's partial rotary, QKV bias and
QK-norm) loaded into Megatron at TP=2, TP=1, PP=2, EP=2 and TP=2 x EP=2 (4 ranks) must reproduce HF's logits, export back
to HF bit for bit (the expert bias included), and survive a Megatron distributed checkpoint saved
at TP=2. The layout matrix is ``test_families``' own (``matrix_ranks``), one spawn for both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.models.test_families import VOCAB, make_input_ids, matrix_ranks, read_hf_tensors

LOGIT_TOL = 1e-5
_MOE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

CASES = {
    # MLA (q LoRA 32, KV latent 24, nope 16 + rope 8, v 16), YaRN, 8 experts in 4 groups (2 chosen),
    # top-4, scaling 2.5, one shared expert, layer 0 dense.
    "deepseek_v3": (
        dict(
            _MOE,
            model_type="deepseek_v3",
            architectures=["DeepseekV3ForCausalLM"],
            num_key_value_heads=4,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rms_norm_eps=1e-6,
            rope_parameters=YARN,
        ),
        ["ep2"],
    ),
    # GQA (2 KV heads) with QKV bias and QK-norm, half of each head rotated, top-2 of 8, scaling 1.5.
    "glm4_moe": (
        dict(
            _MOE,
            model_type="glm4_moe",
            architectures=["Glm4MoeForCausalLM"],
            num_key_value_heads=2,
            head_dim=16,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            rms_norm_eps=1e-5,
            attention_bias=True,
            use_qk_norm=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
        ["ep2"],
    ),
}


def build_hf_model(name: str, seed: int = 0, **changes):
    """A tiny random float32 HF model with O(1) activations and a non-zero expert bias."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.families import load_hf_config

    config = load_hf_config(dict(CASES[name][0], **changes))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and "norm" in pname:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1 if "gate.weight" not in pname else 0.5)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # so routing really depends on it
                b.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    from megatron_rl.models.families import get_family

    work = tmp_path_factory.mktemp("frontier")
    cases, hf = [], {}
    for name, (cfg, extra) in CASES.items():
        model = build_hf_model(name)
        hf_dir = work / name / "hf"
        model.save_pretrained(hf_dir, max_shard_size="60KB")
        with torch.no_grad():
            hf_logits = model(make_input_ids()).logits.float()
        hf[name] = (hf_dir, hf_logits)
        cases.append(
            dict(
                name=name,
                architecture=cfg["architectures"][0],
                hf_dir=str(hf_dir),
                hf_logits=hf_logits,
                model_cfg=get_family(hf_dir).model_config(hf_dir, make_vocab_size_divisible_by=64),
                input_ids=make_input_ids(),
                layouts=["tp2", "tp1", "pp2", *extra],
            )
        )
    return hf, run_distributed(matrix_ranks, 2, cases, str(work), timeout_s=400)


@pytest.mark.parametrize("name", sorted(CASES))
def test_frontier_family_matches_hf_across_layouts(name, matrix):
    hf, results = matrix
    hf_dir, hf_logits = hf[name]
    assert float(hf_logits.std()) > 0.3
    assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in read_hf_tensors(hf_dir))
    per_rank = [r[name] for r in results]
    assert per_rank[0]["family"] == name
    for r in per_rank:
        for label, res in r.items():
            assert not (isinstance(res, dict) and "error" in res), f"{name} at {label}:\n{res['error']}"
    tp2 = per_rank[0]["tp2"]
    for r in per_rank:
        assert r["tp2"]["diff"] < LOGIT_TOL, (name, r["tp2"]["diff"])
    assert tp2["names_equal"] and tp2["not_bit_equal"] == [] and tp2["config_equal"], tp2
    for label in ["tp1", "pp2", *CASES[name][1]]:
        layout = [r[label] for r in per_rank]
        with_logits = [r for r in layout if "diff" in r]
        assert with_logits, label
        for r in with_logits:
            assert r["diff"] < LOGIT_TOL, (name, label, r["diff"])
            assert r["ckpt_equal"], (name, label)
        for r in (r for r in layout if "names_equal" in r):
            assert r["names_equal"] and r["not_bit_equal"] == [], (name, label, r)


TP_EP_LAYOUTS = {
    # Expert-TP = TP (Megatron's default): the alltoall dispatcher gathers tokens over expert-TP with
    # uneven per-rank counts (parallel.cpu_compat.redirect_uneven_tp_collectives makes gloo take them).
    "tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    # Expert-TP = 1, the usual MoE layout: experts whole, attention split.
    "tp2ep2etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
}


def _tp_ep_ranks(rank, world_size, cases):
    """TP=2 x EP=2 on 4 ranks (expert-TP 2 and 1): HF load, logits, bit-exact export on every rank."""
    import traceback

    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh
    from tests.megatron_rl.models.test_families import _export_check, pipeline_logits

    out: dict = {}
    for label, par in TP_EP_LAYOUTS.items():
        pc = ParallelConfig(**par)
        mesh = init_mesh(pc, seed=1234)
        for c in cases:
            try:
                chunks = build_model(c["model_cfg"], build_transformer_config(c["model_cfg"], pc))
                weight_map = get_family(c["architecture"]).weight_map(c["model_cfg"])
                load_hf_checkpoint(chunks, weight_map, c["hf_dir"], mesh=mesh)
                logits = pipeline_logits(chunks, mesh, c["input_ids"], c["model_cfg"].vocab_size)
                res = _export_check(
                    chunks, weight_map, mesh, read_hf_tensors(c["hf_dir"]), bucket_bytes=20_000, all_ranks=True
                )
                res["diff"] = float((logits - c["hf_logits"]).abs().max())
            except Exception:  # noqa: BLE001 - reported per family and layout
                res = {"error": traceback.format_exc()}
            out[(c["name"], label)] = res
        destroy_mesh(mesh)
    return out


def test_frontier_families_match_hf_at_tp2_x_ep2(tmp_path):
    """4 ranks, TP=2 x EP=2 with expert-TP 2 and 1: logits equal HF's, export bit-exact on every rank."""
    from megatron_rl.models.families import get_family

    cases = []
    for name in CASES:
        model, hf_dir = build_hf_model(name), tmp_path / name
        model.save_pretrained(hf_dir, max_shard_size="60KB")
        with torch.no_grad():
            logits = model(make_input_ids()).logits.float()
        cases.append(
            dict(
                name=name,
                architecture=CASES[name][0]["architectures"][0],
                hf_dir=str(hf_dir),
                hf_logits=logits,
                model_cfg=get_family(hf_dir).model_config(hf_dir, make_vocab_size_divisible_by=64),
                input_ids=make_input_ids(),
            )
        )
    results = run_distributed(_tp_ep_ranks, 4, cases, timeout_s=400)
    for per_rank in results:
        assert sorted(per_rank) == sorted((n, label) for n in CASES for label in TP_EP_LAYOUTS)
        for key, res in per_rank.items():
            assert "error" not in res, f"{key}:\n{res['error']}"
            assert res["diff"] < LOGIT_TOL, (key, res["diff"])
            assert res["names_equal"] and res["not_bit_equal"] == [], (key, res)


# ---------------------------------------------------------------------------------------------
# Config translation and weight rules (no ranks needed).
# ---------------------------------------------------------------------------------------------
def test_deepseek_v3_config_translation():
    from megatron_rl.models.extended import ExtendedModelConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_transformer_config
    from parallel.config import ParallelConfig

    m = get_family(CASES["deepseek_v3"][0]).model_config(CASES["deepseek_v3"][0])
    assert isinstance(m, ExtendedModelConfig) and m.multi_latent_attention
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (32, 24, 16, 8, 16)
    assert (m.rope_type, m.rotary_scaling_factor, m.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert (m.mscale, m.mscale_all_dim, m.beta_fast, m.beta_slow) == (1.0, 1.0, 32.0, 1.0)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (8, 4, 32, 96)
    assert m.moe_layer_freq == (0, 1, 1, 1) and [m.layer_is_moe(i) for i in range(4)] == [False, True, True, True]
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert m.moe_shared_expert_intermediate_size == 32 and m.moe_aux_loss_coeff == 0.0
    tc = build_transformer_config(m, ParallelConfig())
    assert type(tc).__name__ == "MLATransformerConfig" and tc.moe_layer_freq == [0, 1, 1, 1]
    assert (tc.q_lora_rank, tc.rope_type, tc.moe_router_score_function, tc.moe_router_group_topk) == (
        32,
        "yarn",
        "sigmoid",
        2,
    )


def test_glm4_moe_config_translation():
    from megatron_rl.models.families import get_family

    m = get_family(CASES["glm4_moe"][0]).model_config(CASES["glm4_moe"][0])
    assert not m.multi_latent_attention and m.add_qkv_bias and m.qk_layernorm and not m.add_bias_linear
    assert (m.rotary_percent, m.head_dim, m.num_query_groups) == (0.5, 16, 2)
    assert m.moe_layer_freq == (0, 1, 1, 1) and m.moe_router_num_groups is None
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias, m.moe_router_topk_scaling_factor) == (
        "sigmoid",
        True,
        1.5,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_weight_rules_cover_every_hf_tensor(name, tmp_path):
    from megatron_rl.models.families import get_family

    cfg = CASES[name][0]
    family = get_family(cfg)
    wm = family.weight_map(family.model_config(cfg))
    build_hf_model(name).save_pretrained(tmp_path)
    hf_names = set(read_hf_tensors(tmp_path))
    covered = {
        n.format(layer=layer, expert=e)
        for r in wm.rules
        if r.export
        for n in r.hf
        for layer in range(4)
        for e in range(8)
    }
    assert hf_names <= covered, sorted(hf_names - covered)


@pytest.mark.parametrize("name", sorted(CASES))
def test_param_count_equals_hf(name):
    """``ExtendedModelConfig.num_params`` (MLA projections, dense/MoE pattern, shared expert) counts
    exactly HF's parameters."""
    from megatron_rl.models.families import get_family

    m = get_family(CASES[name][0]).model_config(CASES[name][0])
    assert m.num_params() == sum(p.numel() for p in build_hf_model(name).parameters())


def test_yarn_rope_equals_hf():
    """Megatron's YaRN (inverse frequencies, cos/sin scale, softmax scale) equals HF's DeepSeek-V3 YaRN."""
    import math

    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding, _yarn_get_mscale
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from megatron_rl.models.families import get_family, load_hf_config
    from parallel.cpu_compat import redirect_yarn_current_device

    redirect_yarn_current_device()
    hf_cfg = load_hf_config(CASES["deepseek_v3"][0])
    m = get_family(hf_cfg).model_config(hf_cfg)
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, torch.device("cpu"))
    rope = YarnRotaryEmbedding(
        m.qk_pos_emb_head_dim,
        rotary_base=m.rotary_base,
        scaling_factor=m.rotary_scaling_factor,
        original_max_position_embeddings=m.original_max_position_embeddings,
        beta_fast=m.beta_fast,
        beta_slow=m.beta_slow,
        mscale=m.mscale,
        mscale_all_dim=m.mscale_all_dim,
        use_cpu_initialization=True,
    )
    emb, scale = rope(32)
    inv = emb[1, 0, 0, : m.qk_pos_emb_head_dim // 2].float()  # position 1: the frequencies themselves
    # exact: both compute 1 / base^(2i/d), 1 / (factor * base^(2i/d)) and the ramp blend with the same float32
    # ops in the same order; position 1 multiplies by 1.0
    assert torch.equal(inv, hf_inv)
    assert math.isclose(scale, hf_scale, rel_tol=1e-7)
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    mega_softmax = _yarn_get_mscale(m.rotary_scaling_factor, m.mscale_all_dim) ** 2 / math.sqrt(q_head)
    assert math.isclose(mega_softmax, yarn_apply_mscale(hf_cfg.rope_parameters, q_head**-0.5), rel_tol=1e-7)
    assert mega_softmax * math.sqrt(q_head) > 1.2  # mscale_all_dim really scales the softmax


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,changes,message",
    [
        ("deepseek_v3", dict(attention_bias=True), "deepseek_v3: HF config attention_bias=True is not supported"),
        ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=False is not supported; allowed: True"),
        ("deepseek_v3", dict(topk_group=1), "topk_group=1 is not supported; allowed: num_experts_per_tok // 2 = 2"),
        ("deepseek_v3", dict(n_group=3), "n_group=3 is not supported; allowed: a divisor of n_routed_experts=8"),
        ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
        ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
        ("deepseek_v3", dict(rope_parameters=dict(YARN, truncate=False)), "rope_parameters.truncate=False"),
        (
            "deepseek_v3",
            dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
            "rope_parameters.rope_type='linear' is not supported; allowed: 'default' or 'yarn'",
        ),
        ("deepseek_v3", dict(topk_method="greedy"), "topk_method='greedy' is not supported; allowed: 'noaux_tc'"),
        ("glm4_moe", dict(hidden_act="gelu"), "glm4_moe: HF config hidden_act='gelu' is not supported"),
        (
            "glm4_moe",
            dict(n_group=2, topk_group=2),
            "topk_group=2 is not supported; allowed: num_experts_per_tok // 2 = 1",
        ),
    ],
)
def test_unrepresentable_configs_are_rejected(name, changes, message):
    from megatron_rl.models.families import get_family

    cfg = dict(CASES[name][0], **changes)
    with pytest.raises(ValueError) as info:
        get_family(cfg).model_config(cfg)
    assert message in str(info.value), str(info.value)


def test_mla_refuses_megatrons_local_attention():
    from megatron_rl.models.families import get_family

    cfg = CASES["deepseek_v3"][0]
    with pytest.raises(ValueError, match="attention_backend='local'.*cannot run MLA"):
        get_family(cfg).model_config(cfg, attention_backend="local")


def _load_one_rank(rank, world_size, hf_dir, model_cfg):
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    pc = ParallelConfig()
    mesh = init_mesh(pc, seed=1)
    chunks = build_model(model_cfg, build_transformer_config(model_cfg, pc))
    try:
        load_hf_checkpoint(chunks, get_family(hf_dir).weight_map(model_cfg), hf_dir, mesh=mesh)
    except ValueError as exc:
        return str(exc)
    return None


def test_mtp_layers_are_refused_by_name_not_dropped(tmp_path):
    """A hub DeepSeek-V3 checkpoint carries its MTP layer as model.layers.{num_hidden_layers}: the
    load names those tensors and why, instead of dropping them or blaming the family. (With
    num_nextn_predict_layers=1 they are the MTP layer, checked and carried: test_frontier_moe_mtp.py.)"""
    from safetensors.torch import save_file

    from megatron_rl.models.families import get_family

    model = build_hf_model("deepseek_v3", num_hidden_layers=2, num_nextn_predict_layers=0)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    mtp = {
        "model.layers.2.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.2.enorm.weight": torch.ones(64),
        "model.layers.2.self_attn.q_a_proj.weight": torch.zeros(32, 64),
    }
    save_file(mtp, str(tmp_path / "model-mtp.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update({n: "model-mtp.safetensors" for n in mtp})
    index.write_text(json.dumps(data))
    model_cfg = get_family(tmp_path).model_config(tmp_path)
    msg = run_distributed(_load_one_rank, 1, str(tmp_path), model_cfg, timeout_s=200)[0]
    assert (
        msg is not None
        and "3 HF tensors cannot be loaded into this model (deepseek_v3: multi-token-prediction "
        "layers (model.layers.2+) are not built"
        in msg
    ), msg
    assert "model.layers.2.eh_proj.weight" in msg and "no weight rule" not in msg


@pytest.mark.slow
def test_megatron_rl_convert_round_trip_of_deepseek_v3_is_bit_exact(tmp_path):
    """``megatron-rl convert`` both ways at TP=2 (the layout where peers' MLA conversions went wrong):
    the HF -> Megatron step's --verify logits equal HF's, and the HF tensors come back bit for bit
    (the expert bias and the MTP layer included)."""
    import re
    import subprocess
    import sys

    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    hf = build_tiny_hf_checkpoint(tmp_path / "hf", "deepseek_v3", mtp_layers=1)["path"]  # + one MTP layer
    root = Path(__file__).resolve().parents[3]
    cli = [sys.executable, "-m", "megatron_rl.cli", "convert"]
    to_mcore = subprocess.run(
        [*cli, "hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(tmp_path / "mcore"), "--tp", "2", "--verify"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert to_mcore.returncode == 0, to_mcore.stderr[-4000:]
    diff = float(re.search(r"max \|logit diff\| = ([0-9.e+-]+) over 3 prompts", to_mcore.stdout).group(1))
    assert diff < LOGIT_TOL and "done: deepseek_v3 " in to_mcore.stdout
    back = subprocess.run(
        [*cli, "mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out-dir", str(tmp_path / "back")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert back.returncode == 0, back.stderr[-4000:]
    source, written = read_hf_tensors(hf), read_hf_tensors(tmp_path / "back")
    assert sorted(written) == sorted(source) and any("e_score_correction_bias" in n for n in source)
    assert "model.layers.2.eh_proj.weight" in source  # the MTP layer, carried bit for bit at TP=2
    assert [n for n in source if not torch.equal(source[n], written[n])] == []
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# The planner's table rows are what the families make of the published config.json files.
# ---------------------------------------------------------------------------------------------
PUBLISHED_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    rope_scaling=dict(
        beta_fast=32,
        beta_slow=1,
        factor=40,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
        type="yarn",
    ),
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)
PUBLISHED_GLM45 = dict(
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
    vocab_size=151552,
    hidden_size=5120,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_hidden_layers=92,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    n_routed_experts=160,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    partial_rotary_factor=0.5,
    rope_theta=1000000,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    attention_bias=True,
    use_qk_norm=True,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)
PUBLISHED_GLM45_AIR = dict(
    PUBLISHED_GLM45,
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=46,
    n_routed_experts=128,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
    use_qk_norm=False,
)


@pytest.mark.parametrize(
    "name,published,billions,basename",
    [
        ("deepseek_v3", PUBLISHED_DEEPSEEK_V3, 671.03, "DeepSeek-V3-0324"),
        ("glm4_5", PUBLISHED_GLM45, 352.80, "GLM-4.5-FP8"),
        ("glm4_5_air", PUBLISHED_GLM45_AIR, 106.85, "GLM-4.5-Air"),
    ],
)
def test_planner_rows_are_the_published_architectures(name, published, billions, basename):
    from megatron_rl.models.families import get_family, load_hf_config
    from megatron_rl.planner.architectures import KNOWN_ARCHITECTURES, architecture_from_path

    hf = load_hf_config(published)
    assert KNOWN_ARCHITECTURES[name] == get_family(hf).model_config(hf, params_dtype="bfloat16")
    assert round(KNOWN_ARCHITECTURES[name].num_params() / 1e9, 2) == billions
    assert architecture_from_path(f"~/models/{basename}") == name


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_5", "glm4_5_air"])
def test_planner_memory_counts_mla_and_dense_layers(name):
    """The planner's per-rank parameter count (``planner.memory.count_params``) uses the family's
    own layer counts: MLA's projections (not GQA's) and the first-k dense layers (not MoE); at
    TP=EP=1 it is the model's exact size (it counted DeepSeek-V3 7.5% too large before)."""
    from megatron_rl.planner.architectures import KNOWN_ARCHITECTURES
    from megatron_rl.planner.memory import count_params

    m = KNOWN_ARCHITECTURES[name]
    assert sum(count_params(m)) == m.num_params()
    dense, expert = count_params(m, tp=8, ep=8)
    per_layer = [m.layer_params(i, tp=8, ep=8) for i in range(m.num_layers)]
    assert expert == sum(e for _, e in per_layer) and dense > sum(d for d, _ in per_layer)


def _moonlight_rank(rank, world_size, hf_dir, model_cfg, input_ids):
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh
    from tests.megatron_rl.models.test_families import pipeline_logits

    pc = ParallelConfig()
    mesh = init_mesh(pc, seed=1)
    chunks = build_model(model_cfg, build_transformer_config(model_cfg, pc))
    load_hf_checkpoint(chunks, get_family(hf_dir).weight_map(model_cfg), hf_dir, mesh=mesh)
    attn = chunks[0].decoder.layers[0].self_attention
    eps = {
        "input": chunks[0].decoder.layers[0].input_layernorm.eps,
        "kv_latent": attn.kv_layernorm.eps,
        "final": chunks[0].decoder.final_layernorm.eps,
    }
    return pipeline_logits(chunks, mesh, input_ids, model_cfg.vocab_size), eps


def test_moonlight_rms_norm_eps_1e5_matches_hf(tmp_path):
    """Moonlight-16B-A3B is a DeepSeek-V3 checkpoint with rms_norm_eps=1e-5 and no query LoRA: the decoder
    norms take 1e-5, MLA's latent norm keeps HF's fixed 1e-6, and the logits equal transformers'."""
    from megatron_rl.models.families import get_family

    model = build_hf_model("deepseek_v3", rms_norm_eps=1e-5, q_lora_rank=None)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    ids = make_input_ids()
    with torch.no_grad():
        hf_logits = model(ids).logits.float()
    model_cfg = get_family(tmp_path).model_config(tmp_path, make_vocab_size_divisible_by=64)
    assert (model_cfg.layernorm_epsilon, model_cfg.mla_latent_norm_epsilon, model_cfg.q_lora_rank) == (1e-5, 1e-6, None)
    logits, eps = run_distributed(_moonlight_rank, 1, str(tmp_path), model_cfg, ids, timeout_s=200)[0]
    assert eps == {"input": 1e-5, "kv_latent": 1e-6, "final": 1e-5}
    assert float((logits - hf_logits).abs().max()) < LOGIT_TOL
