"""The role table: names -> classes with declared batch fields; typed configs checked before any build."""

from __future__ import annotations

import pytest

from megatron_rl.config import ActorConfig, CriticConfig, RewardModelConfig
from megatron_rl.data.batch import fields_of
from megatron_rl.roles import Actor, Critic, RewardModel, build_role, role_class

FORWARD = ("input_ids", "attention_mask", "responses")


def test_role_names_map_to_classes_and_heads():
    assert {n: role_class(n) for n in ("actor", "ref", "teacher", "critic", "reward")} == {
        "actor": Actor,
        "ref": Actor,
        "teacher": Actor,
        "critic": Critic,
        "reward": RewardModel,
    }
    assert (Actor.head, Critic.head, RewardModel.head) == ("lm", "scalar", "scalar")
    with pytest.raises(
        ValueError, match=r"^role='policy'; allowed: \['actor', 'critic', 'ref', 'reward', 'teacher'\]$"
    ):
        role_class("policy")


def test_every_batch_method_declares_its_fields():
    log_prob = fields_of(Actor.compute_log_prob)  # router replay R3 replays the rollout's routed_experts
    assert (log_prob.required, tuple(log_prob.optional)) == (FORWARD, ("routed_experts",))
    assert fields_of(Actor.compute_topk_log_probs).all == FORWARD
    assert fields_of(RewardModel.compute_rm_score).all == FORWARD
    assert fields_of(Critic.compute_values).all == FORWARD + ("response_mask",)
    assert fields_of(Critic.update_critic).all == FORWARD + ("response_mask", "values", "returns")
    update = fields_of(Actor.update_policy)
    assert update.required == FORWARD + ("response_mask",)
    assert set(update.optional) == {
        "old_log_probs",
        "advantages",
        "ref_log_prob",
        "rollout_is_weights",
        "teacher_log_probs",
        "teacher_topk_log_probs",
        "teacher_topk_ids",
        "routed_experts",
    }


@pytest.mark.parametrize(
    "name,config,expected",
    [
        ("actor", CriticConfig(), "ActorConfig"),
        ("teacher", RewardModelConfig(), "ActorConfig"),
        ("critic", ActorConfig(), "CriticConfig"),
        ("reward", CriticConfig(), "RewardModelConfig"),
    ],
)
def test_a_wrong_config_type_is_refused_before_the_engine_is_built(name, config, expected):
    # mesh=None: the check runs before anything touches a process group.
    with pytest.raises(TypeError, match=rf"^{name}: expected a {expected}, got {type(config).__name__}$"):
        build_role(name, None, None, config)
