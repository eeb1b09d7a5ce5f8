"""Tiny Qwen3-shaped HF checkpoints built on the fly, for rollout tests, benches and dry runs.

``build_tiny_qwen3(path)`` writes a complete HF model directory (config.json,
model.safetensors, generation_config.json, a locally trained byte-level BPE tokenizer with a
ChatML template) that HF ``AutoModelForCausalLM``/``AutoTokenizer`` and vLLM load without the
hub. Weights are drawn with a fixed seed and a large init scale, so next-token distributions
are peaked: greedy decoding then has clear top-1 margins and HF and vLLM agree token for
token instead of tripping over near-ties.

The CPU attention backend of vLLM needs ``head_dim`` in {32, 64, 80, 96, 112, 128, ...}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer

__all__ = ["TINY_QWEN3", "build_tiny_qwen3", "random_hf_state_dict", "load_hf_model", "chat_prompts"]

# Smallest shape the vLLM CPU kernels accept (head_dim 32), with GQA and two layers.
TINY_QWEN3: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _qwen3_config(tokenizer_size: int, eos_token_id: int, pad_token_id: int, **overrides: Any):
    from transformers import Qwen3Config

    kwargs = dict(
        vocab_size=tokenizer_size,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="float32",
        **TINY_QWEN3,
    )
    kwargs.update(overrides)  # e.g. a larger vocab_size than the tokenizer's (benchmarks)
    return Qwen3Config(**kwargs)


def random_hf_state_dict(config, seed: int, init_std: float = 0.2) -> dict[str, torch.Tensor]:
    """HF-named float32 weights for ``config``: N(0, init_std) matrices, norms near 1.

    A larger ``init_std`` than HF's 0.02 makes the logits spread out (std ~ init_std *
    sqrt(hidden)), so sampled tokens vary and greedy tokens have clear margins.
    """
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):  # RMSNorm scales: around 1, not around 0
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = init_std * torch.randn(shape, generator=gen)
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def build_tiny_qwen3(
    path: str | Path,
    *,
    seed: int = 0,
    tokenizer_vocab_size: int = 384,
    init_std: float = 0.2,
    tokenizer_texts: list[str] | None = None,
    **config_overrides: Any,
) -> dict[str, Any]:
    """Write a tiny Qwen3 HF checkpoint + tokenizer to ``path``; return its pieces.

    Args:
        path: output directory (created).
        seed: weight seed; two seeds give two checkpoints with the same names and shapes.
        tokenizer_vocab_size: tokenizer training target; the model's vocabulary is ``len(tokenizer)``
            unless ``config_overrides`` sets ``vocab_size``.
        init_std: weight scale (see ``random_hf_state_dict``).
        tokenizer_texts: tokenizer training texts (``default_corpus()`` when None).
        config_overrides: Qwen3Config fields replacing ``TINY_QWEN3``'s (``vocab_size`` may
            exceed the tokenizer's; ids past it are simply never produced by the tokenizer).

    Returns:
        ``{"path", "tokenizer", "config", "state_dict"}``.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    path = Path(path)
    tokenizer = train_byte_bpe_tokenizer(tokenizer_texts, tokenizer_vocab_size, path)
    config = _qwen3_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, **config_overrides)
    config.architectures = ["Qwen3ForCausalLM"]  # vLLM picks the model class (and runner) from it
    config.save_pretrained(str(path))
    # No sampling defaults: vLLM's LLM would otherwise adopt them as its default params.
    generation = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    generation.save_pretrained(str(path))
    state = random_hf_state_dict(config, seed, init_std)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return {"path": str(path), "tokenizer": tokenizer, "config": config, "state_dict": state}


def load_hf_model(config, state_dict: dict[str, torch.Tensor]):
    """An HF ``Qwen3ForCausalLM`` in float32 eval mode holding ``state_dict``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    allowed_missing = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"state_dict does not fit the model: missing={missing}, unexpected={unexpected}")
    return model.eval()


def tiny_qwen3_pair(dir_a: str | Path, dir_b: str | Path, questions: list[str]) -> tuple[dict, dict]:
    """Two tiny Qwen3 checkpoints with the same shapes and tokenizer and different weights (seeds 0 and
    1), each with its HF model (``"hf"``); the first also holds ``questions`` as chat prompts
    (``"prompts"``)."""
    m0, m1 = build_tiny_qwen3(dir_a, seed=0), build_tiny_qwen3(dir_b, seed=1)
    for m in (m0, m1):
        m["hf"] = load_hf_model(m["config"], m["state_dict"])
    m0["prompts"] = chat_prompts(m0["tokenizer"], questions)
    return m0, m1


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Token ids of ChatML user turns followed by an open assistant turn, one per question."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]
