"""The engine runs closures it was never told about: it knows no roles and no losses.

A made-up head and a made-up loss -- the squared error of the scalar head's response values
against ``returns``, normalised by the global token count -- go straight to ``MegatronEngine``
(no role module involved). The forward result, the loss, every kind of ``LossMetrics``
(sums, token-weighted, minima, maxima), ``StepInfo``'s global counts, the gradient norm and the
SGD weight change must equal a hand computation with autograd through a plain forward of each
unpadded sequence, on one rank and on two data-parallel ranks that each see half the batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, DENSE, PROMPT, RESPONSE, make_batch
from tests.numerics import assert_within, gpt_forward_terms, rounding_bound

# The engine (padded micro-batches) and the hand forward (one sequence at a time) are two float32
# paths, each within eps * n * scale of the exact values: twice it apart. A value read one position
# off, or a micro-batch's loss weighted wrongly, moves them by ~1e-1.
FORWARD_TERMS = gpt_forward_terms(DENSE, PROMPT + RESPONSE)
BACKWARD_TERMS = 2 * FORWARD_TERMS + BATCH * RESPONSE  # the backward again, weight grads summed over tokens

LR = 1.0


def _custom_closures():
    from megatron_rl.engine import LossMetrics

    def head(mb, out):
        return {"v": out.response_values() * mb["response_mask"]}

    def loss_fn(mb, out, step):
        mask = mb["response_mask"]
        v = out.response_values()
        # DDP averages gradients over the DP ranks, so a rank's share of the global mean is scaled by dp_size.
        loss = (((v - mb["returns"]) ** 2) * mask).sum() / step.batch_num_tokens * step.dp_size
        tokens = float(mask.sum())
        valid = v.detach()[mask.bool()]
        return loss, LossMetrics(
            sums={
                "custom/loss": float(loss.detach()),
                # Summed over micro-batches, averaged over DP ranks: the global count again.
                "custom/num_tokens": step.batch_num_tokens / step.num_micro_batches,
                "custom/num_sequences": step.global_batch_size / step.num_micro_batches,
            },
            weighted={"custom/value_mean": float(valid.mean()) * tokens if tokens else 0.0},
            minima={"custom/value_min": float(valid.min())} if tokens else {},
            maxima={"custom/value_max": float(valid.max())} if tokens else {},
        )

    return head, loss_fn


def _case(rank, world_size, micro_batch_size):
    from megatron_rl.config import OptimConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine import MegatronEngine
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=21)
    engine = MegatronEngine(
        ModelConfig(**DENSE),
        mesh,
        head="scalar",
        trainable=True,
        optim=OptimConfig(optimizer="sgd", lr=LR, weight_decay=0.0, clip_grad=0.0),
    )
    with torch.no_grad():  # the value head starts at zero: give it O(0.1) weights so values differ
        torch.manual_seed(0)
        for name, p in engine.named_parameters():
            if name.startswith("output_layer."):
                p.normal_(0.0, 0.1)
    head, loss_fn = _custom_closures()
    batch = make_batch(DENSE["vocab_size"])
    mask = batch["response_mask"]

    # By hand: each unpadded sequence through the plain model, with cloned parameters.
    module = engine.model[0].module
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    rows = []
    for i in range(BATCH):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
        n = int(mask[i].sum())
        values = torch.func.functional_call(
            module, params, (ids, torch.arange(ids.shape[1])[None]), {"attention_mask": None}
        )[0, :, 0].float()
        start = ids.shape[1] - n - 1
        rows.append(torch.cat([values[start : start + n], torch.zeros(RESPONSE - n)]))
    v = torch.stack(rows)
    loss = (((v - batch["returns"]) ** 2) * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad for n, p in params.items()}
    valid = v.detach()[mask.bool()]
    hand = {
        "custom/loss": float(loss.detach()),
        "custom/num_tokens": float(mask.sum()),
        "custom/num_sequences": float((mask.sum(-1) > 0).sum()),
        "custom/value_mean": float(valid.mean()),
        "custom/value_min": float(valid.min()),
        "custom/value_max": float(valid.max()),
        "grad_norm": math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values())),
    }

    n = BATCH // world_size
    shard = {k: t[rank * n : (rank + 1) * n] for k, t in batch.items()}
    forward = engine.forward(shard, head, micro_batch_size=micro_batch_size)["v"]
    forward_diff = float(
        (forward - v.detach()[rank * n : (rank + 1) * n] * mask[rank * n : (rank + 1) * n]).abs().max()
    )
    before = {k: p.detach().clone() for k, p in engine.named_parameters()}
    metrics = engine.train_step(shard, loss_fn, micro_batch_size=micro_batch_size)
    weight_diff = max(float((before[k] - p.detach() - LR * grads[k]).abs().max()) for k, p in engine.named_parameters())

    frozen = MegatronEngine(ModelConfig(**DENSE), mesh, head="scalar", name="probe")
    errors = []
    for call in (
        lambda: frozen.train_step(shard, loss_fn, micro_batch_size=2),
        lambda: MegatronEngine(ModelConfig(**DENSE), mesh, head="value"),
    ):
        try:
            call()
            errors.append("")
        except ValueError as exc:
            errors.append(str(exc))
    scales = {
        "v": float(v.detach().abs().max()),
        "grad": max(float(g.abs().max()) for g in grads.values()),
        "weight": max(float(p.abs().max()) for p in before.values()),
        "residual": float(((v.detach() - batch["returns"]) * mask).abs().max()),
        "numel": sum(g.numel() for g in grads.values()),
    }
    return metrics, hand, forward_diff, weight_diff, errors, scales


def _metric_bounds(hand: dict, scales: dict) -> dict:
    """Each metric's bound from the values' forward bound F (two float32 paths, as above).

    Counts are integers: exact. A value, its min/max or its mean over the tokens: F (+ the mean's
    eps * tokens * max|v|). The loss, a mean of (v - r)^2: 2 * max|v - r| * F + F^2 and each path's
    mean over the tokens. grad_norm: the gradients' elementwise bound G (the backward's) grows to
    sqrt(numel) * G in the 2-norm, plus each norm's sum of numel squares.
    """
    forward = 2 * rounding_bound(FORWARD_TERMS, max(1.0, scales["v"]))
    tokens = int(hand["custom/num_tokens"])
    value = forward + rounding_bound(tokens, scales["v"])
    loss = 2 * scales["residual"] * forward + forward**2 + 2 * rounding_bound(tokens + 2, scales["residual"] ** 2)
    grad = 2 * rounding_bound(BACKWARD_TERMS, scales["grad"])
    grad_norm = math.sqrt(scales["numel"]) * grad + 2 * rounding_bound(scales["numel"], hand["grad_norm"])
    return {
        "custom/loss": loss,
        "custom/num_tokens": 0.0,
        "custom/num_sequences": 0.0,
        "custom/value_mean": value,
        "custom/value_min": value,
        "custom/value_max": value,
        "grad_norm": grad_norm,
    }


@pytest.mark.parametrize("world_size,micro_batch_size", [(1, 3), (2, 2)], ids=["one_rank", "dp2"])
def test_engine_runs_a_custom_head_and_loss_like_a_hand_computation(world_size, micro_batch_size):
    results = run_distributed(_case, world_size, micro_batch_size)
    metrics, hand, forward_diff, _, errors, scales = results[0]
    assert all(r[0] == metrics for r in results)  # every DP rank reports the global metrics
    assert_within(
        max(r[2] for r in results),
        2 * rounding_bound(FORWARD_TERMS, max(1.0, scales["v"])),
        f"closures ws={world_size} forward",
    )
    assert set(metrics) == set(hand) | {"lr"} and metrics["lr"] == LR
    bounds = _metric_bounds(hand, scales)
    for key, value in hand.items():
        assert metrics[key] == pytest.approx(value, abs=bounds[key]), (key, metrics[key], value, bounds[key])
    assert hand["grad_norm"] > 1e-2  # the step moved the weights ...
    # ... by exactly -lr * the hand gradient: w - lr * g rounds once at the weights' scale.
    step_bound = rounding_bound(1, scales["weight"]) + LR * 2 * rounding_bound(BACKWARD_TERMS, scales["grad"])
    assert_within(max(r[3] for r in results), step_bound, f"closures ws={world_size} weight step")
    assert errors == [
        "the 'probe' engine is not trainable",
        "head='value' is not allowed; choose one of ['lm', 'scalar']",
    ]
