"""A verl 0.9.1 config file and command line, without training: the key table, Hydra's override
syntax, verl-only keys kept and warned, and the bad inputs (exit 2 with the nearest key)."""

from __future__ import annotations

import warnings

import pytest

from megatron_rl.config import RunConfig, compose
from megatron_rl.config.compat import InertKeyWarning
from megatron_rl.config.verl_keys import VERL_CONFIG_DIR, verl_catalogue
from megatron_rl.main_ppo import main, parse_args

VERL = str(VERL_CONFIG_DIR / "ppo_megatron_trainer.yaml")
SET = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]


def test_generated_config_builds_and_its_key_table_refuses_nothing():
    from megatron_rl.config.loader import key_report
    from megatron_rl.config.verl import key_table

    report, refused = key_report(VERL, SET)
    lines = report.splitlines()
    assert not refused and lines[3].split() == ["refused", "0"]
    acted, inert = int(lines[1].split()[-1]), int(lines[2].split()[4])
    # (270 acted and 604 inert at the LoRA wiring, issue 29: the actor's model.lora* keys act)
    assert acted >= 265 and inert > 590 and acted + inert <= len(verl_catalogue())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = RunConfig.from_dict(compose(VERL, SET))
    # verl-only keys are the loader's: in the key table as inert, not kept on the built config (no effect);
    # only values away from verl's default warn.
    table = key_table(compose(VERL, SET), RunConfig)
    assert {"actor_rollout_ref.actor.use_torch_compile", "trainer.use_v1"} <= set(table.inert)
    assert not hasattr(cfg.actor_rollout_ref.actor, "use_torch_compile") and not hasattr(cfg.trainer, "use_v1")
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "colocated"  # verl's "naive"
    texts = [str(w.message) for w in caught if issubclass(w.category, InertKeyWarning)]
    assert all(not t.startswith(("actor_rollout_ref.actor.use_torch_compile", "trainer.use_v1")) for t in texts)


def test_hydra_override_syntax():
    data = compose(
        VERL,
        [
            *SET,
            "++trainer.nnodes=2",
            "+trainer.sft_warmup_steps=3",
            "~trainer.v1",
            "trainer.resume_from_path=null",
            "actor_rollout_ref.actor.ppo_micro_batch_size=8",
        ],
    )
    assert data["trainer"]["nnodes"] == 2 and data["trainer"]["sft_warmup_steps"] == 3
    assert "v1" not in data["trainer"] and data["trainer"]["resume_from_path"] is None
    with pytest.raises(ValueError, match=r"cannot add 'trainer.nnodes' .* already has it"):
        compose(VERL, ["+trainer.nnodes=2"])
    with pytest.raises(ValueError, match="both .*ppo_micro_batch_size=8 and .*ppo_micro_batch_size_per_gpu=2"):
        RunConfig.from_dict(data)
    data = compose(
        VERL,
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.actor.ppo_micro_batch_size=8",
            "trainer.n_gpus_per_node=4",
        ],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = RunConfig.from_dict(data)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2  # verl's 8 // dp=4


def test_command_line_parsing():
    assert parse_args(["--config-path=config", "--config-name", "ppo_megatron_trainer.yaml", "a.b=1", "~c"]) == (
        "config",
        "ppo_megatron_trainer.yaml",
        ["a.b=1", "~c"],
    )
    assert parse_args(["-cn", "x"])[1] == "x" and parse_args([])[1] == "ppo_trainer"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [*SET, "actor_rollout_ref.actor.clip_ratoi=0.3"],
            "refused: actor_rollout_ref.actor.clip_ratoi  (nearest valid key: actor_rollout_ref.actor.clip_ratio)",
        ),
        ([*SET, "~trainer.no_such_key"], "cannot delete 'trainer.no_such_key'"),
        (
            [*SET, "algorithm._target_=verl.workers.config.McoreActorConfig"],
            "algorithm._target_='verl.workers.config.McoreActorConfig' names a class that does not fit this section",
        ),
        ([*SET, "model_engine=dp"], "model_engine='dp': only 'megatron' is built here"),
    ],
)
def test_bad_input_exits_2_naming_the_key(argv, message, capsys):
    assert main(["--config-name=ppo_megatron_trainer", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "actor_rollout_ref.actor.strategy=fsdp",
            "actor_rollout_ref.actor.strategy='fsdp' is not built here; training engines built here: ['megatron']",
        ),
        (
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.strategy='fsdp2' is not built here; training engines built here: ['megatron']",
        ),
        (
            "actor_rollout_ref.ref.strategy=fsdp",
            "actor_rollout_ref.ref.strategy='fsdp' is not built here; training engines built here: ['megatron']",
        ),
        (
            "critic.strategy=fsdp2",
            "critic.strategy='fsdp2' is not built here; training engines built here: ['megatron']",
        ),
        (
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.name='sglang' is not built here; rollout engines built here: ['vllm']",
        ),
        (
            "actor_rollout_ref.rollout.name=trtllm",
            "actor_rollout_ref.rollout.name='trtllm' is not built here; rollout engines built here: ['vllm']",
        ),
    ],
)
def test_engines_not_built_are_refused_by_name_with_the_built_ones(override, message):
    """verl's FSDP training engines and its SGLang / TensorRT-LLM rollouts: refused by key, the built ones listed."""
    with warnings.catch_warnings(), pytest.raises(ValueError) as info:
        warnings.simplefilter("ignore")
        RunConfig.from_dict(compose(VERL, [*SET, override]))
    assert str(info.value) == message


def test_unset_rollout_name_is_asked_for(capsys):
    """verl's file leaves rollout.name '???' (a script must choose): asked for, with the built engines."""
    assert main(["--config-name=ppo_megatron_trainer", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "main_ppo: actor_rollout_ref.rollout.name='???' is unset (verl's config leaves it to the script); rollout "
        "engines built here: ['vllm']"
    )


def _moved(old: str, new: str) -> str:
    return f"{old} is an older verl's key: read as {new}"


_RETIRED_WORKER = "verl's switch between its old and new worker classes; one worker implementation is built here"
_RETIRED_LOOP = "verl's switch to its reward loop; rewards are always scored in the rollout phase"
_OVERLONG = (
    "overlong_buffer_cfg.enable",
    "overlong_buffer_cfg.len",
    "overlong_buffer_cfg.penalty_factor",
    "max_resp_len",
)
# (overrides, successor key, its value, a check of the built config where the key acts, the notes)
_LEGACY_CASES = {
    "reward_model.num_workers": (
        ["reward_model.num_workers=4"],
        "reward.num_workers",
        4,
        None,
        [_moved("reward_model.num_workers", "reward.num_workers")],
    ),
    "reward_model.reward_manager": (
        ["reward_model.reward_manager=dapo"],
        "reward.reward_manager.name",
        "dapo",
        None,
        [_moved("reward_model.reward_manager", "reward.reward_manager.name")],
    ),
    "reward_model.reward_loop_source": (
        ["reward_model.reward_loop_source=importlib"],
        "reward.reward_manager.source",
        "importlib",
        None,
        [_moved("reward_model.reward_loop_source", "reward.reward_manager.source")],
    ),
    "reward_model.reward_loop_module_path": (
        ["reward_model.reward_loop_module_path=/tmp/loop.py"],
        "reward.reward_manager.module.path",
        "/tmp/loop.py",
        None,
        [_moved("reward_model.reward_loop_module_path", "reward.reward_manager.module.path")],
    ),
    "reward_model.reward_loop_class_name": (
        ["reward_model.reward_loop_class_name=MyLoop"],
        "reward.reward_manager.module.name",
        "MyLoop",
        None,
        [_moved("reward_model.reward_loop_class_name", "reward.reward_manager.module.name")],
    ),
    "reward_model.enable+model.path": (
        ["reward_model.model.path=/ckpt/rm", "reward_model.enable=true"],
        "reward.reward_model.model_path",
        "/ckpt/rm",
        lambda cfg: (cfg.reward.reward_model.enable, cfg.reward.reward_model.model_path) == (True, "/ckpt/rm"),
        [
            _moved("reward_model.enable", "reward.reward_model.enable"),
            _moved("reward_model.model.path", "reward.reward_model.model_path"),
        ],
    ),
    "reward_model.enable_resource_pool": (
        ["reward_model.enable_resource_pool=true"],
        "reward.reward_model.enable_resource_pool",
        True,
        None,
        [_moved("reward_model.enable_resource_pool", "reward.reward_model.enable_resource_pool")],
    ),
    "reward_model.n_gpus_per_node": (
        ["reward_model.n_gpus_per_node=2"],
        "reward.reward_model.n_gpus_per_node",
        2,
        None,
        [_moved("reward_model.n_gpus_per_node", "reward.reward_model.n_gpus_per_node")],
    ),
    "reward_model.nnodes": (
        ["reward_model.nnodes=1"],
        "reward.reward_model.nnodes",
        1,
        None,
        [_moved("reward_model.nnodes", "reward.reward_model.nnodes")],
    ),
    "reward_model.rollout": (
        ["reward_model.rollout.name=vllm"],
        "reward.reward_model.rollout.name",
        "vllm",
        None,
        [_moved("reward_model.rollout.name", "reward.reward_model.rollout.name")],
    ),
    "reward_model.reward_kwargs": (
        [f"+reward_model.reward_kwargs.{k}={v}" for k, v in zip(_OVERLONG, ("True", "64", "1.0", "1024"))],
        "reward.reward_kwargs.overlong_buffer_cfg.len",
        64,
        lambda cfg: (
            (
                cfg.reward.reward_kwargs.overlong_buffer_cfg.enable,
                cfg.reward.reward_kwargs.overlong_buffer_cfg.len,
                cfg.reward.reward_kwargs.overlong_buffer_cfg.penalty_factor,
                cfg.reward.reward_kwargs.max_resp_len,
            )
            == (True, 64, 1.0, 1024)
        ),
        [_moved(f"reward_model.reward_kwargs.{k}", f"reward.reward_kwargs.{k}") for k in _OVERLONG],
    ),
    "custom_reward_function": (
        ["custom_reward_function.path=/tmp/score.py"],
        "reward.custom_reward_function.path",
        "/tmp/score.py",
        lambda cfg: cfg.reward.custom_reward_function.path == "/tmp/score.py",
        [_moved("custom_reward_function.path", "reward.custom_reward_function.path")],
    ),
    "sandbox_fusion": (
        ["sandbox_fusion.url=http://sandbox:8080"],
        "reward.sandbox_fusion.url",
        "http://sandbox:8080",
        None,
        [_moved("sandbox_fusion.url", "reward.sandbox_fusion.url")],
    ),
    "actor.router_replay": (
        ["actor_rollout_ref.actor.router_replay.mode=R2"],
        "actor_rollout_ref.actor.megatron.router_replay.mode",
        "R2",
        lambda cfg: cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R2",
        [_moved("actor_rollout_ref.actor.router_replay.mode", "actor_rollout_ref.actor.megatron.router_replay.mode")],
    ),
    "trainer.use_legacy_worker_impl": (
        ["+trainer.use_legacy_worker_impl=auto"],
        None,
        None,
        None,
        [f"trainer.use_legacy_worker_impl='auto' (an older verl's key) has no effect here: {_RETIRED_WORKER}"],
    ),
    "reward_model.use_reward_loop": (
        ["+reward_model.use_reward_loop=true"],
        None,
        None,
        None,
        [f"reward_model.use_reward_loop=True (an older verl's key) has no effect here: {_RETIRED_LOOP}"],
    ),
}


@pytest.mark.parametrize(
    "overrides, successor, value, built, notes", list(_LEGACY_CASES.values()), ids=list(_LEGACY_CASES)
)
def test_older_verl_key_is_read_as_its_successor_with_a_note(overrides, successor, value, built, notes):
    """Each key of an older verl is moved to its current key (or, retired, dropped with the reason), with one
    LegacyKeyWarning line per key; the config then builds, acting on the value where the key is built."""
    from omegaconf import OmegaConf

    from megatron_rl.config.verl_keys import LegacyKeyWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = compose(VERL, [*SET, *overrides])
        cfg = RunConfig.from_dict(data)
    assert sorted(str(w.message) for w in caught if w.category is LegacyKeyWarning) == sorted(notes)
    for item in overrides:
        old = item.lstrip("+").split("=")[0]
        assert OmegaConf.select(OmegaConf.create(data), old, default=None) is None, old  # moved or dropped
    if successor is not None:
        assert OmegaConf.select(OmegaConf.create(data), successor) == value
    if built is not None:
        assert built(cfg)


def test_every_older_verl_key_has_a_case():
    from megatron_rl.config.verl_keys import LEGACY_KEYS, RETIRED_KEYS

    set_keys = {item.lstrip("+").split("=")[0] for case in _LEGACY_CASES.values() for item in case[0]}
    for old, _ in LEGACY_KEYS:
        assert any(k == old or k.startswith(old + ".") for k in set_keys), old
    assert set(RETIRED_KEYS) <= set_keys


def test_plan_and_main_ppo_share_the_engine_choice(capsys):
    """verl's model_engine=megatron is dropped and any other engine refused, by plan as by main_ppo
    (one definition: config.loader.drop_engine_choice)."""
    from megatron_rl.cli import main as cli_main
    from megatron_rl.config.loader import drop_engine_choice

    assert drop_engine_choice(["model_engine=megatron", "+a.b=1"]) == ["+a.b=1"]
    assert cli_main(["plan", "--config-name=ppo_megatron_trainer", *SET, "model_engine=fsdp"]) == 2
    assert capsys.readouterr().err.strip() == "megatron-rl plan: model_engine='fsdp': only 'megatron' is built here"
