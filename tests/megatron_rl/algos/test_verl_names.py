"""verl 0.9.1's algorithm API by verl's names: every listed name called with verl's keyword arguments
equals what verl itself returned for the same inputs (``data/verl_reference.pt``, written by
``data/make_verl_reference.py`` in a scratch venv; the project never imports verl)."""

from __future__ import annotations

import dataclasses
import math
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import megatron_rl.algos as algos
from megatron_rl.algos import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
    AdvantageEstimator,
    compute_is_metrics,
    compute_policy_loss,
    compute_rewards,
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_and_rejection_mask,
    compute_rs_metrics,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    group_mean_std,
    register_adv_est,
    register_policy_loss,
)
from megatron_rl.config import ActorConfig, AlgoConfig, RolloutCorrectionConfig, omega_conf_to_dataclass
from megatron_rl.config.algorithm import ROLLOUT_CORRECTION_PRESETS
from megatron_rl.data.batch import Batch, DataProto
from tests.numerics import assert_close_within, rounding_bound

REF = torch.load(Path(__file__).parent / "data" / "verl_reference.pt", weights_only=False)
INP = REF["inputs"]
_TOKENS, _SEQ_LEN = INP["mask"].numel(), INP["mask"].shape[-1]
# Ours and verl's are two float32 paths over the same [6, 7] inputs. A weight exp(log-ratio) errs relatively
# by the log-ratio's error: for a sequence's exp(sum), eps * seq_len * sum |log-ratio| over its row.
_SEQ_TERMS = math.ceil(_SEQ_LEN * float(((INP["old"] - INP["roll"]).abs() * INP["mask"]).sum(-1).max()))
# The reductions on a metric's path: the batch's tokens, the subtraction and exp, a sequence's exp(sum).
METRIC_TERMS = _TOKENS + 2 + _SEQ_TERMS


def both_paths(num_terms: int, scale: float) -> float:
    """Two float32 computations of one value, each within rounding_bound of the exact one."""
    return 2 * rounding_bound(num_terms, scale)


def _strip(value):
    """verl's dataclasses carry a ``_target_`` field (its Hydra class path); ours drop it."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "_target_"}
    return value


def close_metrics(ours: dict, theirs: dict, num_terms: int = METRIC_TERMS) -> None:
    """Each metric within both_paths(num_terms, max(1, |value|)): relative above 1, absolute below."""
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, abs=both_paths(num_terms, max(1.0, abs(value)))), key


def test_registries_getters_and_enum_are_verls():
    assert sorted(ADV_ESTIMATOR_REGISTRY) == REF["adv_estimator_names"]
    assert sorted(POLICY_LOSS_REGISTRY) == REF["policy_loss_names"]
    assert {m.name: m.value for m in AdvantageEstimator} == REF["advantage_estimator_enum"]
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is ADV_ESTIMATOR_REGISTRY["grpo"]
    assert get_policy_loss_fn("vanilla") is POLICY_LOSS_REGISTRY["vanilla"]
    with pytest.raises(ValueError):  # verl's error type for an unknown name
        get_adv_estimator_fn("nope")
    with pytest.raises(ValueError):
        get_policy_loss_fn("nope")


def my_est(token_level_rewards, response_mask, **kwargs):
    """A user's estimator (module level, as in a user's script)."""
    return token_level_rewards * 2, token_level_rewards


def my_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """A user's policy loss."""
    return (-(log_prob * advantages) * response_mask).sum(), {}


def test_user_registration_by_decorator_and_by_assignment():
    try:
        register_adv_est("my_est")(my_est)
        POLICY_LOSS_REGISTRY["my_loss"] = my_loss  # verl's registries are dicts
        assert get_adv_estimator_fn("my_est") is my_est and get_policy_loss_fn("my_loss") is my_loss
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("my_loss")(lambda *a: None)
        # The snapshot that travels with the actor's config re-registers them where it is unpickled.
        snapshot = algos.algo_registry.plugins()
        assert sorted(snapshot.estimators) == ["my_est"] and sorted(snapshot.losses) == ["my_loss"]
        del POLICY_LOSS_REGISTRY["my_loss"], ADV_ESTIMATOR_REGISTRY["my_est"]
        restored = pickle.loads(pickle.dumps(snapshot))
        assert get_policy_loss_fn("my_loss") is my_loss and get_adv_estimator_fn("my_est") is my_est and restored
    finally:
        for reg, name in ((POLICY_LOSS_REGISTRY, "my_loss"), (ADV_ESTIMATOR_REGISTRY, "my_est")):
            if name in reg:
                del reg[name]


def test_compute_policy_loss_rewards_and_group_mean_std_equal_verl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ours = compute_policy_loss(
            old_log_prob=INP["old"],
            log_prob=INP["new"],
            advantages=INP["adv"],
            response_mask=INP["mask"],
            cliprange=0.2,
            cliprange_low=0.1,
            cliprange_high=0.28,
            clip_ratio_c=3.0,
            loss_agg_mode="seq-mean-token-mean",
        )
    # a token's term is A * ratio, at most clip_ratio_c * |A|; exp(new - old) errs relatively by eps * |new - old|;
    # then the token and sequence means over the batch's tokens
    log_ratio_terms = math.ceil(float((INP["new"] - INP["old"]).abs().max())) + 2
    bound = both_paths(_TOKENS + log_ratio_terms, 3.0 * float(INP["adv"].abs().max()))
    for name, a, b in zip(("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"), ours, REF["compute_policy_loss"]):
        assert a.dtype == b.dtype, name
        assert_close_within(a, b, bound, name)
    torch.testing.assert_close(compute_rewards(INP["scores"], INP["old"], INP["ref"], 0.05), REF["compute_rewards"])
    # a row's sum over seq_len scores, then a group's mean and std over at most its 6 rows (std moves by at
    # most the deviations' error), on values up to the largest row sum of |scores|
    bound = both_paths(_SEQ_LEN + 2 * 6 + 2, float(INP["scores"].abs().sum(-1).max()))
    for name, a, b in zip(
        ("mean", "std", "count"), group_mean_std(INP["scores"].sum(-1), INP["gidx"], eps=1e-6), REF["group_mean_std"]
    ):
        assert a.dtype == b.dtype, name
        assert_close_within(a, b, bound, name)


def test_rollout_rs_option_sets_and_metric_functions_equal_verl():
    assert sorted(SUPPORTED_ROLLOUT_RS_OPTIONS) == REF["supported_rs"] and isinstance(SUPPORTED_ROLLOUT_RS_OPTIONS, set)
    assert sorted(TOKEN_LEVEL_ROLLOUT_RS_OPTIONS) == REF["token_level_rs"]
    mask, log_ratio = INP["mask"], INP["old"] - INP["roll"]
    raw_tok = torch.exp(log_ratio.clamp(-20, 20)) * mask
    close_metrics(
        compute_is_metrics(raw_tok.clamp(max=1.5), raw_tok, log_ratio, mask, "token", 1.5, None),
        REF["is_metrics_token"],
    )
    seq_lr = (log_ratio * mask).sum(-1, keepdim=True)
    raw_seq = torch.exp(seq_lr.clamp(-20, 20)).expand_as(log_ratio) * mask
    icepop = torch.where((raw_seq >= 0.5) & (raw_seq <= 2.0), raw_seq, torch.zeros_like(raw_seq))
    close_metrics(compute_is_metrics(icepop, raw_seq, seq_lr, mask, "sequence", 2.0, 0.5), REF["is_metrics_sequence"])
    k1 = -log_ratio.clamp(-20, 20)
    seq_valid = mask.sum(-1) > 0
    close_metrics(
        compute_rs_metrics(
            "token_k1",
            k1,
            mask,
            seq_valid,
            level="token",
            per_sequence_values=None,
            rollout_rs_threshold=0.3,
            rollout_rs_threshold_lower=-0.3,
            apply_lower_threshold=True,
        ),
        REF["rs_metrics_token_k1"],
    )
    k3 = torch.exp(log_ratio.clamp(-20, 20)) - 1 - log_ratio.clamp(-20, 20)
    seq_k3 = (k3 * mask).sum(-1) / mask.sum(-1)
    close_metrics(
        compute_rs_metrics(
            "seq_mean_k3",
            seq_k3.unsqueeze(-1).expand_as(mask),
            mask,
            seq_valid,
            level="sequence",
            per_sequence_values=seq_k3,
            rollout_rs_threshold=0.2,
            rollout_rs_threshold_lower=0.0,
            apply_lower_threshold=False,
        ),
        REF["rs_metrics_seq_mean_k3"],
    )


@pytest.mark.parametrize("preset", sorted(REF["rollout_correction"]))
def test_rollout_correction_returns_a_dataproto_first_as_verl(preset):
    theirs = REF["rollout_correction"][preset]
    cfg = getattr(RolloutCorrectionConfig, preset)()
    w, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=INP["old"],
        rollout_log_prob=INP["roll"],
        response_mask=INP["mask"],
        rollout_is=cfg.rollout_is,
        rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize,
        rollout_rs=cfg.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold,
    )
    assert (type(w).__name__ if w is not None else None) == ("Batch" if theirs["weights_type"] else None)
    assert isinstance(w, DataProto) or w is None
    if w is not None:
        weights = w.batch["rollout_is_weights"]
        assert weights.dtype == theirs["weights"].dtype
        assert_close_within(
            weights,
            theirs["weights"],
            both_paths(METRIC_TERMS, float(theirs["weights"].abs().max())),
            "rollout_is_weights",
        )
    torch.testing.assert_close(mask, theirs["mask"])
    close_metrics(metrics, theirs["metrics"])
    # verl's add_to_batch on a DataProto: union of the weights, the rejection mask in place.
    batch = Batch({"old_log_probs": INP["old"], "rollout_log_probs": INP["roll"], "response_mask": INP["mask"]})
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, cfg)
    torch.testing.assert_close(batch.batch["response_mask"], theirs["mask"])
    assert ("rollout_is_weights" in batch.batch.keys()) == (w is not None)


def test_all_presets_equal_verls():
    ours = {name: dataclasses.asdict(getattr(RolloutCorrectionConfig, name)()) for name in ROLLOUT_CORRECTION_PRESETS}
    verls = {k: _strip(v) for k, v in REF["presets"].items() if "(" not in k}
    assert len(ours) == len(verls) == 19  # 18 named presets and disabled()
    assert ours == verls
    assert dataclasses.asdict(RolloutCorrectionConfig.decoupled_geo_rs_seq_tis(rs_threshold=1.001)) == _strip(
        REF["presets"]["decoupled_geo_rs_seq_tis(rs_threshold=1.001)"]
    )
    assert dataclasses.asdict(
        RolloutCorrectionConfig.decoupled_token_icepop(threshold=3.0, threshold_lower=0.25)
    ) == _strip(REF["presets"]["decoupled_token_icepop(threshold=3.0, threshold_lower=0.25)"])


def test_config_dataclasses_from_verls_own_yaml_sections():
    from omegaconf import OmegaConf

    from megatron_rl.config.verl_keys import VERL_CONFIG_DIR

    yaml = OmegaConf.load(VERL_CONFIG_DIR / "ppo_megatron_trainer.yaml")
    algo = omega_conf_to_dataclass(yaml.algorithm)  # by its _target_
    assert isinstance(algo, AlgoConfig)
    for key, value in REF["algo_from_yaml"].items():
        got = getattr(algo, key)
        assert (dataclasses.asdict(got) if dataclasses.is_dataclass(got) else got) == _strip(value), key
    algo2 = omega_conf_to_dataclass(
        {"_target_": "verl.trainer.config.AlgoConfig", "gamma": 0.99, "adv_estimator": "grpo"}, AlgoConfig
    )
    for key in ("gamma", "adv_estimator", "lam", "norm_adv_by_std_in_grpo"):
        assert getattr(algo2, key) == REF["algo_from_dict"][key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actor = omega_conf_to_dataclass(
            OmegaConf.merge(yaml.actor_rollout_ref.actor, {"ppo_micro_batch_size_per_gpu": 2})
        )
    assert type(actor).__name__ == "ActorConfig" and actor.ppo_micro_batch_size_per_gpu == 2
    assert actor.use_dynamic_bsz is False and actor.megatron.tensor_model_parallel_size == 1


def test_verls_class_names_take_verls_keyword_arguments_and_ours_our_fields_only():
    from megatron_rl.config.verl import McoreActorConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = McoreActorConfig(
            strategy="megatron", ppo_micro_batch_size=2, ppo_mini_batch_size=4, use_torch_compile=False, rollout_n=2
        )
    assert isinstance(cfg, ActorConfig) and cfg.ppo_micro_batch_size_per_gpu == 2  # verl's global size, one rank
    assert [str(w.message).split("=")[0] for w in caught] == ["actor_rollout_ref.actor.use_torch_compile"]
    assert not hasattr(cfg, "use_torch_compile")  # no effect, not kept
    with pytest.raises(ValueError, match=r"actor.strategy='fsdp' is not built here; training engines built here"):
        McoreActorConfig(strategy="fsdp")
    with pytest.raises(TypeError, match="unexpected keyword argument 'clip_ratoi'; did you mean 'clip_ratio'"):
        McoreActorConfig(clip_ratoi=0.3)
    with pytest.raises(ValueError, match="remove ppo_micro_batch_size"):
        McoreActorConfig(ppo_micro_batch_size=2, ppo_micro_batch_size_per_gpu=2)
    with pytest.raises(ValueError, match=r"_target_='verl.trainer.config.AlgoConfig' names a class that does not fit"):
        omega_conf_to_dataclass({"_target_": "verl.trainer.config.AlgoConfig"}, ActorConfig)
    # Our own dataclasses are not translated: verl's keys are the edge's business (megatron_rl.config.verl).
    with pytest.raises(TypeError, match="ppo_micro_batch_size"):
        ActorConfig(ppo_micro_batch_size=2)
    with pytest.raises(ValueError, match=r"unknown config key '_target_'"):
        ActorConfig.from_dict({"_target_": "verl.workers.config.McoreActorConfig"})
