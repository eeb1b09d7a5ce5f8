"""Bypass mode runs no old-log-prob pass (verl's ``apply_bypass_mode``), unless the step needs one of its
products; the trainer and the planner read the same rule (``RunNeeds.old_log_prob``).

The trainer's ``compute_old_log_prob`` is called on a trainer built without workers: its actor records the
passes asked of it (a real pass needs Ray workers; ``test_recipes``' ``grpo+bypass`` runs the whole loop and
still reports ``rollout_corr/kl``, now from the loss)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos.needs import resolve_run
from megatron_rl.config.loader import load_config
from megatron_rl.data.batch import Batch
from megatron_rl.planner import plan_run
from megatron_rl.planner.step_run import build_run
from megatron_rl.planner.hardware import get_hardware
from megatron_rl.trainer.ppo_trainer import RayPPOTrainer, active_rollout_correction

BYPASS = ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=null"]
SPSQ = ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]


class _Actor:
    """Records each log-prob pass asked of it and answers with fixed log-probs."""

    def __init__(self):
        self.calls = []

    def compute_log_prob(self, batch, **kwargs):
        self.calls.append(kwargs)
        shape = batch["responses"].shape
        out = {"log_probs": torch.full(shape, -1.0), "entropys": torch.full(shape, 0.5)}
        if kwargs.get("calculate_sum_pi_squared"):
            out["sum_pi_squared"] = torch.full(shape, 0.25)
        return out


def _trainer(overrides):
    config = load_config("grpo", overrides)
    trainer = object.__new__(RayPPOTrainer)  # the step's logic alone: no workers
    trainer.config, trainer.needs, trainer.actor = config, resolve_run(config), _Actor()
    trainer.rollout_correction = active_rollout_correction(config.algorithm.rollout_correction)
    trainer.router_replay = config.actor_rollout_ref.actor.megatron.router_replay
    trainer.temperature = 1.0
    return trainer


def _batch():
    return Batch(
        {
            "responses": torch.zeros(2, 3, dtype=torch.long),
            "response_mask": torch.ones(2, 3),
            "rollout_log_probs": torch.full((2, 3), -2.0),
        }
    )


def test_bypass_mode_takes_the_rollouts_log_probs_without_a_pass():
    trainer, batch = _trainer(BYPASS), _batch()
    assert trainer.needs.old_log_prob is False
    assert trainer.compute_old_log_prob(batch) == {}
    assert trainer.actor.calls == [] and torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])


def test_bypass_mode_without_the_rollouts_log_probs_names_the_key():
    trainer, batch = _trainer(BYPASS), _batch()
    batch.pop(["rollout_log_probs"])
    with pytest.raises(ValueError, match="rollout.calculate_log_probs=True"):
        trainer.compute_old_log_prob(batch)


def test_bypass_mode_still_runs_the_pass_for_sum_pi_squared():
    trainer, batch = _trainer(BYPASS + SPSQ), _batch()
    assert trainer.needs.old_log_prob is True
    metrics = trainer.compute_old_log_prob(batch)
    assert len(trainer.actor.calls) == 1 and "rollout_corr/kl" in metrics
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"]) and "sum_pi_squared" in batch


def test_decoupled_mode_runs_the_pass():
    trainer, batch = _trainer([]), _batch()
    assert trainer.needs.old_log_prob is True
    trainer.compute_old_log_prob(batch)
    assert len(trainer.actor.calls) == 1 and torch.equal(batch["old_log_probs"], torch.full((2, 3), -1.0))


@pytest.mark.parametrize("overrides, skipped", [([], False), (BYPASS, True), (BYPASS + SPSQ, False)])
def test_the_planner_skips_the_pass_exactly_when_the_trainer_does(overrides, skipped):
    config = load_config("grpo", overrides)
    run = build_run(config, plan_run(config, suggest=False), get_hardware("H100"), None, None, None)
    old = next(p for p in run.passes if p.phase == "old_log_prob")
    assert old.skipped is skipped is (not resolve_run(config).old_log_prob)
