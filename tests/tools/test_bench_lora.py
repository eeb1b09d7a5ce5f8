"""``tools/bench_lora.py``: LoRA vs full fine-tuning in one run, the adapter-only sync beside the merged one."""

from __future__ import annotations

import pytest


def test_bench_lora_measures_the_adapter_only_sync_against_the_merged_one():
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.planner.lora_sizes import adapter_sync_tensors
    from tools.bench_lora import main

    model = ModelConfig(
        num_layers=2,
        hidden_size=256,
        ffn_hidden_size=768,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=4096,
        qk_layernorm=True,
    )

    out = main(["--steps", "1", "--layers", "2", "--rank", "8"])
    full, lora = out["full"], out["lora"]
    # the frozen base: gradients and Adam state of the adapters only
    assert lora["resident"]["grads"] == lora["adapter_param_bytes"] > 0
    assert out["grads_ratio"] == pytest.approx(lora["adapter_param_bytes"] / full["resident"]["grads"])
    # merge: false moves the compact adapter, each tensor once: exactly the adapters' bytes
    assert lora["adapter_sync_bytes"] == lora["adapter_param_bytes"]
    # per layer: q/k/v's B + their A, o_proj's A and B, gate/up's B + their A, down_proj's A and B
    assert lora["adapter_sync_tensors"] == 2 * 11 == adapter_sync_tensors(model, LoRAConfig(rank=8))
    assert lora["sync_bytes"] == full["sync_bytes"]  # merge: true moves the whole (merged) model
    assert out["adapter_sync_bytes_ratio"] == pytest.approx(lora["adapter_sync_bytes"] / lora["sync_bytes"])
    assert out["adapter_sync_bytes_ratio"] < 0.05
    assert out["adapter_sync_seconds_ratio"] > 0


def test_bench_lora_vllm_needs_one_rank():
    from tools.bench_lora import _parse

    with pytest.raises(SystemExit):
        _parse(["--vllm", "--tp", "2"])
