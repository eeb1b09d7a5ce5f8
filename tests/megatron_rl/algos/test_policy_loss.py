"""Policy losses: a hand-computed case and a property per registry entry, plus bad input.

Hand cases build log-probs from probabilities so the ratios are round numbers; the expected
values are written out as arithmetic on those numbers.
"""

import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from megatron_rl.algos import POLICY_LOSSES, get_policy_loss_fn
from megatron_rl.algos.loss_agg import LOSS_AGG_MODES
from megatron_rl.algos.policy_loss_variants import compute_policy_loss_reinforce
from megatron_rl.config import ActorConfig
from tests.numerics import rounding_bound

ALL_LOSSES = [
    "vanilla",
    "gspo",
    "cispo",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dppo_tv",
    "dppo_kl",
    "sapo",
    "gpg",
    "dro",
    "bypass_mode",
]


def actor_dict(policy_loss=None, **overrides):
    """verl's actor keys the losses read (a DictConfig without global_batch_info)."""
    base = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "policy_loss": {
            "loss_mode": "vanilla",
            "clip_cov_ratio": 0.0002,
            "clip_cov_lb": 1.0,
            "clip_cov_ub": 5.0,
            "kl_cov_ratio": 0.0002,
            "ppo_kl_coef": 0.1,
            "dro_beta": None,
            "rollout_correction": {"rollout_is": None, "rollout_is_threshold": 2.0, "loss_type": "ppo_clip"},
        },
    }
    base["policy_loss"].update(policy_loss or {})
    base.update(overrides)
    return base


@pytest.fixture(params=["dictconfig", "typed"])
def make_cfg(request):
    """Build the same actor config as an OmegaConf DictConfig or as our typed ActorConfig."""

    def make(**kwargs):
        data = actor_dict(**kwargs)
        return OmegaConf.create(data) if request.param == "dictconfig" else ActorConfig.from_dict(data)

    return make


def logp(*probs):
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def call(name, old, new, adv, mask=None, mode="token-mean", cfg=None, weights=None):
    """Run loss ``name``; returns (loss, metrics, d loss / d log_prob)."""
    new = new.clone().requires_grad_(True)
    mask = torch.ones_like(adv) if mask is None else mask
    loss, metrics = get_policy_loss_fn(name)(old, new, adv, mask, mode, cfg, weights)
    loss.backward()
    return loss.detach(), metrics, new.grad


def random_batch(seed=0, bs=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(bs, T, generator=g) * 3 - 0.05
    new = (old + 0.4 * torch.randn(bs, T, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(bs, T, generator=g)
    lengths = torch.randint(1, T + 1, (bs,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return old, new, adv, mask


def test_registry_holds_verl_names():
    assert set(ALL_LOSSES) <= set(POLICY_LOSSES)


# ----------------------------------------------------------------------------- vanilla


def test_vanilla_hand_case(make_cfg):
    # ratios 1.5 (A=+1), 0.5 (A=-1), 4.0 (A=-2); clip 0.2, dual clip c=3.
    old = logp(0.2, 0.4, 0.1)
    new = logp(0.3, 0.2, 0.4)
    adv = torch.tensor([[1.0, -1.0, -2.0]])
    loss, m, grad = call("vanilla", old, new, adv, cfg=make_cfg())
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(0.5, 0.8) = 0.8 (clipped);
    # token 3: max(8, 2.4) = 8, dual-clip cap 2*3 = 6.
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 6.0) / 3, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)
    # six float32 logs (up to |ln 0.1|), three differences and the 3-token mean: 9 roundings of values up to ln 10
    assert m["actor/ppo_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 4.0) / 3, abs=rounding_bound(9, math.log(10)))
    assert grad.abs().max().item() == 0.0  # every token is clipped


def test_vanilla_ratio_one_is_minus_mean_advantage(make_cfg):
    old, _, adv, mask = random_batch()
    loss, m, grad = call("vanilla", old, old.clone(), adv, mask, cfg=make_cfg())
    # ratio exp(0) = 1: two float32 orders of the masked mean of -A (signs mix, so not relative): each errs by
    # eps * (tokens + 1) * mean |A|
    magnitude = float((adv.abs() * mask).sum() / mask.sum())
    assert loss.item() == pytest.approx(
        -(adv * mask).sum().item() / mask.sum().item(), abs=2 * rounding_bound(int(mask.sum()) + 1, magnitude)
    )
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0 and m["actor/ppo_kl"] == 0.0
    torch.testing.assert_close(grad, -adv * mask / mask.sum())


def test_vanilla_dual_clip_caps_negative_advantage_loss(make_cfg):
    adv = torch.tensor([[-0.5, -2.0]])
    old = logp(0.001, 0.001)
    new = logp(0.5, 0.9)  # ratios 500 and 900
    loss, m, grad = call("vanilla", old, new, adv, cfg=make_cfg(clip_ratio_c=3.0))
    assert loss.item() == pytest.approx((3.0 * 0.5 + 3.0 * 2.0) / 2, rel=1e-6)
    assert m["actor/pg_clipfrac_lower"] == 1.0
    assert grad.abs().max().item() == 0.0


def test_vanilla_clip_higher(make_cfg):
    adv = torch.ones(1, 3)
    old = logp(0.4, 0.4, 0.4)
    new = logp(0.5, 0.512, 0.52)  # ratios 1.25, 1.28, 1.3
    loss, m, grad = call("vanilla", old, new, adv, cfg=make_cfg(clip_ratio_high=0.28))
    assert loss.item() == pytest.approx(-(1.25 + 1.28 + 1.28) / 3, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    torch.testing.assert_close(grad, torch.tensor([[-1.25 / 3, -1.28 / 3, 0.0]]))
    # With the symmetric 0.2 the 1.25 token is clipped as well.
    _, m_sym, _ = call("vanilla", old, new, adv, cfg=make_cfg())
    assert m_sym["actor/pg_clipfrac"] == 1.0


def test_vanilla_gradient_zero_exactly_on_clipped_tokens(make_cfg):
    old, new, adv, mask = random_batch(1)
    loss, m, grad = call("vanilla", old, new, adv, mask, cfg=make_cfg())
    ratio = torch.exp(new - old)
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    assert 0 < m["actor/pg_clipfrac"] < 1
    # exact: integer counts (exact sums of 0/1) and one float32 division on each side
    assert m["actor/pg_clipfrac"] == ((clipped.float() * mask).sum() / mask.sum()).item()
    assert torch.all(grad[clipped] == 0)
    free = ~clipped & (mask > 0)
    torch.testing.assert_close(grad[free], (-adv * ratio / mask.sum())[free])


def test_vanilla_log_ratio_clamped_at_20(make_cfg):
    old = torch.tensor([[-40.0, -1.0]])
    new = torch.tensor([[-1.0, -40.0]])
    _, m, _ = call("vanilla", old, new, torch.tensor([[1.0, 1.0]]), cfg=make_cfg())
    assert m["actor/ppo_kl"] == pytest.approx(0.0)  # (-20 + 20) / 2, not (-39 + 39) / 2 by luck:
    _, m, _ = call("vanilla", old[:, :1], new[:, :1], torch.tensor([[1.0]]), cfg=make_cfg())
    assert m["actor/ppo_kl"] == pytest.approx(-20.0)


# ----------------------------------------------------------------------------- gspo


def test_gspo_hand_case(make_cfg):
    # seq 1: token ratios 1.44, 1 -> s = 1.2, A = +1, clip_high 0.1 -> -1.1 (clipped)
    # seq 2: token ratios 0.81, 1 -> s = 0.9, A = -1, within [0.8, 1.1] -> 0.9
    old = torch.cat([logp(0.25, 0.5), logp(0.5, 0.5)])
    new = torch.cat([logp(0.36, 0.5), logp(0.405, 0.5)])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, m, grad = call("gspo", old, new, adv, mode="seq-mean-token-mean", cfg=make_cfg(clip_ratio_high=0.1))
    assert loss.item() == pytest.approx((-1.1 + 0.9) / 2, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert m["actor/pg_clipfrac_lower"] == 0.0
    assert m["actor/ppo_kl"] == pytest.approx(-math.log(1.44 * 0.81) / 4, rel=1e-5)
    # token gradient: -A * s / (len * bs) on the unclipped sequence, 0 on the clipped one
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [0.9 / 4, 0.9 / 4]]))


def test_gspo_ratio_is_length_normalised_sequence_ratio(make_cfg):
    old, new, adv, mask = random_batch(2)  # token-level advantages of both signs
    cfg = make_cfg(clip_ratio_low=0.99, clip_ratio_high=100.0)  # nothing clipped
    loss, m, grad = call("gspo", old, new, adv, mask, mode="token-mean", cfg=cfg)
    seq_ratio = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))[:, None]  # [bs, 1]
    num_tokens = mask.sum()
    assert loss.item() == pytest.approx(-(adv * seq_ratio * mask).sum().item() / num_tokens.item(), rel=1e-5)
    # straight-through token form: d/dlogp_t of token t's loss is -A_t s_i, and token t does not
    # move the other tokens' ratios (the plain sequence ratio would give -mean_t'(A_t') s_i)
    torch.testing.assert_close(grad, -adv * seq_ratio * mask / num_tokens)
    assert m["actor/pg_clipfrac"] == 0.0


# ----------------------------------------------------------------------------- cispo


def test_cispo_hand_case(make_cfg):
    old = logp(0.4, 0.4, 0.4)
    new = logp(0.6, 0.2, 0.44)  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, m, grad = call("cispo", old, new, adv, cfg=make_cfg())
    expected = (-1.2 * math.log(0.6) + 0.8 * math.log(0.2) - 1.1 * 2.0 * math.log(0.44)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert m["actor/pg_clipfrac_lower"] == 0.0
    # clipped tokens keep a gradient: -sg[clip(r)] * A / N
    torch.testing.assert_close(grad, torch.tensor([[-1.2 / 3, 0.8 / 3, -2.2 / 3]]))


def test_cispo_every_valid_token_has_gradient(make_cfg):
    old, new, adv, mask = random_batch(3)
    _, m, grad = call("cispo", old, new, adv, mask, cfg=make_cfg())
    ratio = torch.exp(new - old).clamp(0.8, 1.2)
    assert m["actor/pg_clipfrac"] > 0
    torch.testing.assert_close(grad, -ratio * adv * mask / mask.sum())


# ----------------------------------------------------------------------------- clip_cov

# log_prob centred [1, -1, 0, 0], A centred [1.5, -2.5, .5, .5] -> cov [1.5, 2.5, 0, 0]:
# tokens 0 and 1 lie in (lb=1, ub=5) and are the only candidates.
COV_NEW = torch.tensor([[-1.0, -3.0, -2.0, -2.0]])
COV_ADV = torch.tensor([[2.0, -2.0, 1.0, 1.0]])


def test_clip_cov_hand_case_all_candidates_detached(make_cfg):
    cfg = make_cfg(policy_loss={"clip_cov_ratio": 0.5})  # int(0.5 * 4) = 2 tokens
    loss, m, grad = call("clip_cov", COV_NEW.clone(), COV_NEW, COV_ADV, cfg=cfg)
    assert loss.item() == pytest.approx((0 + 0 - 1 - 1) / 4)
    assert m == {"actor/pg_clipfrac": 0.5, "actor/ppo_kl": 0.0}
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.25, -0.25]]))
    # A token PPO already clips is no candidate: ratio 1.5 on token 0 (A=2 -> -2 * 1.2) leaves
    # only token 1 to detach.
    old = COV_NEW - torch.tensor([[math.log(1.5), 0.0, 0.0, 0.0]])
    loss, m, grad = call("clip_cov", old, COV_NEW, COV_ADV, cfg=cfg)
    assert loss.item() == pytest.approx((-2.4 + 0 - 1 - 1) / 4, rel=1e-6)
    assert m["actor/pg_clipfrac"] == 0.25
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.25, -0.25]]))


def test_clip_cov_random_choice_follows_torch_seed(make_cfg):
    cfg = make_cfg(policy_loss={"clip_cov_ratio": 0.25})  # one of the two candidates
    losses = {}
    for seed in range(6):
        torch.manual_seed(seed)
        first = torch.randperm(2)[0].item()  # verl draws exactly this permutation
        torch.manual_seed(seed)
        loss, m, grad = call("clip_cov", COV_NEW.clone(), COV_NEW, COV_ADV, cfg=cfg)
        # detaching token 0 leaves (2 - 1 - 1) / 4 = 0; detaching token 1 leaves (-2 - 1 - 1) / 4 = -1
        assert loss.item() == pytest.approx([0.0, -1.0][first])
        assert grad[0, first].item() == 0.0 and grad[0, 1 - first].item() != 0.0
        assert m["actor/pg_clipfrac"] == 0.25
        losses[seed] = loss.item()
    assert set(losses.values()) == {0.0, -1.0}


def test_clip_cov_without_candidates_is_ppo_clip(make_cfg):
    old, new, adv, mask = random_batch(4)
    adv = adv.abs() + 0.1  # A > 0: vanilla's dual clip is inactive
    cfg = make_cfg(policy_loss={"clip_cov_ratio": 0.5, "clip_cov_lb": 1e6, "clip_cov_ub": 2e6})
    loss, m, grad = call("clip_cov", old, new, adv, mask, cfg=cfg)
    ref_loss, ref_m, ref_grad = call("vanilla", old, new, adv, mask, cfg=cfg)
    assert m["actor/pg_clipfrac"] == 0.0
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


# ----------------------------------------------------------------------------- kl_cov


def test_kl_cov_hand_case(make_cfg):
    # Valid tokens in row-major order: logp -2, -3, -1, -2 with A 1, -2, 2, 1 (padding between).
    # centred logp [0, -1, 1, 0] x centred A [.5, -2.5, 1.5, .5] -> cov [0, 2.5, 1.5, 0]: the top-1
    # is row 1 col 0, whose log-ratio 0.5 adds 0.1 * 0.5.
    new = torch.tensor([[-2.0, 0.0], [-3.0, -1.0], [-2.0, 0.0]])
    adv = torch.tensor([[1.0, 0.0], [-2.0, 2.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    old = new - torch.tensor([[0.0, 0.0], [0.5, 0.0], [0.0, 0.0]])
    cfg = make_cfg(policy_loss={"kl_cov_ratio": 0.25, "ppo_kl_coef": 0.1})
    loss, m, grad = call("kl_cov", old, new, adv, mask, cfg=cfg)
    r = math.exp(0.5)
    assert loss.item() == pytest.approx((-1.0 + (2.0 * r + 0.05) - 2.0 - 1.0) / 4, rel=1e-6)
    assert m == {"actor/ppo_kl": pytest.approx(0.5 / 4)}
    # d/dlogp of 0.1 * |logp - old| is +0.1 on the penalised token
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0], [2.0 * r + 0.1, -2.0], [-1.0, 0.0]]) / 4)


def test_kl_cov_penalty_is_linear_in_coef_and_zero_coef_is_plain_pg(make_cfg):
    old, new, adv, mask = random_batch(5)
    losses = [
        call("kl_cov", old, new, adv, mask, cfg=make_cfg(policy_loss={"kl_cov_ratio": 0.3, "ppo_kl_coef": c}))[0]
        for c in (0.0, 1.0, 2.0)
    ]
    plain = (-(adv * torch.exp(new - old)) * mask).sum() / mask.sum()
    torch.testing.assert_close(losses[0], plain)
    assert (losses[1] - losses[0]).item() > 0
    assert (losses[2] - losses[1]).item() == pytest.approx((losses[1] - losses[0]).item(), rel=1e-4)


# ----------------------------------------------------------------------------- geo_mean


def test_geo_mean_hand_case(make_cfg):
    # Token log-ratios are clipped to [-0.2, 0.2] only in the direction that would raise the objective.
    # seq 1 (A=+1): 0.3, -0.5 -> min(x, clip x) = 0.2, -0.5 -> ratio exp(-0.15)
    # seq 2 (A=-1): -0.3, 0.5 -> max(x, clip x) = -0.2, 0.5 -> ratio exp(0.15)
    old = torch.full((2, 2), -1.0)
    new = old + torch.tensor([[0.3, -0.5], [-0.3, 0.5]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, m, grad = call("geo_mean", old, new, adv, cfg=make_cfg())
    assert loss.item() == pytest.approx((-math.exp(-0.15) + math.exp(0.15)) / 2, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)  # clipped tokens with A > 0
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(0.5)  # clipped tokens with A < 0
    # new = -1 +- 0.3/0.5 rounds once each (values up to 1.5); old - new is then exact (Sterbenz); the
    # masked mean of the 4 differences rounds up to 4 more times on values up to 0.5
    assert m["actor/ppo_kl"] == pytest.approx(0.0, abs=rounding_bound(4, 1.5) + rounding_bound(4, 0.5))
    # only the unclipped-side tokens carry gradient: -A * ratio / (len * bs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(-0.15) / 4], [0.0, math.exp(0.15) / 4]]))


def test_geo_mean_is_geometric_mean_of_ratios_and_weights(make_cfg):
    old, new, _, mask = random_batch(6)
    seq_adv = torch.randn(old.shape[0])
    adv = seq_adv[:, None].expand_as(old).contiguous()
    cfg = make_cfg(clip_ratio_low=100.0, clip_ratio_high=100.0)
    loss, _, _ = call("geo_mean", old, new, adv, mask, cfg=cfg)
    geo_ratio = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))
    assert loss.item() == pytest.approx((-seq_adv * geo_ratio).mean().item(), rel=1e-5)
    # a constant IS weight w enters as its geometric mean, w
    weighted, _, _ = call("geo_mean", old, new, adv, mask, cfg=cfg, weights=torch.full_like(old, 0.5))
    assert weighted.item() == pytest.approx(0.5 * loss.item(), rel=1e-5)


# ----------------------------------------------------------------------------- dppo


def test_dppo_tv_hand_case(make_cfg):
    # p_old = 0.5 everywhere. A>0: p 0.6 (moved +0.1, kept), p 0.8 (+0.3 > 0.2, dropped);
    # A<0: p 0.2 (-0.3, dropped), p 0.4 (-0.1, kept). clip_ratio_c = 1.1 truncates ratio 1.2.
    old = logp(0.5, 0.5, 0.5, 0.5)
    new = logp(0.6, 0.8, 0.2, 0.4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m, grad = call("dppo_tv", old, new, adv, cfg=make_cfg(clip_ratio_c=1.1))
    assert loss.item() == pytest.approx((-1.1 * math.log(0.6) + 0.8 * math.log(0.4)) / 4, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(0.25)  # kept token with ratio > c
    torch.testing.assert_close(grad, torch.tensor([[-1.1, 0.0, 0.0, 0.8]]) / 4)


def test_dppo_tv_gradient_is_truncated_is_policy_gradient(make_cfg):
    old, new, adv, mask = random_batch(7)
    cfg = make_cfg(clip_ratio=1.0, clip_ratio_low=1.0, clip_ratio_high=1.0, clip_ratio_c=20.0)  # TV <= 1 always
    loss, m, grad = call("dppo_tv", old, new, adv, mask, cfg=cfg)
    ratio = torch.exp(new - old)
    assert m["actor/pg_clipfrac"] == 0.0
    torch.testing.assert_close(grad, -adv * ratio * mask / mask.sum())


def test_dppo_kl_hand_case(make_cfg):
    # p_old = 0.5; binary KL for p 0.6 or 0.4 is 0.5 * ln(25/24) = 0.0204 > 0.01, all too far.
    # A>0: p 0.6 (up, the advantage's direction: dropped), p 0.4 (down: kept anyway);
    # A<0: p 0.4 (down, the advantage's direction: dropped), p 0.6 (up: kept anyway).
    old = logp(0.5, 0.5, 0.5, 0.5)
    new = logp(0.6, 0.4, 0.4, 0.6)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    cfg = make_cfg(clip_ratio=0.01, clip_ratio_low=0.01, clip_ratio_high=0.01)
    loss, m, grad = call("dppo_kl", old, new, adv, cfg=cfg)
    assert loss.item() == pytest.approx((-0.8 * math.log(0.4) + 1.2 * math.log(0.6)) / 4, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.8, 0.0, 1.2]]) / 4)
    # a looser bound (> 0.0204) keeps all four tokens
    _, m_loose, _ = call(
        "dppo_kl", old, new, adv, cfg=make_cfg(clip_ratio=0.03, clip_ratio_low=0.03, clip_ratio_high=0.03)
    )
    assert m_loose["actor/pg_clipfrac"] == 0.0


# ----------------------------------------------------------------------------- sapo


def test_sapo_hand_case_always_seq_mean_token_mean(make_cfg):
    # ratio 1: gate = sigmoid(0) * 4 / tau = 2 / tau. seq 1: A=+1 twice (tau_pos 1) -> -2;
    # seq 2: one valid token, A=-1 (tau_neg 1.05) -> 2/1.05.
    old = torch.full((2, 2), -1.0)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for mode in ("token-mean", "seq-mean-token-mean", "token-sum"):
        loss, m, grad = call("sapo", old, old.clone(), adv, mask, mode=mode, cfg=make_cfg())
        # float32 rounds tau = 1.05, 2 / tau and up to 4 sums and divisions on values up to 4 (token-sum)
        assert loss.item() == pytest.approx((-2.0 + 2 / 1.05) / 2, abs=rounding_bound(6, 4.0))
    assert m == {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}
    # at ratio 1 the gate's slope is 1: the gradient of -A * r under seq-mean-token-mean
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25], [0.5, 0.0]]))


def test_sapo_gate_is_smooth_and_bounded(make_cfg):
    adv = torch.tensor([[1.0]])
    old = torch.tensor([[-1.0]])
    values = [call("sapo", old, old + d, adv, cfg=make_cfg())[0].item() for d in (0.0, 0.5, 5.0, 15.0)]
    # -4 sigmoid(r - 1): decreasing towards -4 as the ratio grows, never below
    assert values == sorted(values, reverse=True)
    assert values[-1] == pytest.approx(-4.0, abs=1e-5) and values[-1] >= -4.0


# ----------------------------------------------------------------------------- gpg / dro


def test_gpg_hand_case(make_cfg):
    new = logp(0.5, 0.25)
    adv = torch.tensor([[1.0, 2.0]])
    loss, m, grad = call("gpg", torch.zeros_like(new), new, adv, cfg=make_cfg())
    assert loss.item() == pytest.approx((math.log(2) + 2 * math.log(4)) / 2, rel=1e-6)
    assert m == {}
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -1.0]]))


def test_gpg_ignores_old_log_prob(make_cfg):
    old, new, adv, mask = random_batch(8)
    a = call("gpg", old, new, adv, mask, cfg=make_cfg())[0]
    b = call("gpg", old - 5.0, new, adv, mask, cfg=make_cfg())[0]
    assert a.item() == b.item()


def test_dro_hand_case(make_cfg):
    old = torch.tensor([[-1.5, -2.0]])
    new = torch.tensor([[-1.0, -2.0]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, m, grad = call("dro", old, new, adv, cfg=make_cfg(policy_loss={"dro_beta": 0.5}))
    # -(logp A - beta/2 (logp - old)^2): token 1: -(-1 - 0.25 * 0.25) = 1.0625; token 2: -(2 - 0) = -2
    assert loss.item() == pytest.approx((1.0625 - 2.0) / 2)
    assert m == {"actor/ppo_kl": pytest.approx(-0.25)}
    # gradient -(A - beta (logp - old)) / N
    torch.testing.assert_close(grad, torch.tensor([[-(1.0 - 0.25) / 2, 1.0 / 2]]))


@pytest.mark.parametrize("beta", [None, 0.0, -1.0])
def test_dro_needs_positive_beta(make_cfg, beta):
    with pytest.raises(ValueError, match=re.escape(f"policy_loss.dro_beta={beta!r}")):
        call("dro", COV_NEW, COV_NEW, COV_ADV, cfg=make_cfg(policy_loss={"dro_beta": beta}))


# ----------------------------------------------------------------------------- reinforce / bypass


def test_reinforce_hand_case(make_cfg):
    rollout = logp(0.2, 0.4)
    new = logp(0.6, 0.5)
    adv = torch.tensor([[1.0, 1.0]])
    weights = torch.tensor([[2.0, 1.25]])
    x = new.clone().requires_grad_(True)
    loss, m = compute_policy_loss_reinforce(rollout, x, adv, torch.ones_like(adv), "token-mean", make_cfg(), weights)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 * math.log(0.6) - 1.25 * math.log(0.5)) / 2, rel=1e-6)
    assert m == {"actor/ppo_kl": pytest.approx(-math.log(3.0 * 1.25) / 2, rel=1e-5)}
    torch.testing.assert_close(x.grad, torch.tensor([[-1.0, -0.625]]))


def test_bypass_reinforce_hand_case_token_tis(make_cfg):
    # pi_current / pi_rollout = 3 (truncated to 2) and 1.25.
    rollout = logp(0.2, 0.4)
    new = logp(0.6, 0.5)
    adv = torch.tensor([[1.0, 1.0]])
    cfg = make_cfg(
        policy_loss={
            "rollout_correction": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0}
        }
    )
    loss, m, grad = call("bypass_mode", rollout, new, adv, cfg=cfg, weights=torch.full_like(adv, 100.0))
    assert loss.item() == pytest.approx((-2.0 * math.log(0.6) - 1.25 * math.log(0.5)) / 2, rel=1e-6)
    assert m["actor/ppo_kl"] == pytest.approx(-math.log(3.0 * 1.25) / 2, rel=1e-5)
    assert any(k.startswith("rollout_corr/") for k in m)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -0.625]]))  # weights detached


def test_bypass_ppo_clip_is_vanilla_without_is_weights(make_cfg):
    old, new, adv, mask = random_batch(9)
    cfg = make_cfg(
        policy_loss={
            "rollout_correction": {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": 2.0}
        }
    )
    loss, m, grad = call("bypass_mode", old, new, adv, mask, cfg=cfg, weights=torch.full_like(adv, 3.0))
    ref_loss, ref_m, ref_grad = call("vanilla", old, new, adv, mask, cfg=cfg)
    assert loss.item() == ref_loss.item()
    torch.testing.assert_close(grad, ref_grad)
    assert {k: m[k] for k in ref_m} == ref_m
    assert any(k.startswith("rollout_corr/") for k in m)


def test_bypass_rejection_masks_tokens(make_cfg):
    # token_k2 rejects tokens with 0.5 * log_ratio^2 > 0.1: the second token (log-ratio 1).
    old = torch.tensor([[-1.0, -2.0, -1.5]])
    new = torch.tensor([[-1.1, -1.0, -1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    cfg = make_cfg(
        policy_loss={
            "rollout_correction": {
                "loss_type": "reinforce",
                "rollout_is": None,
                "rollout_rs": "token_k2",
                "rollout_rs_threshold": 0.1,
            }
        }
    )
    loss, _, grad = call("bypass_mode", old, new, adv, cfg=cfg)
    assert loss.item() == pytest.approx((1.1 - 1.5) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0, 0.5]]))


def test_bypass_requires_rollout_correction_config():
    cfg = OmegaConf.create({k: v for k, v in actor_dict().items() if k != "policy_loss"} | {"policy_loss": {}})
    with pytest.raises(ValueError, match="needs policy_loss.rollout_correction"):
        call("bypass_mode", COV_NEW, COV_NEW, COV_ADV, cfg=cfg)


# ----------------------------------------------------------------------------- all entries


def _cfg_for(name, make):
    if name == "dro":
        return make(policy_loss={"dro_beta": 0.2})
    if name in ("clip_cov", "kl_cov"):
        return make(policy_loss={"clip_cov_ratio": 0.3, "clip_cov_lb": -1.0, "kl_cov_ratio": 0.3})
    return make()


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_rows_contribute_zero_not_nan(name, mode):
    old, new, adv, mask = random_batch(10)
    cfg = _cfg_for(name, lambda **kw: OmegaConf.create(actor_dict(**kw)))
    # extra rows with no valid token and extreme (finite) values in them
    pad = torch.full((2, old.shape[1]), -30.0)
    torch.manual_seed(0)
    base_loss, base_m, base_grad = call(name, old, new, adv, mask, mode, cfg)
    torch.manual_seed(0)
    loss, m, grad = call(
        name,
        torch.cat([old, pad]),
        torch.cat([new, pad + 29.9]),
        torch.cat([adv, pad]),
        torch.cat([mask, torch.zeros_like(pad)]),
        mode,
        cfg,
    )
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.all(grad[-2:] == 0)
    bs = old.shape[0]
    # geo_mean averages over every row of the micro-batch (as verl), empty rows included
    scale = bs / (bs + 2) if name == "geo_mean" else 1.0
    # The empty rows add exact zeros (x * 0) after the real terms of every masked sum, so the real terms
    # keep their order; only the division by the row count (geo_mean) and the scaling round.
    assert loss.item() == pytest.approx(base_loss.item() * scale, rel=rounding_bound(3, 1.0), abs=0)
    torch.testing.assert_close(grad[:bs], base_grad * scale)
    assert m.keys() == base_m.keys()
    # rollout_corr/*ppl* diagnostics average per-sequence values over all rows (as verl)
    for key in [k for k in m if not k.startswith("rollout_corr/")]:
        assert m[key] == pytest.approx(base_m[key], rel=rounding_bound(3, 1.0), abs=0), key


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_dictconfig_and_actorconfig_agree(name):
    old, new, adv, mask = random_batch(11)
    results = []
    for make in (lambda **kw: OmegaConf.create(actor_dict(**kw)), lambda **kw: ActorConfig.from_dict(actor_dict(**kw))):
        torch.manual_seed(0)
        results.append(call(name, old, new, adv, mask, "seq-mean-token-sum", _cfg_for(name, make)))
    (l1, m1, g1), (l2, m2, g2) = results
    assert l1.item() == l2.item() and m1 == m2
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)


def test_vanilla_rollout_is_weights_scale_token_losses(make_cfg):
    # the vanilla hand case with per-token weights 2, 1, 0.5: (-1.2 * 2 + 0.8 * 1 + 6 * 0.5) / 3
    old, new = logp(0.2, 0.4, 0.1), logp(0.3, 0.2, 0.4)
    adv = torch.tensor([[1.0, -1.0, -2.0]])
    loss, m, _ = call("vanilla", old, new, adv, cfg=make_cfg(), weights=torch.tensor([[2.0, 1.0, 0.5]]))
    assert loss.item() == pytest.approx((-2.4 + 0.8 + 3.0) / 3, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 3)  # metrics do not see the weights


@pytest.mark.parametrize("name", [n for n in ALL_LOSSES if n != "bypass_mode"])
def test_rollout_is_weights_multiply_the_loss(name):
    # geo_mean takes the per-sequence geometric mean of the weights, which for a constant is itself
    old, new, adv, mask = random_batch(14)
    cfg = _cfg_for(name, lambda **kw: OmegaConf.create(actor_dict(**kw)))
    torch.manual_seed(0)
    plain, _, plain_grad = call(name, old, new, adv, mask, "seq-mean-token-mean", cfg)
    torch.manual_seed(0)
    weighted, _, grad = call(name, old, new, adv, mask, "seq-mean-token-mean", cfg, torch.full_like(old, 0.25))
    # x * 0.25 is exact; geo_mean's exp(mean(log 0.25)) errs relatively by the 7-term mean's eps * 7 * log 4
    # plus the log, the exp and the product
    assert weighted.item() == pytest.approx(0.25 * plain.item(), rel=rounding_bound(7 + 3, math.log(4)), abs=0)
    torch.testing.assert_close(grad, 0.25 * plain_grad)


@pytest.mark.parametrize("name", [n for n in ALL_LOSSES if n not in ("geo_mean", "sapo")])
def test_global_batch_info_from_config_is_used(name):
    old, new, adv, mask = random_batch(12)
    cfg = _cfg_for(name, lambda **kw: OmegaConf.create(actor_dict(**kw)))
    torch.manual_seed(0)
    local = call(name, old, new, adv, mask, "token-mean", cfg)[0]
    cfg.global_batch_info = {"dp_size": 2, "batch_num_tokens": int(mask.sum()) * 4}
    torch.manual_seed(0)
    scaled = call(name, old, new, adv, mask, "token-mean", cfg)[0]
    assert scaled.item() == pytest.approx(local.item() * 2 / 4, rel=1e-5)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_clip_ratio_c_must_exceed_one(c):
    cfg = OmegaConf.create(actor_dict(clip_ratio_c=c))
    with pytest.raises(ValueError, match=re.escape(f"clip_ratio_c={c!r} must be > 1.0")):
        call("vanilla", COV_NEW, COV_NEW, COV_ADV, cfg=cfg)
    typed = ActorConfig()
    typed.clip_ratio_c = c  # mutated after validation
    with pytest.raises(ValueError, match=re.escape(f"clip_ratio_c={c!r}")):
        call("vanilla", COV_NEW, COV_NEW, COV_ADV, cfg=typed)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_shape_mismatch_names_tensors_and_shapes(name):
    cfg = _cfg_for(name, lambda **kw: OmegaConf.create(actor_dict(**kw)))
    with pytest.raises(ValueError, match=re.escape("old_log_prob[1, 4], log_prob[1, 3]")):
        call(name, COV_NEW, COV_NEW[:, :3], COV_ADV, cfg=cfg)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_unknown_loss_agg_mode_lists_modes(name):
    cfg = _cfg_for(name, lambda **kw: OmegaConf.create(actor_dict(**kw)))
    with pytest.raises(ValueError, match=re.escape("loss_agg_mode='mean' is not allowed; choose one of")) as err:
        call(name, COV_NEW, COV_NEW, COV_ADV, mode="mean", cfg=cfg)
    assert all(mode in str(err.value) for mode in LOSS_AGG_MODES)


def test_none_config_means_actor_defaults():
    old, new, adv, mask = random_batch(13)
    a = call("vanilla", old, new, adv, mask, cfg=None)
    b = call("vanilla", old, new, adv, mask, cfg=ActorConfig())
    assert a[0].item() == b[0].item() and a[1] == b[1]
