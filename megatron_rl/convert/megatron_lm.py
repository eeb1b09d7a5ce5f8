"""What a Megatron-LM user needs next to a converted checkpoint: its arguments and layout.

``convert_hf_to_mcore.py`` writes the distributed checkpoint in Megatron-LM's ``--load`` layout
(``latest_checkpointed_iteration.txt`` saying ``release`` and the checkpoint in ``release/``;
``common.pt`` carries ``checkpoint_version`` 3.0 and ``iteration`` 0) and, beside it,
``megatron_args.json``: the model's ``pretrain_gpt.py`` arguments (argparse destinations and
values, as ``megatron.training.arguments`` names them) and a ready command line. A release
checkpoint loads without ``--finetune`` (no optimizer or RNG state is expected).

The padded vocabulary must match: Megatron-LM pads ``tokenizer.vocab_size`` to a multiple of
``make_vocab_size_divisible_by`` x TP; ``padded_vocab_size`` here is what the checkpoint holds (the
HF config's ``vocab_size`` padded the same way at the conversion's TP).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

ARGS_FILE = "megatron_args.json"
RELEASE = "release"


def megatron_lm_args(model_cfg, parallel_config, padded_vocab_size: int) -> dict[str, Any]:
    """``pretrain_gpt.py`` argument destinations -> values for ``model_cfg`` at ``parallel_config``."""
    mc, pc = model_cfg, parallel_config
    groups = mc.num_query_groups or mc.num_attention_heads
    args: dict[str, Any] = dict(
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        ffn_hidden_size=mc.ffn_hidden_size,
        num_attention_heads=mc.num_attention_heads,
        group_query_attention=groups != mc.num_attention_heads,
        num_query_groups=groups,
        kv_channels=mc.head_dim,
        max_position_embeddings=mc.max_position_embeddings,
        seq_length=min(mc.max_position_embeddings, 4096),
        position_embedding_type="rope",
        rotary_base=int(mc.rotary_base),
        rotary_percent=mc.rotary_percent,
        use_rope_scaling=mc.rope_scaling,
        rope_scaling_factor=mc.rope_scaling_factor,
        normalization=mc.normalization,
        norm_epsilon=mc.layernorm_epsilon,
        swiglu=mc.swiglu,
        disable_bias_linear=not mc.add_bias_linear,
        add_qkv_bias=mc.add_qkv_bias,
        qk_layernorm=mc.qk_layernorm,
        untie_embeddings_and_output_weights=not mc.tie_word_embeddings,
        make_vocab_size_divisible_by=mc.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size,
        vocab_size=mc.vocab_size,
        bf16=mc.params_dtype == "bfloat16",
        fp16=mc.params_dtype == "float16",
        tensor_model_parallel_size=pc.tensor_model_parallel_size,
        pipeline_model_parallel_size=pc.pipeline_model_parallel_size,
        expert_model_parallel_size=pc.expert_model_parallel_size,
        ckpt_format="torch_dist",
    )
    if pc.virtual_pipeline_model_parallel_size:
        args["num_layers_per_virtual_pipeline_stage"] = mc.num_layers // (
            pc.pipeline_model_parallel_size * pc.virtual_pipeline_model_parallel_size
        )
    if mc.is_moe:
        args.update(
            num_experts=mc.num_moe_experts,
            moe_ffn_hidden_size=mc.moe_ffn_hidden_size or mc.ffn_hidden_size,
            moe_router_topk=mc.moe_router_topk,
            moe_router_pre_softmax=mc.moe_router_pre_softmax,
            moe_router_load_balancing_type=mc.moe_router_load_balancing_type,
            moe_aux_loss_coeff=mc.moe_aux_loss_coeff,
            moe_grouped_gemm=mc.moe_grouped_gemm,
            moe_token_dispatcher_type=mc.moe_token_dispatcher_type,
            moe_shared_expert_intermediate_size=mc.moe_shared_expert_intermediate_size,
        )
        if pc.expert_tensor_parallel_size is not None:
            args["expert_tensor_parallel_size"] = pc.expert_tensor_parallel_size
    extra = getattr(mc, "megatron_kwargs", None)
    if extra is not None:  # MLA, YaRN, sigmoid/grouped routing: TransformerConfig fields, not all Megatron-LM flags
        args["transformer_config_overrides"] = {k: v for k, v in extra().items() if _jsonable(v)}
    return args


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def command_line(args: dict[str, Any], load_dir: str | Path, tokenizer_dir: str | Path) -> str:
    """``pretrain_gpt.py`` flags that build this model and load the checkpoint at ``load_dir``."""
    flags = []
    for key, value in args.items():
        if key in ("padded_vocab_size", "vocab_size", "transformer_config_overrides") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
        else:
            flags += [flag, str(value)]
    flags += [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tokenizer_dir),
        "--load",
        str(load_dir),
        "--no-load-optim",
        "--no-load-rng",
    ]
    return "pretrain_gpt.py " + " ".join(shlex.quote(f) for f in flags)


def write_megatron_lm_files(out_tmp: Path, final: Path, args: dict[str, Any]) -> None:
    """Megatron-LM's tracker (``release``) and ``megatron_args.json`` into ``out_tmp`` (becomes ``final``)."""
    from parallel.checkpoint import TRACKER_FILE

    (out_tmp / TRACKER_FILE).write_text(RELEASE)
    doc = {
        "args": args,
        "command_line": command_line(args, final, final),
        "note": "Megatron-LM pads tokenizer.vocab_size to make_vocab_size_divisible_by x TP: the result must "
        "equal padded_vocab_size (the checkpoint's embedding rows)",
    }
    (out_tmp / ARGS_FILE).write_text(json.dumps(doc, indent=2) + "\n")
