"""Locally trained byte-level BPE tokenizers, for test models and offline dry runs.

Tests and CPU dry runs need a tokenizer that HF ``AutoTokenizer`` and vLLM both load from a
directory without reaching the hub. ``train_byte_bpe_tokenizer`` trains a GPT-2/Qwen-style
byte-level BPE on a handful of texts with the ``tokenizers`` library, wraps it as a
``PreTrainedTokenizerFast`` with Qwen's special tokens and a ChatML chat template, and saves it.
Byte-level matters: every string encodes (no unknown token) and decoding round-trips exactly.
(A WordLevel tokenizer under ``model_type=qwen2`` does not round-trip through AutoTokenizer.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "train_byte_bpe_tokenizer", "default_corpus"]

# Qwen's special tokens: ``<|endoftext|>`` pads, ``<|im_end|>`` ends an assistant turn (eos).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen2/3 use it (without tool calls): one ``<|im_start|>role\n...<|im_end|>\n``
# block per message, plus an open assistant block when ``add_generation_prompt`` is set.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_NUM_BYTES = 256  # the byte-level alphabet: every byte is a base token


def default_corpus() -> list[str]:
    """A few sentences of arithmetic and prose: enough to learn a few hundred merges."""
    base = [
        "The quick brown fox jumps over the lazy dog.",
        "What is 12 plus 30? The answer is 42.",
        "Solve for x: 3x + 5 = 20, so x = 5.",
        "Reinforcement learning from verifiable rewards trains a policy with a reward function.",
        "The policy samples several responses per prompt; the group baseline is their mean reward.",
        "Megatron shards the weights over tensor, pipeline and expert parallel ranks.",
        "vLLM generates the rollouts and returns the log-probabilities of the sampled tokens.",
        "Question: how many apples are left if you eat 3 of 10? Answer: 7 apples.",
    ]
    digits = [f"{a} + {b} = {a + b}" for a in range(0, 40, 3) for b in range(0, 40, 7)]
    return base * 4 + digits


def train_byte_bpe_tokenizer(
    texts: Iterable[str] | None = None,
    vocab_size: int = 512,
    path: str | Path | None = None,
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    chat_template: str = CHATML_TEMPLATE,
    model_max_length: int = 32768,
):
    """Train a byte-level BPE on ``texts`` and return it as a ``PreTrainedTokenizerFast``.

    Args:
        texts: training texts (``default_corpus()`` when None).
        vocab_size: target size including the 256 byte tokens and the special tokens; the
            trainer stops early when ``texts`` allow fewer merges, so ``len(tokenizer)`` can be
            smaller. Size the model's vocabulary from ``len(tokenizer)``.
        path: directory to ``save_pretrained`` into (tokenizer.json, tokenizer_config.json,
            special_tokens_map.json, chat template); not saved when None.
        special_tokens: added as unsplittable tokens with the first ids, in this order.
        eos_token / pad_token: which special tokens end a response and pad a batch.
        chat_template: Jinja template for ``apply_chat_template`` (ChatML by default).
        model_max_length: recorded in tokenizer_config.json.

    Returns:
        The tokenizer; ``tokenizer.eos_token_id`` / ``pad_token_id`` are set.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = list(special_tokens)
    for name, tok in (("eos_token", eos_token), ("pad_token", pad_token)):
        if tok not in special_tokens:
            raise ValueError(f"{name}={tok!r} must be one of special_tokens={special_tokens}")
    min_size = _NUM_BYTES + len(special_tokens)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small; a byte-level BPE needs at least {min_size} "
            f"(256 byte tokens + {len(special_tokens)} special tokens)"
        )
    texts = list(default_corpus() if texts is None else texts)
    if not texts:
        raise ValueError("texts is empty; give at least one training text")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=eos_token,
        pad_token=pad_token,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(path))
    return tokenizer
