"""Training-state checkpoints of the engine: model + Adam state + LR schedule + RNG.

Resuming from a checkpoint must give the same next step as the uninterrupted run: the step
after the save is computed twice -- by the engine that saved, and by a fresh engine (other
random init) that loaded -- and the metrics and updated weights must be identical. Adam is used
(its moments and step count change the update; a model-only restore would not match) with a
warm-up schedule (the LR depends on the restored scheduler step). The optimizer state
reshards with the parameters: saved at TP=2, continued at TP=1.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import DENSE, PROMPT, RESPONSE, make_batch, make_role
from tests.numerics import gpt_forward_terms, rounding_bound

FORWARD_TERMS = gpt_forward_terms(DENSE, PROMPT + RESPONSE)

ADAM = {
    "optimizer": "adam",
    "lr": 1e-2,
    "weight_decay": 0.01,
    "clip_grad": 1.0,
    "lr_warmup_steps": 3,
    "lr_warmup_init": 0.0,
}
TRAIN = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "optim": ADAM}


def _step(actor, seed):
    batch = make_batch(DENSE["vocab_size"], seed=seed)
    out = actor.compute_log_prob(batch)
    batch["old_log_probs"] = out["log_probs"] + batch["offset"]
    metrics = actor.update_policy(batch)
    metrics["lp_scale"] = float(out["log_probs"].abs().max())  # the log-probs' scale, for the bounds below
    return metrics


def _actor(par, seed):
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    return make_role("actor", DENSE, init_mesh(ParallelConfig(**par), seed=seed), TRAIN)


def _save_then_continue(rank, world_size, par, ckpt, final):
    """Two steps, save, a third step; also saves the weights after the third step (model only)."""
    from parallel.checkpoint import save_model

    actor = _actor(par, seed=1)
    _step(actor, 0)
    _step(actor, 1)
    actor.engine.save_checkpoint(ckpt)
    metrics = _step(actor, 2)
    save_model(actor.engine.model, final)
    return metrics, actor.engine.scheduler.num_steps


def _load_then_continue(rank, world_size, par, ckpt, final):
    from parallel.checkpoint import save_model

    actor = _actor(par, seed=99)  # other init: everything must come from the checkpoint
    actor.engine.load_checkpoint(ckpt)
    restored_steps = actor.engine.scheduler.num_steps
    metrics = _step(actor, 2)
    save_model(actor.engine.model, final)
    return metrics, restored_steps


def _gather(rank, world_size, paths):
    """Each model-only checkpoint loaded into one unsharded model: its parameters."""
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.checkpoint import load_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    pc = ParallelConfig()
    init_mesh(pc, seed=1)
    mc = ModelConfig(**DENSE)
    chunks = build_model(mc, build_transformer_config(mc, pc), head="lm")
    out = []
    for path in paths:
        load_model(chunks, path)
        out.append(
            {
                k: v.detach().clone()
                for k, v in chunks[0].state_dict().items()
                if torch.is_tensor(v) and "_extra_state" not in k
            }
        )
    return out


def _bad_restore(rank, world_size, ckpt):
    from parallel.checkpoint import save_model

    engine = _actor({}, seed=1).engine
    save_model(engine.model, ckpt)  # model only
    try:
        engine.load_checkpoint(ckpt)
    except ValueError as err:
        return str(err)
    return ""


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_resume_gives_the_same_next_step(tmp_path):
    ckpt, a, b = str(tmp_path / "ckpt"), str(tmp_path / "a"), str(tmp_path / "b")
    ((m_a, steps_a),) = run_distributed(_save_then_continue, 1, {}, ckpt, a)
    ((m_b, restored),) = run_distributed(_load_then_continue, 1, {}, ckpt, b)
    assert restored == steps_a - 1 == 2  # two optimizer steps (one mini-batch each) before the save
    assert m_a.keys() == m_b.keys()
    for key in m_a:
        assert m_a[key] == m_b[key], (key, m_a[key], m_b[key])
    # Warm-up step 3 of 3 (a fresh schedule would report its first step's 1/3 of the peak).
    assert m_b["actor/lr"] == pytest.approx(1e-2)
    wa, wb = run_distributed(_gather, 1, [a, b])[0]
    assert _max_diff(wa, wb) == 0.0


def test_optimizer_state_reshards_tp2_to_tp1(tmp_path):
    ckpt, a, b = str(tmp_path / "ckpt"), str(tmp_path / "a"), str(tmp_path / "b")
    results = run_distributed(_save_then_continue, 2, {"tensor_model_parallel_size": 2}, ckpt, a)
    ((m_b, _),) = run_distributed(_load_then_continue, 1, {}, ckpt, b)
    m_a = results[0][0]
    # The step after the load runs at TP=2 and at TP=1 from the same weights: two float32 paths. A
    # log-prob errs by LP = eps * FORWARD_TERMS * max(1, |lp|) on each; ppo_kl = mean(old - new) and the
    # log-ratio by 2 LP per run, 4 LP apart; pg_loss = mean(-A * clip(ratio)) by max|A| * max ratio * 4 LP;
    # grad_norm relatively by the backward's eps * (2 * FORWARD_TERMS + tokens); plus each mean's rounding.
    lp = rounding_bound(FORWARD_TERMS, max(1.0, m_a["lp_scale"], m_b["lp_scale"]))
    batch = make_batch(DENSE["vocab_size"], seed=2)
    tokens, adv = int(batch["response_mask"].sum()), float(batch["advantages"].abs().max())
    ratio = float(batch["offset"].abs().max()) + 4 * lp
    bounds = {
        "actor/ppo_kl": 4 * lp + 2 * rounding_bound(tokens, ratio),
        "actor/pg_loss": adv * math.exp(ratio) * 4 * lp + 2 * rounding_bound(tokens, adv * math.exp(ratio)),
        "actor/grad_norm": 2 * rounding_bound(2 * FORWARD_TERMS + tokens, m_a["actor/grad_norm"]),
    }
    for key, bound in bounds.items():
        assert m_b[key] == pytest.approx(m_a[key], abs=bound), (key, bound)
    wa, wb = run_distributed(_gather, 1, [a, b])[0]
    assert _max_diff(wa, wb) < 2e-5


def test_restoring_training_state_from_a_model_only_checkpoint_is_refused(tmp_path):
    err = run_distributed(_bad_restore, 1, str(tmp_path / "m"))[0]
    assert "holds no optimizer state" in err
