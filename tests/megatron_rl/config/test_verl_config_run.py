"""verl 0.9.1's generated Megatron config runs here unchanged, through verl's command line.

``python -m megatron_rl.main_ppo --config-name=ppo_megatron_trainer`` with verl's own file (kept in
``megatron_rl/config/verl``) and only what a CPU needs substituted -- a tiny inline model, the toy
task for the data paths, one CPU rank, float32 -- trains two steps of GRPO with verl's
``optimal_token_baseline`` estimator (its ``sum_pi_squared`` comes from the actor's fused
vocab-parallel pass). The printed key table refuses nothing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")

TINY_MODEL = (
    "{num_layers: 1, hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 2, num_query_groups: 2, "
    "kv_channels: 32, vocab_size: 512, max_position_embeddings: 512, qk_layernorm: true, "
    "attention_backend: sdpa}"
)
CPU = [  # what a CPU run needs instead of verl's GPU defaults; everything else is verl's file as it is
    "actor_rollout_ref.model.path=null",
    f"+actor_rollout_ref.model.config={TINY_MODEL}",
    "+actor_rollout_ref.model.family=qwen3",
    "data.train_files=null",
    "data.val_files=null",
    "+data.task=toy_reverse",
    "data.max_prompt_length=64",
    "data.max_response_length=16",
    "data.train_batch_size=4",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[console]",
    "trainer.val_before_train=false",
    "trainer.total_training_steps=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.dtype=float32",
    "+actor_rollout_ref.rollout.kv_cache_space_gib=1",
    "actor_rollout_ref.actor.megatron.dtype=float32",
    "actor_rollout_ref.ref.megatron.dtype=float32",
    "critic.megatron.dtype=float32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
]


@pytest.mark.slow
def test_verl_generated_config_runs_two_otb_steps_through_main_ppo(tmp_path, ray_session):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl.main_ppo",
        "--config-path=config",
        "--config-name=ppo_megatron_trainer",
        "algorithm.adv_estimator=optimal_token_baseline",
        *CPU,
        f"trainer.default_local_dir={out}",
    ]
    # It joins the session's Ray (RAY_ADDRESS), as `ray job submit` would: nothing here is about Ray's start.
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=ray_session.env(dict(os.environ))
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("verl keys of") :].splitlines()[:4]
    assert table[3].split() == ["refused", "0"], table
    assert int(table[1].split()[-1]) > 200 and int(table[2].split()[4]) > 580, table
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["actor/grad_norm"]) and math.isfinite(r["critic/advantages/mean"])
