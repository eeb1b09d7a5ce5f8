"""The colocated phase schedule (``megatron_rl.trainer.schedule``) shared by the trainer and the planner.

For every GPU recipe the trainer's ``PhaseRunner`` is driven through two steps in dry mode: the
phases it enters are the planner's phases, in the same order; after the transitions it would
execute, every role holds exactly the parts the schedule declares; and each phase's total in the
plan equals the bytes implied by that executed state. Bad input (offload on a GPU whose rollout
cannot sleep, a plan that does not fit) is refused by key with a fitting alternative.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from megatron_rl.algos.needs import resolve_run
from megatron_rl.config.loader import load_config
from megatron_rl.planner import plan_run
from megatron_rl.planner.memory import GIB
from megatron_rl.trainer.phases import PhaseRunner
from megatron_rl.trainer.placement import reference_in_actor
from megatron_rl.trainer.schedule import RolloutSleepUnsupported, step_schedule

RECIPES = sorted(f"gpu/{p.stem}" for p in (Path(__file__).parents[3] / "recipes" / "gpu").glob("*.yaml"))
# GLM-4.5 355B and DeepSeek-V3 (FP8 rollout weights) run on H200 141 GB; every other recipe on H100 80 GB
GPU_MEMORY_GB = {"gpu/glm4_5_355b_grpo": 141.0, "gpu/deepseek_v3_671b_grpo": 141.0}
A = "actor_rollout_ref.actor.megatron"
OFF = [
    f"{A}.param_offload=false",
    f"{A}.grad_offload=false",
    f"{A}.optimizer_offload=false",
    "actor_rollout_ref.ref.megatron.param_offload=false",
]
VERL_CLIENT = ["trainer.nnodes=1", f"{A}.expert_model_parallel_size=4"]  # TP=4 PP=2 EP=4, vLLM TP=4 at 0.6
PART = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes"}


def _state_bytes(plan, state: dict, role: str) -> int:
    return sum(getattr(plan.roles[role], PART[p]) for p in state[role])


def _trainer_schedule(cfg):
    """The schedule ``RayPPOTrainer.__init__`` builds: a LoRA actor that is its own reference (adapters off)
    has no reference role, so no reference phase."""
    needs = resolve_run(cfg)
    return step_schedule(cfg, dataclasses.replace(needs, reference=False) if reference_in_actor(cfg, needs) else needs)


@pytest.mark.parametrize("recipe", RECIPES)
def test_trainer_schedule_equals_the_plan(recipe):
    cfg = load_config(recipe)
    schedule = _trainer_schedule(cfg)
    plan = plan_run(cfg, gpu_memory_gb=GPU_MEMORY_GB.get(recipe, 80.0))
    runner = PhaseRunner(schedule, dry=True)
    for _step in range(2):
        for phase in schedule.phases:
            runner.enter(phase.name)
            want = schedule.resident(phase.name)
            assert {k: set(v) for k, v in runner.state.items()} == {k: set(v) for k, v in want.items()}, phase.name
            terms = plan.phases[phase.label]
            # the plan's resident roles are exactly what the executed transitions left on the device
            others = sum(_state_bytes(plan, runner.state, r) for r in plan.roles if r != phase.active)
            if phase.active is None:
                assert sum(v for k, v in terms.items() if "resident" in k) == others
            else:
                assert terms["other roles resident"] == others
                active = runner.state[phase.active]
                assert (terms["gradients"] > 0) == ("grads" in active and plan.roles[phase.active].grad_bytes > 0)
                assert (terms["optimizer state"] > 0) == (
                    "optimizer" in active and plan.roles[phase.active].optimizer_bytes > 0
                )
    assert runner.history == schedule.names * 2
    assert list(plan.phases) == [p.label for p in schedule.phases]
    assert schedule.names[0] == "gen" and schedule.names[-2:] == ["update_actor", "update_weights"]


def test_colocated_transitions_of_the_30b_recipe():
    cfg = load_config("gpu/qwen3_30b_a3b_grpo")
    runner = PhaseRunner(step_schedule(cfg, resolve_run(cfg)), dry=True)
    for name in runner.schedule.names:
        runner.enter(name)
    runner.enter("gen")
    acts = [(phase, t.target, t.action, t.parts) for phase, t in runner.actions]
    # first generation: everything offloaded; then the rollout sleeps before the actor comes back
    assert acts[:2] == [
        ("gen", "actor", "offload", ("params", "grads", "optimizer")),
        ("gen", "ref", "offload", ("params",)),
    ]
    assert acts[2:4] == [
        ("old_log_prob", "rollout", "sleep", ("weights", "kv_cache")),
        ("old_log_prob", "actor", "onload", ("params",)),
    ]
    assert ("ref", "actor", "offload", ("params",)) in acts  # one role on the device at a time
    assert ("update_actor", "actor", "onload", ("params", "grads", "optimizer")) in acts
    assert ("update_weights", "actor", "offload", ("grads", "optimizer")) in acts
    assert ("update_weights", "rollout", "wake_up", ("weights",)) in acts
    assert acts[-2:] == [("gen", "actor", "offload", ("params",)), ("gen", "rollout", "wake_up", ("kv_cache",))]
    assert runner.schedule.sleep_level == 2  # every step's sync refills the dropped weights


def test_out_of_order_phase_is_refused():
    cfg = load_config("gpu/qwen3_30b_a3b_grpo")
    runner = PhaseRunner(step_schedule(cfg, resolve_run(cfg)), dry=True)
    runner.enter("update_actor")
    with pytest.raises(RuntimeError, match="phase 'old_log_prob' entered after 'update_actor'"):
        runner.enter("old_log_prob")


def test_offload_with_a_rollout_that_cannot_sleep_is_refused():
    cfg = load_config("gpu/qwen3_30b_a3b_grpo", ["actor_rollout_ref.rollout.free_cache_engine=false"])
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref\.actor\.megatron\.param_offload=True .*free_cache_engine="
        r"False.*set actor_rollout_ref\.rollout\.free_cache_engine=True",
    ):
        step_schedule(cfg, resolve_run(cfg))
    with pytest.raises(ValueError, match="free_cache_engine=True"):
        plan_run(cfg)


def test_cpu_rollout_cannot_sleep_and_says_so():
    cfg = load_config("grpo", [f"{A}.param_offload=true"])
    schedule = step_schedule(cfg, resolve_run(cfg))
    assert not schedule.rollout_sleeps and schedule.offload["actor"] == ("params",)
    assert schedule.warnings and schedule.warnings[0].startswith("RolloutSleepUnsupported")
    assert all(schedule.resident(n)["rollout"] == ("weights", "kv_cache") for n in schedule.names)
    plan = plan_run(cfg)
    assert plan.phases["actor update"]["vllm engine"] > 0  # the plan never pretends the engine sleeps
    assert issubclass(RolloutSleepUnsupported, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not step_schedule(load_config("grpo"), resolve_run(load_config("grpo"))).warnings


def test_verl_client_layout_without_offload_does_not_fit_and_names_the_term():
    fits = plan_run(load_config("gpu/qwen3_30b_a3b_grpo", VERL_CLIENT))
    assert fits.fits and fits.phases["rollout"]["vllm engine"] == int(0.6 * 80 * GIB)
    plan = plan_run(load_config("gpu/qwen3_30b_a3b_grpo", VERL_CLIENT + OFF))
    assert not plan.fits and plan.peak_phase == "rollout"
    assert plan.dominant_term == "actor resident (parameters, gradients, optimizer state)"
    assert plan.phases["rollout"][plan.dominant_term] > 60 * GIB  # bf16 weights + fp32 grads + Adam state
    assert plan.suggestion.startswith(
        f"Offload fits this layout: set {A}.param_offload=True {A}.grad_offload=True "
        f"{A}.optimizer_offload=True actor_rollout_ref.ref.megatron.param_offload=True"
    )


def test_optimizer_state_is_divided_by_dp_only_with_the_distributed_optimizer():
    from megatron_rl.planner import count_params

    off = plan_run(load_config("gpu/qwen3_30b_a3b_grpo", [f"{A}.use_distributed_optimizer=false"]))
    on = plan_run(load_config("gpu/qwen3_30b_a3b_grpo"))  # verl's default: sharded
    assert (off.sizes["dp"], off.sizes["expert_dp"]) == (2, 1)
    dense, expert = count_params(off.model, tp=4, pp=2, ep=8, etp=1)
    per_param = 12  # Adam m + v + fp32 master of bf16 weights
    assert off.roles["actor"].optimizer_bytes == (dense + expert) * per_param
    assert on.roles["actor"].optimizer_bytes == -(-dense * per_param // 2) + expert * per_param  # experts: DP 1
    assert on.roles["ref"] == off.roles["ref"]  # a frozen role has no optimizer to shard


def test_distributed_optimizer_is_the_default_and_refuses_a_non_adam_optimizer_by_key():
    cfg = load_config("ppo")
    assert (
        cfg.actor_rollout_ref.actor.megatron.use_distributed_optimizer and cfg.critic.megatron.use_distributed_optimizer
    )
    for where in ("actor_rollout_ref.actor", "critic"):
        with pytest.raises(
            ValueError,
            match=rf"^{where}\.megatron\.use_distributed_optimizer=True is not allowed with "
            rf"{where}\.optim\.optimizer='sgd': .* set {where}\.megatron\."
            rf"use_distributed_optimizer=False or {where}\.optim\.optimizer=adam$",
        ):
            load_config("ppo", [f"{where}.optim.optimizer=sgd"])
        plain = load_config(
            "ppo", [f"{where}.optim.optimizer=sgd", f"{where}.megatron.use_distributed_optimizer=false"]
        )
        section = plain.critic if where == "critic" else plain.actor_rollout_ref.actor
        assert section.optim.optimizer == "sgd" and not section.megatron.use_distributed_optimizer


def test_sharded_optimizer_figures_of_the_published_layouts():
    # the 30B recipe: DP=2 over the dense parameters, the experts' DP is 1 (EP=8 spans the DP ranks)
    sharded, plain = (
        plan_run(load_config("gpu/qwen3_30b_a3b_grpo", ov)) for ov in ([], [f"{A}.use_distributed_optimizer=false"])
    )
    assert sharded.roles["actor"].optimizer_bytes < plain.roles["actor"].optimizer_bytes
    assert sharded.peak_bytes == plain.peak_bytes  # the rollout phase (vLLM + idle roles offloaded) is the peak
    # verl's client layout is DP=1: sharding changes nothing, offload off still does not fit
    client = plan_run(load_config("gpu/qwen3_30b_a3b_grpo", VERL_CLIENT + OFF))
    assert client.sizes["dp"] == 1 and not client.fits
    assert round(client.peak_bytes / GIB, 1) == 123.2
