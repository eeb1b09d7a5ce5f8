"""Built-in (inline) models made real: an HF checkpoint from a recipe's ``model.config``, and a
brief supervised warm-up on a toy task.

A toy recipe describes its policy inline (``actor_rollout_ref.model.config`` + ``family``)
instead of pointing at a hub checkpoint. The Ray trainer, the bridge and vLLM all start from an
HF directory, so ``materialize_inline_model`` writes one: a byte-level BPE tokenizer trained on
the task's own texts (ChatML template), ``config.json`` of the family with the inline shape, and
weights with HF's default initialisation under a fixed seed.

``sft_warmup`` then trains that checkpoint for a few steps with plain transformers on the
task's ``(prompt, answer)`` pairs (cross-entropy on the answer tokens and the closing eos only),
the way RL usually starts from an SFT model: a from-scratch model never emits a well-formed
answer, so all rewards would be 0 and GRPO would have no signal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

__all__ = [
    "INLINE_FAMILIES",
    "MEGATRON_OPTIONS",
    "hf_config_kwargs",
    "megatron_overrides",
    "materialize_inline_model",
    "sft_train",
    "sft_warmup",
    "task_texts",
]

INLINE_FAMILIES = ("qwen3", "qwen3_moe")
"""Families an inline model can be materialised as."""
MEGATRON_OPTIONS = (
    "make_vocab_size_divisible_by",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_load_balancing_type",
    "moe_router_dtype",
    "moe_token_dispatcher_type",
    "moe_grouped_gemm",
    "freeze_router",
    "params_dtype",
    "attention_backend",
)
"""``ModelConfig`` fields that are Megatron-side options, not architecture an HF config.json holds: an
inline model's values reach the workers as overrides (``megatron_overrides``)."""


def hf_config_kwargs(model_cfg: Any, family: str) -> dict[str, Any]:
    """``transformers`` config kwargs (without the vocabulary) of inline ``ModelConfig`` ``model_cfg``.

    Raises ValueError for a family other than ``qwen3`` / ``qwen3_moe`` or a field the family cannot
    express (``qwen3_moe``: routed experts in every layer, ``moe_router_topk`` of them per token,
    normalised top-k softmax -- ``moe_router_pre_softmax`` False -- and no shared expert).
    """
    if family not in INLINE_FAMILIES:
        raise ValueError(f"model.family={family!r}: inline models can be materialised as {list(INLINE_FAMILIES)}")
    get = (lambda k, d=None: getattr(model_cfg, k, d)) if not isinstance(model_cfg, dict) else model_cfg.get
    # What a dense Qwen3 config.json cannot carry: these must keep Qwen3's values (the MoE-only
    # fields their dense defaults), or the workers would build another model than the one asked for.
    fixed = {
        "normalization": ("RMSNorm",),
        "qk_layernorm": (True,),
        "swiglu": (True,),
        "add_qkv_bias": (False, None),
        "add_bias_linear": (False, None),
        "num_moe_experts": (None,),
        "rotary_percent": (1.0,),
        "rope_scaling": (False,),
        "rope_scaling_factor": (8.0,),
        "moe_ffn_hidden_size": (None,),
        "moe_shared_expert_intermediate_size": (None,),
    }
    moe = {}
    if family == "qwen3_moe":
        if get("num_moe_experts") is None:
            raise ValueError("model.config.num_moe_experts is required for family qwen3_moe")
        fixed.pop("num_moe_experts"), fixed.pop("moe_ffn_hidden_size")
        fixed["moe_router_pre_softmax"] = (False,)
        moe = dict(
            num_experts=int(get("num_moe_experts")),
            num_experts_per_tok=int(get("moe_router_topk", 2)),
            moe_intermediate_size=int(get("moe_ffn_hidden_size") or get("ffn_hidden_size")),
            norm_topk_prob=True,
            router_aux_loss_coef=float(get("moe_aux_loss_coeff", 0.0)),
        )
    for key, allowed in fixed.items():
        if get(key, allowed[0]) not in allowed:
            raise ValueError(f"model.config.{key}={get(key)!r} does not fit family {family} (allowed: {list(allowed)})")
    heads = int(get("num_attention_heads"))
    head_dim = int(get("kv_channels") or int(get("hidden_size")) // heads)
    return dict(
        hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("ffn_hidden_size")),
        num_hidden_layers=int(get("num_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("num_query_groups") or heads),
        head_dim=head_dim,
        max_position_embeddings=int(get("max_position_embeddings", 4096)),
        rms_norm_eps=float(get("layernorm_epsilon", 1e-6)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rotary_base", 10000.0))},
        **moe,
    )


def megatron_overrides(model_cfg: Any) -> dict[str, Any]:
    """The ``MEGATRON_OPTIONS`` of inline ``model_cfg`` that differ from ``ModelConfig``'s defaults:
    the overrides the workers apply on top of the materialised checkpoint's architecture."""
    from megatron_rl.config.model import ModelConfig

    default = ModelConfig()
    return {k: getattr(model_cfg, k) for k in MEGATRON_OPTIONS if getattr(model_cfg, k) != getattr(default, k)}


def task_texts(rows: Sequence[dict]) -> list[str]:
    """Tokenizer training texts of verl-layout toy rows: each question and answer."""
    texts = []
    for row in rows:
        texts.append(str(row["extra_info"]["question"]))
        texts.append(str(row["extra_info"]["answer"]))
    return texts


def materialize_inline_model(
    path: str | Path, model_cfg: Any, family: str, texts: Sequence[str], *, seed: int = 0
) -> dict[str, Any]:
    """Write an HF checkpoint of inline model ``model_cfg`` to ``path``; return its pieces.

    The tokenizer is trained on ``texts`` with at most ``model_cfg.vocab_size`` entries; the
    model's vocabulary is ``len(tokenizer)``. Weights: HF's initialisation under ``seed``.

    Returns ``{"path", "tokenizer", "config"}``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3MoeConfig

    from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer

    kwargs = hf_config_kwargs(model_cfg, family)
    vocab = int(model_cfg["vocab_size"] if isinstance(model_cfg, dict) else model_cfg.vocab_size)
    path = Path(path)
    tokenizer = train_byte_bpe_tokenizer(list(texts), vocab, path)
    config_cls, arch = (
        (Qwen3MoeConfig, "Qwen3MoeForCausalLM") if family == "qwen3_moe" else (Qwen3Config, "Qwen3ForCausalLM")
    )
    config = config_cls(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
        **kwargs,
    )
    config.architectures = [arch]  # vLLM and the bridge pick the model class from it
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    # No sampling defaults: vLLM would otherwise adopt them as its default sampling params.
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        str(path)
    )
    return {"path": str(path), "tokenizer": tokenizer, "config": config}


def _sft_examples(tokenizer, rows: Sequence[dict]) -> list[tuple[list[int], list[int]]]:
    """``(token ids, loss mask)`` per row: chat prompt + answer + eos, the loss on answer + eos."""
    out = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer.encode(prompt, add_special_tokens=False)
        a_ids = tokenizer.encode(str(row["extra_info"]["answer"]), add_special_tokens=False)
        out.append((p_ids + a_ids + [tokenizer.eos_token_id], [0] * len(p_ids) + [1] * (len(a_ids) + 1)))
    return out


def sft_train(
    model_dir: str | Path,
    out_dir: str | Path,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    warmup_ratio: float = 0.1,
    log: Optional[list] = None,
    record: Optional[dict] = None,
    num_threads: Optional[int] = None,
) -> Path:
    """Train the HF model in ``model_dir`` for ``steps`` AdamW steps on ``(ids, loss_mask)`` examples;
    save it (with its tokenizer and generation config) to ``out_dir`` and return that path.

    Each step draws ``batch_size`` examples with replacement (``seed``), right-pads them and takes
    the mean cross-entropy over the tokens whose mask is 1; the lr warms up linearly over
    ``warmup_ratio`` of the steps, then decays on a cosine; gradients are clipped to norm 1.
    ``log`` (a list) receives the loss per step; ``sft_warmup.json`` records the settings, the
    losses and ``record``. ``num_threads`` sets torch's intra-op threads for the duration (None:
    unchanged -- a different count changes the float sums, so runs compare only at the same one).
    """
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, int(warmup_ratio * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))
    )
    pad = tokenizer.pad_token_id
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        for _ in range(steps):
            batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=gen).tolist()]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((batch_size, width), pad, dtype=torch.long)  # [b, s], right-padded
            labels = torch.full((batch_size, width), -100, dtype=torch.long)
            attention = torch.zeros((batch_size, width), dtype=torch.long)
            for r, (ids, mask) in enumerate(batch):
                row = torch.tensor(ids)
                input_ids[r, : len(ids)] = row
                labels[r, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), row, -100)
                attention[r, : len(ids)] = 1
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if log is not None:
                log.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    if (model_dir / "generation_config.json").exists():
        shutil.copy(model_dir / "generation_config.json", out_dir / "generation_config.json")
    (out_dir / "sft_warmup.json").write_text(
        json.dumps({"steps": steps, "batch_size": batch_size, "lr": lr, **(record or {}), "losses": log})
    )
    return out_dir


def sft_warmup(
    model_dir: str | Path,
    out_dir: str | Path,
    rows: Sequence[dict],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    warmup_ratio: float = 0.1,
    log: Optional[list] = None,
) -> Path:
    """Train the HF model in ``model_dir`` for ``steps`` AdamW steps on ``rows``' answers; save
    it (with the tokenizer files) to ``out_dir`` and return that path.

    Loss: mean cross-entropy over the answer tokens and the closing eos (prompt tokens are
    masked), cosine-decayed ``lr`` after a linear warm-up (``sft_train``). ``log`` (a list)
    receives the loss per step.
    """
    from transformers import AutoTokenizer

    if steps < 1:
        raise ValueError(f"sft_warmup: steps={steps} must be >= 1")
    if not rows:
        raise ValueError("sft_warmup: rows is empty")
    examples = _sft_examples(AutoTokenizer.from_pretrained(str(model_dir)), rows)
    return sft_train(
        model_dir,
        out_dir,
        examples,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        warmup_ratio=warmup_ratio,
        log=log,
    )
