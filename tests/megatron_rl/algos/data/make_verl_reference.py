"""Writes verl_reference.pt: what verl 0.9.1 itself returns for the names megatron_rl.algos copies.

Run once in a scratch venv with verl (the project never depends on it)::

    python -m venv /tmp/verlvenv && /tmp/verlvenv/bin/pip install torch==2.13.0 numpy omegaconf hydra-core \\
        tensordict transformers ray codetiming orjson && /tmp/verlvenv/bin/pip install --no-deps verl==0.9.1
    cd /tmp && /tmp/verlvenv/bin/python <repo>/tests/megatron_rl/algos/data/make_verl_reference.py

Inputs are drawn here with a fixed seed and stored beside verl's outputs.
"""

import dataclasses
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf

import verl.trainer.ppo.core_algos as ca
import verl.trainer.ppo.rollout_corr_helper as rc
from verl.trainer.config import AlgoConfig, RolloutCorrectionConfig
from verl.utils import group_mean_std, omega_conf_to_dataclass

torch.manual_seed(0)
bs, t = 6, 7
mask = torch.ones(bs, t)
mask[0, 4:] = 0
mask[3, 2:] = 0
old, new, roll = (-torch.rand(bs, t) * 2 for _ in range(3))
adv = torch.randn(bs, t)
inputs = {
    "mask": mask,
    "old": old,
    "new": new,
    "roll": roll,
    "adv": adv,
    "scores": torch.randn(bs, t),
    "ref": -torch.rand(bs, t) * 2,
    "gidx": torch.tensor([0, 0, 1, 1, 1, 2]),
}
out: dict = {"inputs": inputs}

out["adv_estimator_names"] = sorted(ca.ADV_ESTIMATOR_REGISTRY)
out["policy_loss_names"] = sorted(ca.POLICY_LOSS_REGISTRY)
out["advantage_estimator_enum"] = {m.name: m.value for m in ca.AdvantageEstimator}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out["compute_policy_loss"] = [
        x.detach().clone()
        for x in ca.compute_policy_loss(
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=mask,
            cliprange=0.2,
            cliprange_low=0.1,
            cliprange_high=0.28,
            clip_ratio_c=3.0,
            loss_agg_mode="seq-mean-token-mean",
        )
    ]
out["compute_rewards"] = ca.compute_rewards(inputs["scores"], old, inputs["ref"], 0.05)
out["group_mean_std"] = group_mean_std(inputs["scores"].sum(-1), inputs["gidx"], eps=1e-6, device="cpu")
out["supported_rs"] = sorted(rc.SUPPORTED_ROLLOUT_RS_OPTIONS)
out["token_level_rs"] = sorted(rc.TOKEN_LEVEL_ROLLOUT_RS_OPTIONS)

log_ratio = old - roll
raw_tok = torch.exp(log_ratio.clamp(-20, 20)) * mask
out["is_metrics_token"] = rc.compute_is_metrics(raw_tok.clamp(max=1.5), raw_tok, log_ratio, mask, "token", 1.5, None)
seq_lr = (log_ratio * mask).sum(-1, keepdim=True)
raw_seq = torch.exp(seq_lr.clamp(-20, 20)).expand_as(log_ratio) * mask
icepop = torch.where((raw_seq >= 0.5) & (raw_seq <= 2.0), raw_seq, torch.zeros_like(raw_seq))
out["is_metrics_sequence"] = rc.compute_is_metrics(icepop, raw_seq, seq_lr, mask, "sequence", 2.0, 0.5)
k1 = -log_ratio.clamp(-20, 20)
seq_valid = mask.sum(-1) > 0
out["rs_metrics_token_k1"] = rc.compute_rs_metrics(
    "token_k1",
    k1,
    mask,
    seq_valid,
    level="token",
    per_sequence_values=None,
    rollout_rs_threshold=0.3,
    rollout_rs_threshold_lower=-0.3,
    apply_lower_threshold=True,
)
k3 = torch.exp(log_ratio.clamp(-20, 20)) - 1 - log_ratio.clamp(-20, 20)
seq_k3 = (k3 * mask).sum(-1) / mask.sum(-1)
out["rs_metrics_seq_mean_k3"] = rc.compute_rs_metrics(
    "seq_mean_k3",
    seq_k3.unsqueeze(-1).expand_as(mask),
    mask,
    seq_valid,
    level="sequence",
    per_sequence_values=seq_k3,
    rollout_rs_threshold=0.2,
    rollout_rs_threshold_lower=0.0,
    apply_lower_threshold=False,
)

calls = {}
for name in ("decoupled_token_is", "decoupled_seq_is_rs", "decoupled_geo_rs_seq_tis", "bypass_pg_token_icepop"):
    preset = getattr(RolloutCorrectionConfig, name)()
    w, m, met = rc.compute_rollout_correction_and_rejection_mask(
        old,
        roll,
        mask,
        rollout_is=preset.rollout_is,
        rollout_is_threshold=preset.rollout_is_threshold,
        rollout_is_batch_normalize=preset.rollout_is_batch_normalize,
        rollout_rs=preset.rollout_rs,
        rollout_rs_threshold=preset.rollout_rs_threshold,
    )
    calls[name] = {
        "weights_type": type(w).__name__ if w is not None else None,
        "weights": None if w is None else w.batch["rollout_is_weights"].clone(),
        "mask": m,
        "metrics": met,
    }
out["rollout_correction"] = calls

presets = {}
for name, value in vars(RolloutCorrectionConfig).items():
    if isinstance(value, classmethod):
        presets[name] = dataclasses.asdict(getattr(RolloutCorrectionConfig, name)())
presets["decoupled_geo_rs_seq_tis(rs_threshold=1.001)"] = dataclasses.asdict(
    RolloutCorrectionConfig.decoupled_geo_rs_seq_tis(rs_threshold=1.001)
)
presets["decoupled_token_icepop(threshold=3.0, threshold_lower=0.25)"] = dataclasses.asdict(
    RolloutCorrectionConfig.decoupled_token_icepop(threshold=3.0, threshold_lower=0.25)
)
out["presets"] = presets

yaml = OmegaConf.load(Path(__import__("verl").__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
algo = omega_conf_to_dataclass(yaml.algorithm)
out["algo_from_yaml"] = {k: v for k, v in dataclasses.asdict(algo).items() if k != "_target_"}
algo2 = omega_conf_to_dataclass({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 0.99, "adv_estimator": "grpo"})
out["algo_from_dict"] = {k: v for k, v in dataclasses.asdict(algo2).items() if k != "_target_"}
out["isinstance_algo"] = isinstance(algo, AlgoConfig)

dest = Path(__file__).resolve().parent / "verl_reference.pt"
torch.save(out, dest)
print(f"wrote {dest} ({dest.stat().st_size} bytes)")
