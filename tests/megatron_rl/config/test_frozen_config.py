"""A built run config is immutable: assigning to any field of any of its sections raises, naming the
field; derived values come back as changed copies (``with_values`` / ``replace``), never written back."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from megatron_rl.config import RunConfig
from megatron_rl.config.base_config import BaseConfig, FrozenConfigError

RUN = {"data": {"task": "toy_copy"}, "actor_rollout_ref": {"model": {"path": "/models/tiny"}}}


def _sections(config: BaseConfig, path: str = ""):
    yield path, config
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, BaseConfig):
            yield from _sections(value, f"{path}.{f.name}" if path else f.name)


def test_every_field_of_every_section_refuses_assignment_naming_it():
    config = RunConfig.from_dict(RUN, warn=False)
    checked = 0
    for path, section in _sections(config):
        assert section.frozen, path
        for f in dataclasses.fields(section):
            with pytest.raises(FrozenConfigError) as err:
                setattr(section, f.name, getattr(section, f.name))
            where = f"{path}.{f.name}" if path else f"RunConfig.{f.name}"
            assert str(err.value).startswith(f"cannot assign {where}="), str(err.value)
            checked += 1
    assert checked > 400  # every leaf and section field of the run's tree
    assert pickle.loads(pickle.dumps(config)).trainer.frozen  # a worker's copy is as immutable


def test_with_values_derives_a_frozen_copy_and_leaves_the_built_one_alone():
    config = RunConfig.from_dict(RUN, warn=False)
    derived = config.with_values({"trainer.default_local_dir": "/runs/a", "actor_rollout_ref.rollout.top_k": 4})
    assert (derived.trainer.default_local_dir, derived.actor_rollout_ref.rollout.top_k) == ("/runs/a", 4)
    assert config.trainer.default_local_dir != "/runs/a" and config.actor_rollout_ref.rollout.top_k != 4
    assert derived.frozen and derived.trainer.frozen and derived.actor_rollout_ref.rollout.frozen
    assert derived.data is config.data  # untouched sections are shared, not copied
    with pytest.raises(FrozenConfigError, match=r"^cannot assign actor_rollout_ref\.rollout\.top_k=8"):
        derived.actor_rollout_ref.rollout.top_k = 8  # the copy keeps its place in the tree
    with pytest.raises(KeyError, match=r"'trainer\.no_such_key': TrainerConfig has no field 'no_such_key'"):
        config.with_values({"trainer.no_such_key": 1})
    # the copy is validated as a built config is: a derived key does not follow its changed source
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.rollout_n=1 disagrees with .*rollout\.n=4"):
        config.with_values({"actor_rollout_ref.rollout.n": 4})


def test_a_section_built_on_its_own_stays_mutable_until_it_is_part_of_a_run():
    from megatron_rl.config.trainer import TrainerConfig

    section = TrainerConfig(save_freq=3)
    section.save_freq = 4  # not built into a run: tests and builders may still fill it
    assert not section.frozen and not section.replace(save_freq=5).frozen


def _user_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kw):
    return (-(log_prob * advantages) * response_mask).sum(), {}


def test_the_drivers_own_losses_ride_a_derived_copy_to_the_workers():
    from megatron_rl.algos import POLICY_LOSS_REGISTRY
    from megatron_rl.algos.needs import resolve_run, with_plugins

    config = RunConfig.from_dict(RUN, warn=False)
    resolve_run(config)  # checks only: the built config is not written to
    assert with_plugins(config) is config  # no user entries: nothing to carry
    POLICY_LOSS_REGISTRY["frozen_test_loss"] = _user_loss
    try:
        carried = with_plugins(config)
        assert sorted(carried.actor_rollout_ref.actor.policy_loss.plugins.losses) == ["frozen_test_loss"]
        assert config.actor_rollout_ref.actor.policy_loss.plugins is None and carried.frozen
    finally:
        del POLICY_LOSS_REGISTRY["frozen_test_loss"]
