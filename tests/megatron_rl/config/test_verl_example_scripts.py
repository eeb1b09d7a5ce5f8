"""verl's own Megatron example scripts, planned with their own command lines.

``data/verl_example_scripts.json`` keeps the arguments each script of verl's ``examples/`` passes
to ``verl.trainer.main_ppo``. Each is fed to ``megatron-rl plan`` (in-process: ``megatron_rl.cli.main``;
one subprocess smoke) with only its model paths pointed at a local ``config.json`` -- the script's
model as published on the hub, written here from its known shapes -- and, where the script leaves
them empty for the user to fill, a model path and a training file. The expected outcome of each:
exit 0 when the run would start, 1 when it does not fit (the dominant memory term named), 2 when
the configuration itself is refused (the reason named). One does-not-fit plan is checked against a
hand calculation of its terms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional

import pytest

DATA = Path(__file__).parent / "data" / "verl_example_scripts.json"
SCRIPTS: dict[str, list[str]] = json.loads(DATA.read_text())["scripts"]
GIB = 2**30

_QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_act="silu",
    tie_word_embeddings=False,
    rope_theta=1e6,
    vocab_size=152064,
    torch_dtype="bfloat16",
)
_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_act="silu",
    tie_word_embeddings=False,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    max_position_embeddings=40960,
    torch_dtype="bfloat16",
)
_DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    hidden_act="silu",
    tie_word_embeddings=False,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="noaux_tc",
    norm_topk_prob=True,
    scoring_func="sigmoid",
    moe_layer_freq=1,
    torch_dtype="bfloat16",
)
_QWEN2_7B = dict(
    _QWEN2,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
)
"""Qwen2-7B and Qwen2.5-7B: the same published shapes."""
_QWEN3_30B_A3B = dict(
    _QWEN3_MOE,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
)
HF_CONFIGS = {  # the hub's config.json of each script's model, its shape fields as published
    "Qwen2-7B-Instruct": _QWEN2_7B,
    "Qwen2.5-7B-Instruct": _QWEN2_7B,
    "Qwen2.5-32B": dict(
        _QWEN2,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "Qwen3-30B-A3B": _QWEN3_30B_A3B,
    "Qwen3-30B-A3B-Base": _QWEN3_30B_A3B,  # the pre-trained checkpoint: the same shapes, 40960 positions, rope 1e6
    "Qwen3-30B-A3B-Instruct-2507": dict(
        _QWEN3_30B_A3B,
        max_position_embeddings=262144,
        rope_theta=1e7,
    ),
    "Qwen3-235B-A22B": dict(
        _QWEN3_MOE,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
    ),
    "DeepSeek-V3": dict(
        _DEEPSEEK_V3,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        q_lora_rank=1536,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        vocab_size=129280,
        max_position_embeddings=163840,
        rope_theta=10000,
        rms_norm_eps=1e-6,
        num_nextn_predict_layers=1,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "Moonlight-16B-A3B": dict(
        _DEEPSEEK_V3,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        routed_scaling_factor=2.446,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        vocab_size=163840,
        max_position_embeddings=8192,
        rope_theta=50000.0,
        rope_scaling=None,
        rms_norm_eps=1e-5,
    ),
    "Qwen1.5-MoE-A2.7B": dict(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        hidden_act="silu",
        tie_word_embeddings=False,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=151936,
        max_position_embeddings=8192,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts=60,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        torch_dtype="bfloat16",
    ),
    "deepseek-llm-7b-chat": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        tie_word_embeddings=False,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=30,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=102400,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
    ),
}


@dataclasses.dataclass(frozen=True)
class Expect:
    """What ``plan`` says of one script: its model, the exit code and the line that names why."""

    model: str
    rc: int
    says: str
    """A fragment of the verdict (rc 0/1: its peak phase and largest term) or of the refusal (rc 2)."""
    gpu_memory_gb: Optional[float] = None
    """The scripts written for 96 GB GPUs (H20, ``*_96gb``) are planned at 96 GiB; the rest at the H100's 80."""


EXPECTED = {
    "examples/grpo_trainer/run_qwen2-7b_math_megatron.sh": Expect(
        "Qwen2-7B-Instruct", 0, "FITS -- peak 76.8 of 80.0 GiB (rollout)"
    ),
    "examples/gpg_trainer/run_qwen2-7b_math_megatron.sh": Expect(
        "Qwen2-7B-Instruct", 0, "FITS -- peak 73.3 of 80.0 GiB (rollout)"
    ),
    # 61 layers over PP=16 as 4 + 14 x 4 + 1 (num_layers_in_first/last_pipeline_stage), everything offloaded.
    "examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh": Expect(
        "DeepSeek-V3", 0, "FITS -- peak 68.0 of 80.0 GiB (rollout)"
    ),
    "examples/tuning/32b/qwen2_32B_grpo_8_h20_megatron_vllm.sh": Expect(
        "Qwen2.5-32B", 0, "FITS -- peak 95.3 of 96.0 GiB (actor update)", gpu_memory_gb=96
    ),
    "examples/grpo_trainer/run_moonlight16b_math_megatron.sh": Expect(
        "Moonlight-16B-A3B",
        1,
        "in phase 'actor update' but 80.0 GiB are available; the largest term is activations (71.7 GiB)",
    ),
    "examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": Expect(
        "Qwen3-30B-A3B",
        1,
        "in phase 'actor update' but 96.0 GiB are available; the largest term is activations (95.7 GiB)",
        gpu_memory_gb=96,
    ),
    "examples/ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh": Expect(
        "Qwen1.5-MoE-A2.7B",
        1,
        "in phase 'rollout' but 80.0 GiB are available; the largest term is vllm engine (56.0 GiB)",
    ),
    # The critic keeps verl's critic.megatron defaults (TP=1, PP=1): a whole 7B model per GPU.
    "examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": Expect(
        "Qwen2-7B-Instruct",
        1,
        "in phase 'critic update' but 80.0 GiB are available; the largest term is activations (40.1 GiB)",
    ),
    "examples/ppo_trainer/run_deepseek_math_gsm8k_megatron.sh": Expect(
        "deepseek-llm-7b-chat",
        1,
        "in phase 'critic update' but 80.0 GiB are available; the largest term is activations (34.4 GiB)",
    ),
    # The same PPO under Nsight (actor/critic.profiler.*, global_profiler.*: the profiler keys) with 256 prompts
    # and gpu_memory_utilization=0.8: the engine's share alone is 0.8 x 80 GiB = 64.0 GiB, beside the actor's and
    # the critic's, which the script leaves at TP=1.
    "examples/ppo_trainer/run_deepseek_math_gsm8k_megatron_nsys.sh": Expect(
        "deepseek-llm-7b-chat",
        1,
        "in phase 'rollout' but 80.0 GiB are available; the largest term is vllm engine (64.0 GiB)",
    ),
    # micro-batch 3 does not divide the mini-batch's 8 x 5 responses, but use_dynamic_bsz=True: token budgets
    # decide the micro-batches, as in verl. The old actor.router_replay.mode is read as megatron.router_replay.mode.
    "examples/router_replay/run_qwen30_a3b_megatron_vllm.sh": Expect(
        "Qwen3-30B-A3B", 0, "FITS -- peak 72.9 of 80.0 GiB (actor update)"
    ),
    # Megatron's account_for_embedding/loss_in_pipeline_split: 94 + 2 over PP=8 as 11 + 6 x 12 + 11 layers
    # (test_qwen3_235b_accounted_split_matches_a_hand_count).
    "examples/grpo_trainer/run_qwen3-235b_megatron_96gb.sh": Expect(
        "Qwen3-235B-A22B",
        1,
        "in phase 'actor update' but 96.0 GiB are available; the largest term is activations (99.0 GiB)",
        gpu_memory_gb=96,
    ),
    # The script splits the actor's 27 layers 14 + 13 but leaves the critic's override_transformer_config at
    # verl's default (no uneven split): Megatron refuses 27 layers over PP=2 there, in verl as here.
    "examples/ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": Expect(
        "Moonlight-16B-A3B",
        2,
        "critic.megatron: num_layers=27 is not divisible by "
        "pipeline_model_parallel_size=2; nearest valid layout: none of the valid layouts fits 32 GPUs of 80 GiB; the one with the lowest "
        "peak is critic.megatron.pipeline_model_parallel_size=1 critic.megatron.expert_model_parallel_size=32 "
        "(peak 80.1 GiB in 'rollout'); Offload fits this layout",
    ),
    # The script keeps verl's default merge: false: the adapters alone are synced into vLLM's LoRA (issue 29).
    # The frozen base keeps no gradients or Adam state and there is no reference model: 58.0 GiB, where its
    # full fine-tuning twin needs 76.8 (tests/megatron_rl/planner/test_lora_plan.py).
    "examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh": Expect(
        "Qwen2-7B-Instruct", 0, "FITS -- peak 58.0 of 80.0 GiB (rollout)"
    ),
    "examples/grpo_trainer/run_deepseek7b_llm_math_megatron.sh": Expect(
        "deepseek-llm-7b-chat", 0, "FITS -- peak 69.7 of 80.0 GiB (rollout)"
    ),
    "examples/grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh": Expect(
        "Qwen2-7B-Instruct", 0, "FITS -- peak 64.9 of 80.0 GiB (actor update)"
    ),
    "examples/grpo_trainer/run_qwen2_5-7b_math_megatron_diff_tp.sh": Expect(
        "Qwen2.5-7B-Instruct", 0, "FITS -- peak 76.8 of 80.0 GiB (rollout)"
    ),
    # verl's Megatron LoRA script for the MoE model (merge: false: adapter-only sync).
    "examples/grpo_trainer/run_qwen3moe-30b_megatron_lora.sh": Expect(
        "Qwen3-30B-A3B-Instruct-2507", 0, "FITS -- peak 24.0 of 80.0 GiB (rollout)"
    ),
    # 61 layers over PP=12 as 11 x 5 + 6 (num_layers_in_last_pipeline_stage alone: the first stages split the
    # rest evenly, as Megatron-Core does). optim.override_optimizer_config.optimizer_cpu_offload with fraction
    # 1.0 and the precision-aware optimizer: Megatron's CPU Adam holds all optimizer state in host memory.
    "examples/grpo_trainer/run_deepseek671b_math_megatron_96gb.sh": Expect(
        "DeepSeek-V3", 0, "FITS -- peak 61.6 of 96.0 GiB (rollout)", gpu_memory_gb=96
    ),
    # Planned on ARNOLD_WORKER_NUM=1 node of ARNOLD_WORKER_GPU=8 (the script reads its cluster's environment).
    "examples/gspo_trainer/run_qwen30b_gspo.sh": Expect(
        "Qwen3-30B-A3B-Base", 0, "FITS -- peak 78.1 of 80.0 GiB (actor update)"
    ),
    # 2 x 8 GPUs: TP=4 EP=4 training, 4 vLLM engines of TP=1 x DP=4 (expert-parallel 4) each.
    "examples/gspo_trainer/test_gspo_qwen30b_a3b_ep.sh": Expect(
        "Qwen3-30B-A3B-Base", 0, "FITS -- peak 69.5 of 80.0 GiB (actor update)"
    ),
    # Its Megatron variant (backend=megatron; the script ships backend=fsdp) on the one 8-GPU node it asks Slurm
    # for: EP=8 over 8 GPUs leaves expert-DP=1, so the distributed optimizer cannot shard the experts' Adam state.
    "examples/sapo_trainer/run_qwen30b_sapo.sh": Expect(
        "Qwen3-30B-A3B-Base",
        1,
        "in phase 'actor update' but 80.0 GiB are available; the largest term is optimizer state (42.7 GiB)",
    ),
    # PPO with a critic and a 7B reward model (reward_model.*: verl's older keys, read as reward.*), all three
    # resident beside vLLM in the rollout: the planner names the offload keys that fit it.
    "examples/ppo_trainer/run_deepseek_full_hh_rlhf.sh": Expect(
        "deepseek-llm-7b-chat",
        1,
        "in phase 'rollout' but 80.0 GiB are available; the largest term is actor resident "
        "(parameters, gradients, optimizer state) (48.3 GiB)",
    ),
}
_PATH_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path")
_FILE_KEYS = ("data.train_files", "data.val_files")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_configs")
    dirs = {}
    for name, config in HF_CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        dirs[name] = root / name
    return dirs


def command_line(script: str, model_dir: Path, train_file: Path) -> list[str]:
    """The script's arguments, its model paths (the hub's or the user's, empty) pointed at ``model_dir``,
    and the training/validation files it leaves empty for the user at ``train_file``."""
    out = []
    for arg in SCRIPTS[script]:
        key, _, value = arg.partition("=")
        if key in _PATH_KEYS:
            arg = f"{key}={model_dir}"
        elif key in _FILE_KEYS and not value:
            arg = f"{key}={train_file}"
        out.append(arg)
    return out


def plan(argv: list[str]) -> tuple[int, str]:
    """``megatron-rl plan ARGV`` in-process: (exit code, stdout + stderr)."""
    from megatron_rl.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the key table's InertKeyWarnings are tested elsewhere
        rc = main(["plan", *argv])
    return rc, out.getvalue()


def test_every_stored_script_has_an_expectation():
    assert sorted(EXPECTED) == sorted(SCRIPTS)
    assert {e.model for e in EXPECTED.values()} == set(HF_CONFIGS)


# A refused layout gets the nearest valid one named (megatron_rl.job.layout_hint): a search over TP/PP/EP and
# the micro-batch, here through ~200 candidate configs (5 s on 2 cores; the Moonlight hint text is pinned).
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_verl_example_script_plans(script, model_dirs, tmp_path):
    expect = EXPECTED[script]
    train_file = tmp_path / "train.parquet"
    argv = command_line(script, model_dirs[expect.model], train_file)
    if expect.gpu_memory_gb is not None:
        argv += ["--gpu-memory-gb", str(expect.gpu_memory_gb)]
    rc, out = plan(argv)
    assert rc == expect.rc, out[-3000:]
    assert expect.says in out, out[-3000:]
    if rc in (0, 1):
        assert f"model: {model_dirs[expect.model]}/config.json" in out  # the local copy, not the built-in table


def test_qwen2_7b_ppo_critic_misfit_matches_a_hand_count(model_dirs, tmp_path):
    """verl's Qwen2-7B PPO script on 8 x 80 GiB: the critic (verl's critic.megatron defaults: TP=1, PP=1,
    DP=8) does not fit in its update. Its terms, counted by hand from Qwen2-7B's published shapes."""
    h, f, layers, heads, kv, d, vocab = 3584, 18944, 28, 28, 4, 128, 152064
    attention = h * heads * d + heads * d + 2 * (h * kv * d + kv * d) + heads * d * h  # q, k, v with biases; o
    layer = attention + 3 * h * f + 2 * h  # + SwiGLU MLP + two RMSNorms
    critic = vocab * h + layers * layer + h + h  # embedding, layers, final norm, value head (no bias)
    assert critic == 7_070_622_720
    dp, micro, tokens = 8, 4, 1024 + 512  # max prompt + max response
    # Saved per token and layer (megatron_rl.planner.memory): 5 hidden-sized tensors, 3 x (q + kv heads) x head_dim,
    # 5 x ffn for SwiGLU; plus the final norm's input, all bf16.
    activations = 2 * micro * tokens * (layers * (5 * h + 3 * (heads + kv) * d + 5 * f) + h)
    hand = {
        "parameters": 2 * critic,
        "gradients": 4 * critic,
        "optimizer state": 12 * critic // dp,
        "activations": activations,
    }
    assert round(hand["activations"] / GIB, 2) == 40.07

    rc, out = plan(
        command_line(
            "examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh",
            model_dirs["Qwen2-7B-Instruct"],
            tmp_path / "train.parquet",
        )
    )
    assert rc == 1, out[-3000:]
    row = next(line for line in out.splitlines() if line.strip().startswith("critic update"))
    terms = dict(t.rsplit(" ", 1) for t in row[row.index("(") + 1 : row.rindex(")")].split(", "))
    for term, value in hand.items():
        assert float(terms[term]) == pytest.approx(value / GIB, abs=0.005), (term, row)
    assert "the largest term is activations (40.1 GiB)" in out


def test_qwen3_235b_accounted_split_matches_a_hand_count(model_dirs, tmp_path):
    """verl's Qwen3-235B script on 4 x 8 x 96 GiB (TP=4, PP=8, EP=4, ETP=1: DP=1) with the embedding and the
    loss counted as a layer each: 94 + 2 = 96 over PP=8 is 12 per stage, so the first stage builds 11 decoder
    layers + the embedding, the six middle stages 12, the last 11 + the output layer. The actor update's
    terms, counted by hand from Qwen3-235B-A22B's published shapes: the parameters of the most loaded stage
    (a middle one, 12 layers) and the activations of stage 0 (1F1B: 8 micro-batches in flight, 11 layers)."""
    h, heads, kv, d, experts, f, vocab = 4096, 64, 4, 128, 128, 1536, 151936
    tp, ep, pp, topk, tokens = 4, 4, 8, 8, 11680  # tokens: ppo_max_token_len_per_gpu (use_dynamic_bsz)
    attention = (h * heads * d + 2 * h * kv * d + heads * d * h) // tp + 2 * d  # q, k, v, o; q/k norms
    layer = attention + 2 * h + experts * h + experts // ep * 3 * h * f  # + two RMSNorms, router, 32 experts
    embedding = vocab * h // tp
    middle, first = 12 * layer, 11 * layer + embedding
    assert (middle, first) == (7_468_059_648, 7_001_303_808) and middle > first
    # Saved per token and layer (megatron_rl.planner.memory), sequence parallel over TP: 5 hidden-sized
    # tensors, 3 x (q + kv heads) x head_dim, fp32 router logits/probs, per routed token 3 x hidden + 5 x ffn.
    per_token = 5 * h // tp + 3 * (heads // tp + kv // tp) * d + (2 * experts * 4 // 2 + topk * (3 * h + 5 * f)) // tp
    activations = 2 * tokens * (pp * 11 * per_token + h // tp)  # + the embedding output, bf16
    hand = {"parameters": 2 * middle, "gradients": 4 * middle, "activations": activations}
    assert round(activations / GIB, 2) == 99.02  # 12 layers at stage 0 (an even count) would be 108.0

    rc, out = plan(
        command_line(
            "examples/grpo_trainer/run_qwen3-235b_megatron_96gb.sh",
            model_dirs["Qwen3-235B-A22B"],
            tmp_path / "train.parquet",
        )
        + ["--gpu-memory-gb", "96"]
    )
    assert rc == 1, out[-3000:]
    row = next(line for line in out.splitlines() if line.strip().startswith("actor update"))
    terms = dict(t.rsplit(" ", 1) for t in row[row.index("(") + 1 : row.rindex(")")].split(", "))
    for term, value in hand.items():
        assert float(terms[term]) == pytest.approx(value / GIB, abs=0.005), (term, row)
    assert "the largest term is activations (99.0 GiB)" in out


def test_plan_subprocess_smoke(model_dirs, tmp_path):
    """The installed ``megatron-rl`` command with a verl script's command line, exit 0."""
    argv = command_line(
        "examples/gpg_trainer/run_qwen2-7b_math_megatron.sh",
        model_dirs["Qwen2-7B-Instruct"],
        tmp_path / "train.parquet",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "plan", *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fits"] and result["peak_phase"] == "rollout" and result["layout"]["tp"] == 2, result


def _terms(out: str, phase: str) -> dict[str, float]:
    row = next(line for line in out.splitlines() if line.strip().startswith(phase))
    return {k: float(v) for k, v in (t.rsplit(" ", 1) for t in row[row.index("(") + 1 : row.rindex(")")].split(", "))}


def test_qwen30b_sapo_optimizer_misfit_matches_a_hand_count(model_dirs, tmp_path):
    """verl's SAPO script (its Megatron variant) on 8 x 80 GiB: TP=1, EP=8 -> DP=8 for the dense weights but
    expert-DP=1, so the distributed optimizer shards only the dense part of Adam's 12 B/param (m, v, fp32
    master). Counted by hand from Qwen3-30B-A3B's published shapes."""
    h, heads, kv, d, vocab, layers, experts, f, ep, dp = 2048, 32, 4, 128, 151936, 48, 128, 768, 8, 8
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d  # q, k, v, o (no biases); q/k norms
    dense = 2 * vocab * h + layers * (attention + 2 * h + experts * h) + h  # embedding, output, norms, router
    expert = layers * experts // ep * 3 * h * f
    assert (dense, expert) == (1_541_093_376, 3_623_878_656)
    hand = {
        "parameters": 2 * (dense + expert),
        "gradients": 4 * (dense + expert),
        "optimizer state": 12 * dense // dp + 12 * expert,
    }
    assert round(hand["optimizer state"] / GIB, 2) == 42.65
    script = "examples/sapo_trainer/run_qwen30b_sapo.sh"
    rc, out = plan(command_line(script, model_dirs["Qwen3-30B-A3B-Base"], tmp_path / "train.parquet"))
    assert rc == 1, out[-3000:]
    terms = _terms(out, "actor update")
    for term, value in hand.items():
        assert terms[term] == pytest.approx(value / GIB, abs=0.005), (term, terms)
    assert "the largest term is optimizer state (42.7 GiB)" in out


_CPU_OPTIMIZER = "+actor_rollout_ref.actor.optim.override_optimizer_config."


def test_deepseek_96gb_cpu_optimizer_moves_the_adam_state_to_the_host(model_dirs, tmp_path):
    """verl's DeepSeek-V3 96 GB script: TP=8 PP=12 EP=8 on 96 GPUs is DP=1 and expert-DP=1, so each rank's Adam
    state is 12 B per bf16 parameter of its stage: 6 x the parameters term. Its optimizer overrides
    (optimizer_cpu_offload, optimizer_offload_fraction=1., use_precision_aware_optimizer) give all of it to
    megatron-core's CPU optimizer: no optimizer term on the GPU, 16 B per parameter in host memory (fp32 copy,
    m, v, pinned fp32 gradient) = 8 x the parameters term, named in a warning. Without them it does not fit."""
    script = "examples/grpo_trainer/run_deepseek671b_math_megatron_96gb.sh"
    argv = command_line(script, model_dirs["DeepSeek-V3"], tmp_path / "train.parquet") + ["--gpu-memory-gb", "96"]
    assert sum(a.startswith(_CPU_OPTIMIZER) for a in argv) == 4

    rc, out = plan(argv)
    assert rc == 0, out[-3000:]
    terms = _terms(out, "actor update")
    assert "optimizer state" not in terms, terms
    assert terms["gradients"] == pytest.approx(2 * terms["parameters"], abs=0.01)
    host = float(out.split("optimizer_cpu_offload: ")[1].split(" GiB")[0])
    assert host == pytest.approx(8 * terms["parameters"], abs=0.1), out[-3000:]

    rc, out = plan([a for a in argv if not a.startswith(_CPU_OPTIMIZER)])
    assert rc == 1, out[-3000:]
    gpu_terms = _terms(out, "actor update")
    assert gpu_terms["optimizer state"] == pytest.approx(6 * terms["parameters"], abs=0.01), gpu_terms
    assert "the largest term is optimizer state (97.9 GiB)" in out

    # megatron-core's precision-aware optimizer works on the distributed optimizer's shards only
    rc, out = plan(argv + ["actor_rollout_ref.actor.megatron.use_distributed_optimizer=False"])
    assert rc == 2, out[-3000:]
    assert "use_precision_aware_optimizer=True needs actor_rollout_ref.actor.megatron.use_distributed_optimizer" in out
    rc, out = plan(argv + [f"{_CPU_OPTIMIZER[1:]}optimizer_offload_fraction=1.5"])
    assert rc == 2, out[-3000:]
    assert "optimizer_offload_fraction=1.5 is not allowed" in out and "[0, 1]" in out
