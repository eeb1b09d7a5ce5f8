"""``trainer.v1.*`` and the rollout's placement keys: typed, verl's names, and bad input refused
(``ValueError`` naming key and value) when the config is built -- before any worker starts."""

from __future__ import annotations

import types
import warnings

import pytest

from megatron_rl.config import RunConfig, compose
from megatron_rl.config.compat import InertKeyWarning

ASYNC = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "trainer.v1.separate_async.parameter_sync_step=2",
]


def _build(*overrides, recipe="grpo"):
    return RunConfig.from_dict(compose(recipe, list(overrides)))


def test_verl_keys_are_typed_fields_with_verl_defaults():
    cfg = _build()
    v1 = cfg.trainer.v1
    assert (
        v1.trainer_mode,
        v1.colocate_async.num_warmup_batches,
        v1.separate_async.num_warmup_batches,
        v1.separate_async.parameter_sync_step,
        v1.sampler.max_off_policy_threshold,
        v1.sampler.max_off_policy_strategy,
        v1.partial_rollout,
    ) == ("sync", 1, 1, 4, 8, "drop", False)
    assert not v1.is_async and v1.lookahead() == 0
    assert (cfg.actor_rollout_ref.rollout.nnodes, cfg.actor_rollout_ref.rollout.n_gpus_per_node) == (0, 1)
    cfg = _build(
        *ASYNC, "trainer.v1.separate_async.num_warmup_batches=2", "trainer.v1.sampler.max_off_policy_threshold=null"
    )
    assert (
        cfg.trainer.v1.is_async
        and cfg.trainer.v1.lookahead() == 2
        and cfg.trainer.v1.sampler.max_off_policy_threshold is None
    )
    recipe = _build(recipe="grpo_async")
    assert recipe.trainer.v1.trainer_mode == "separate_async" and recipe.algorithm.rollout_correction.bypass_mode


def test_acted_on_keys_no_longer_warn_and_the_rest_of_v1_stays_inert():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _build(
            *ASYNC, "trainer.v1.sampler.max_off_policy_threshold=2", "trainer.v1.sampler.max_off_policy_strategy=wait"
        )
    assert not [w for w in caught if issubclass(w.category, InertKeyWarning)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _build("trainer.v1.separate_async.hybrid_rollout.enable_switch=true")
    texts = [str(w.message) for w in caught if issubclass(w.category, InertKeyWarning)]
    assert any(t.startswith("trainer.v1.separate_async.hybrid_rollout.enable_switch=") for t in texts), texts


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.v1.sampler.max_off_policy_threshold=-1"],
            "trainer.v1.sampler.max_off_policy_threshold=-1 must be >= 0",
        ),
        (
            ["trainer.v1.sampler.max_off_policy_strategy=keep"],
            "trainer.v1.sampler.max_off_policy_strategy='keep' is not allowed",
        ),
        (["trainer.v1.trainer_mode=fully_async"], "trainer.v1.trainer_mode='fully_async' is not allowed"),
        (
            ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2"],
            "'separate_async' needs the rollout on its own resources: set actor_rollout_ref.rollout.nnodes >= 1",
        ),
        (
            ["trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.rollout.nnodes=1"],
            "'colocate_async' shares the trainer's resources, but actor_rollout_ref.rollout.nnodes=1",
        ),
        (["actor_rollout_ref.rollout.nnodes=1"], "actor_rollout_ref.rollout.nnodes=1 (a separate rollout) idles"),
        ([*ASYNC, "actor_rollout_ref.rollout.nnodes=2"], "actor_rollout_ref.rollout.nnodes=2: on CPU"),
        (
            [*ASYNC, "actor_rollout_ref.rollout.n_gpus_per_node=0"],
            "needs actor_rollout_ref.rollout.n_gpus_per_node >= 1",
        ),
        (
            [*ASYNC, "trainer.v1.separate_async.parameter_sync_step=4"],
            "parameter_sync_step=4: verl's separate_async pushes weights every parameter_sync_step mini-batches",
        ),
        (
            [*ASYNC, "trainer.v1.separate_async.num_warmup_batches=150"],
            "trainer.v1.separate_async.num_warmup_batches=150 is not smaller than trainer.total_training_steps=150",
        ),
        (
            ["trainer.v1.trainer_mode=colocate_async", "trainer.total_training_steps=1"],
            "trainer.v1.colocate_async.num_warmup_batches=1 is not smaller than trainer.total_training_steps=1",
        ),
        (
            ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=-1"],
            "trainer.v1.colocate_async.num_warmup_batches=-1",
        ),
        (["trainer.v1.partial_rollout=true"], "trainer.v1.partial_rollout=True is not supported: the rollout engine"),
        (
            [*ASYNC, "actor_rollout_ref.rollout.calculate_log_probs=false"],
            "set actor_rollout_ref.rollout.calculate_log_probs=True",
        ),
        (["trainer.v1.trainer_mode=colocate_async", "data.gen_batch_size=3"], "data.gen_batch_size=3 must divide"),
        ([*ASYNC, "trainer.device=cuda"], "generates while the actor trains, so the engine must stay awake"),
        (
            [*ASYNC, "reward.reward_model.enable=true", "reward.reward_model.model_path=/rm"],
            "with reward.reward_model.enable=True is not supported",
        ),
    ],
)
def test_bad_input_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _build(*overrides)


def test_dapo_in_async_mode_is_accepted_with_whole_prompt_batches():
    """DAPO dynamic sampling runs in async modes now (groups filtered before the buffer); the
    rollouter's prompt batches (data.gen_batch_size) must still divide the training batch."""
    cfg = _build("trainer.v1.trainer_mode=colocate_async", "data.gen_batch_size=8", recipe="dapo")
    assert cfg.algorithm.filter_groups.enable and cfg.trainer.v1.is_async
    with pytest.raises(ValueError, match="data.gen_batch_size=24 must divide data.train_batch_size=32"):
        _build("trainer.v1.trainer_mode=colocate_async", "data.gen_batch_size=24", recipe="dapo")


def test_trainer_level_checks_before_any_worker():
    """What needs the run's needs or its epoch-derived length: ReMax's greedy baseline, and warm-up
    batches past the last step when ``total_training_steps`` is not set."""
    from megatron_rl.trainer.async_loop import async_run_config, async_settings, check_async_trainer

    cfg = _build("trainer.v1.trainer_mode=colocate_async")
    check_async_trainer(cfg, types.SimpleNamespace(baseline=True), 10)  # ReMax runs in colocate_async
    with pytest.raises(
        ValueError,
        match="adv_estimator='grpo' \\(a greedy baseline per prompt\\) is not supported outside colocate_async",
    ):
        check_async_trainer(_build(*ASYNC), types.SimpleNamespace(baseline=True), 10)
    with pytest.raises(ValueError, match="num_warmup_batches=1 is not smaller than the run's 1 steps"):
        check_async_trainer(cfg, types.SimpleNamespace(baseline=False), 1)
    check_async_trainer(cfg, types.SimpleNamespace(baseline=False), 2)
    assert async_settings(cfg.trainer.v1).lookahead == 1
    forced_cfg = _build(*ASYNC)
    with pytest.warns(UserWarning, match="forces algorithm.rollout_correction.bypass_mode=True"):
        forced = async_run_config(forced_cfg)
    assert forced.algorithm.rollout_correction.bypass_mode and forced.algorithm.rollout_correction.rollout_is is None
    assert async_run_config(cfg) is cfg  # colocate_async keeps decoupled mode
