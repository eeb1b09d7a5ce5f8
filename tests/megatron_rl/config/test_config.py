"""Typed configs: verl keys, DictConfig round trip, validation errors naming the field."""

import pytest
from omegaconf import OmegaConf

from megatron_rl.algos.utils import cfg_get
from megatron_rl.config import ActorConfig, AlgoConfig, KLControlConfig, RolloutCorrectionConfig


def test_defaults_match_verl():
    a = ActorConfig()
    assert (a.clip_ratio, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == (0.2, 0.2, 0.2, 3.0)
    assert a.loss_agg_mode == "token-mean" and a.policy_loss.loss_mode == "vanilla"
    assert (a.kl_loss_type, a.kl_loss_coef) == ("low_var_kl", 0.001)
    g = AlgoConfig()
    assert (g.gamma, g.lam, g.adv_estimator, g.norm_adv_by_std_in_grpo) == (1.0, 1.0, "gae", True)
    assert (g.kl_ctrl.type, g.kl_ctrl.kl_coef, g.kl_ctrl.horizon, g.kl_ctrl.target_kl) == ("fixed", 0.001, 10000, 0.1)


def test_from_dictconfig_nested():
    cfg = OmegaConf.create(
        {
            "adv_estimator": "grpo",
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.01},
            "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
        }
    )
    algo = AlgoConfig.from_dict(cfg)
    assert isinstance(algo.kl_ctrl, KLControlConfig) and algo.kl_ctrl.type == "adaptive"
    assert isinstance(algo.rollout_correction, RolloutCorrectionConfig)
    assert algo.rollout_correction.rollout_is_threshold == "0.5_5.0"
    assert algo.get("adv_estimator") == "grpo" and algo["gamma"] == 1.0 and "lam" in algo


def test_unknown_nested_key_names_the_path():
    with pytest.raises(ValueError, match=r"unknown config key 'policy_loss.loss_mod'; allowed keys: \[.*'loss_mode'"):
        ActorConfig.from_dict({"policy_loss": {"loss_mod": "gspo"}})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clip_ratio_c": 1.0}, r"actor.clip_ratio_c=1.0 must be > 1.0"),
        ({"loss_agg_mode": "mean"}, r"actor.loss_agg_mode='mean' is not allowed; choose one of \['token-mean'"),
        ({"kl_loss_type": "k9"}, r"actor.kl_loss_type='k9' is not allowed; choose one of \['kl', 'k1'"),
    ],
)
def test_actor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ActorConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gamma": 1.5}, r"algorithm.gamma=1.5 is out of range; allowed: \[0.0, 1.0\]"),
        ({"kl_penalty": "full+"}, r"algorithm.kl_penalty='full\+' is not allowed"),
        ({"gdpo_reward_keys": ["a", "b"], "gdpo_reward_weights": [1.0]}, r"gdpo_reward_weights has 1 entries"),
    ],
)
def test_algo_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**kwargs)


def test_straight_through_kl_names_accepted():
    assert AlgoConfig(kl_penalty="low_var_kl+").kl_penalty == "low_var_kl+"


def test_kl_ctrl_and_rollout_correction_validation():
    with pytest.raises(ValueError, match=r"kl_ctrl.type='pid' is not allowed; choose one of \['fixed', 'adaptive'\]"):
        KLControlConfig(type="pid")
    with pytest.raises(ValueError, match=r"rollout_correction.rollout_is='seq' is not allowed"):
        RolloutCorrectionConfig(rollout_is="seq")


def test_cfg_get_reads_both_forms():
    typed = ActorConfig()
    dc = OmegaConf.create({"policy_loss": {"dro_beta": None, "loss_mode": "gspo"}, "clip_ratio": 0.3})
    assert cfg_get(typed, "policy_loss.loss_mode") == "vanilla"
    assert cfg_get(dc, "policy_loss.loss_mode") == "gspo"
    assert cfg_get(dc, "policy_loss.dro_beta", 7) == 7
    assert cfg_get(dc, "missing.deeper", "d") == "d"
    assert cfg_get(None, "x", 1) == 1
