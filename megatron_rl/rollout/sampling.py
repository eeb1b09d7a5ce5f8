"""What one generate call asks vLLM for: ``vllm.SamplingParams`` arguments from the rollout config
(training or validation, with per-call overrides) and the prompts as token-id lists."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from megatron_rl.config.rollout import RolloutConfig, check_sampling

__all__ = ["SAMPLING_KEYS", "prompt_token_ids", "sampling_kwargs"]

# Keys a generate() call may override (rollout config names).
SAMPLING_KEYS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "do_sample",
    "response_length",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "seed",
)


def sampling_kwargs(config: RolloutConfig, *, validate: bool = False, **overrides: Any) -> dict[str, Any]:
    """``vllm.SamplingParams`` arguments for one generate call.

    Training uses the rollout's own sampling keys, validation ``val_kwargs`` (n, temperature,
    top_k, top_p, do_sample); ``do_sample=False`` means greedy. ``overrides`` take rollout key
    names (``SAMPLING_KEYS``); ``response_length`` may not exceed the configured one (the
    engine's context length is fixed at start).
    """
    unknown = set(overrides) - set(SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"unknown sampling override(s) {sorted(unknown)}; allowed: {list(SAMPLING_KEYS)}")
    src = config.val_kwargs if validate else config
    p = {k: getattr(src, k) for k in ("n", "temperature", "top_k", "top_p", "do_sample")}
    shared = ("response_length", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty")
    p.update({k: getattr(config, k) for k in shared})
    p["seed"] = None
    p.update(overrides)
    check_sampling(SimpleNamespace(**p), "")
    if p["response_length"] > config.response_length or p["response_length"] < 1:
        raise ValueError(
            f"response_length={p['response_length']} must lie in [1, rollout.response_length={config.response_length}]"
        )
    if not p["do_sample"]:  # verl's greedy: temperature 0, no filters
        p.update(temperature=0.0, top_p=1.0, top_k=-1)
    return dict(
        n=p["n"],
        temperature=p["temperature"],
        top_p=p["top_p"],
        top_k=p["top_k"],
        max_tokens=p["response_length"],
        stop=list(p["stop"]) if p["stop"] else None,
        stop_token_ids=list(p["stop_token_ids"]) if p["stop_token_ids"] else None,
        ignore_eos=p["ignore_eos"],
        repetition_penalty=p["repetition_penalty"],
        seed=p["seed"],
        logprobs=0 if config.calculate_log_probs else None,
    )


def prompt_token_ids(prompts: Any) -> list[list[int]]:
    """Token-id lists from ``list[list[int]]``, an unpadded ``[b, s]`` tensor, or a padded batch
    (mapping/TensorDict with ``input_ids`` and ``attention_mask``; pads anywhere are dropped)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts tensor must be [batch, seq], got shape {tuple(prompts.shape)}")
        return prompts.tolist()
    if not isinstance(prompts, (list, tuple)) and hasattr(prompts, "keys") and "input_ids" in prompts.keys():
        ids = prompts["input_ids"]
        if "attention_mask" not in prompts.keys():
            raise ValueError("a padded prompt batch needs 'attention_mask' next to 'input_ids'")
        mask = prompts["attention_mask"].bool()
        if ids.shape != mask.shape or ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be [batch, seq]"
            )
        return [row[m].tolist() for row, m in zip(ids, mask)]
    out = []
    for i, p in enumerate(prompts):
        p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not all(isinstance(t, int) for t in p):
            raise TypeError(f"prompt {i} must hold int token ids, got {[type(t).__name__ for t in p[:3]]}...")
        out.append(p)
    return out
