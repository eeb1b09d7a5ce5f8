"""The actor role's on-policy distillation inside ``update_policy`` (and the teacher's top-k side).

One ``update_policy`` step (k3 back-propagated alone; k1 as policy-gradient advantages combined
with the task policy loss; top-k forward KL against the student's vocab-parallel logits) gives
the loss, the gradient norm and the SGD weight change of ``compute_distillation_loss`` evaluated by
hand with autograd through a plain forward of the model. ``compute_topk_log_probs`` equals the
hand top-k of ``log_softmax``. Bad inputs are refused with messages that name the problem.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from parallel.testing import run_distributed
from tests.numerics import assert_within, rounding_bound

VOCAB, PAD = 96, 0
BATCH, PROMPT, RESPONSE = 8, 6, 5
DENSE = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)
SGD = {"optimizer": "sgd", "lr": 1.0, "weight_decay": 0.0, "clip_grad": 0.0}
# The reductions along one log-prob of DENSE (the n of eps * n * scale): per layer RMSNorm, QKV,
# q.k over the head (16), softmax and p.v over the sequence, the projection, RMSNorm, fc1, fc2;
# then the final norm, the output layer and the log-softmax over the vocabulary.
_H, _F, _S = DENSE["hidden_size"], DENSE["ffn_hidden_size"], PROMPT + RESPONSE
FORWARD_TERMS = DENSE["num_layers"] * (6 * _H + _H // DENSE["num_attention_heads"] + 2 * _S + _F) + 2 * _H + VOCAB
BACKWARD_TERMS = 2 * FORWARD_TERMS + BATCH * RESPONSE  # the backward again, weight grads summed over tokens


def _two_paths(num_terms: int, scale: float) -> float:
    """The role (micro-batched, padded) and the hand forward (one sequence at a time) are two float32
    paths, each within the rounding bound of the exact value: twice it apart. An off-by-one response
    slice, a missing temperature or a wrong normalisation moves the losses by > 1e-2."""
    return 2 * rounding_bound(num_terms, max(1.0, scale))


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """verl's layout: left-padded prompts, right-padded responses (one empty); pads are ``PAD``."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=g)
    responses = torch.randint(1, VOCAB, (BATCH, RESPONSE), generator=g)
    prompt_len = torch.tensor([6, 3, 4, 6, 1, 5, 2, 6])
    response_len = torch.tensor([5, 2, 5, 1, 4, 0, 3, 5])
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < response_len[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1) * attention_mask,  # pads -> PAD = 0
        "attention_mask": attention_mask,
        "responses": responses * response_mask,
        "response_mask": response_mask,
    }


def _distill_case(rank, world_size, distillation, mbs, temperature, empty_rows):
    """(update metrics, hand distillation loss, hand total loss, hand grad norm, max |weight change + lr * hand
    grad|, bad-input errors). Rank ``d`` of ``world_size`` data-parallel ranks updates on its contiguous shard;
    the hand computation sees the whole batch. ``empty_rows`` get empty responses."""
    import dataclasses

    from megatron_rl.algos.distillation_loss import (
        DistillationInputs,
        DistillationLossConfig,
        TopKDistillation,
        compute_distillation_loss,
        compute_forward_kl_topk,
    )
    from megatron_rl.algos.algo_registry import POLICY_LOSSES
    from megatron_rl.config import ActorConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.roles import build_role
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=9)
    actor = build_role(
        "actor",
        ModelConfig(**DENSE),
        mesh,
        ActorConfig.from_dict({"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": mbs, "optim": SGD}),
    )
    dcfg = DistillationLossConfig.from_dict(distillation)
    batch = make_batch(0)
    for row in empty_rows:
        batch["response_mask"][row] = 0
        batch["attention_mask"][row, PROMPT:] = 0
        batch["input_ids"][row, PROMPT:] = PAD
    mask = batch["response_mask"]
    g = torch.Generator().manual_seed(4)
    student = actor.compute_log_prob(batch, temperature=temperature)["log_probs"]
    batch["teacher_log_probs"] = (student - 0.3 * torch.rand(BATCH, RESPONSE, generator=g)) * mask
    if dcfg.use_task_rewards or dcfg.use_policy_gradient:
        batch["old_log_probs"] = (student + 0.1 * torch.randn(BATCH, RESPONSE, generator=g)) * mask
    if dcfg.use_task_rewards:
        batch["advantages"] = torch.randn(BATCH, RESPONSE, generator=g)
    topk = dcfg.loss_mode == "forward_kl_topk"
    if topk:  # a teacher distribution per response position; its top-k (k = dcfg.topk)
        teacher = (2 * torch.randn(BATCH, RESPONSE, DENSE["vocab_size"], generator=g)).log_softmax(-1)
        batch["teacher_topk_log_probs"], batch["teacher_topk_ids"] = teacher.topk(dcfg.topk, dim=-1)

    # By hand: every unpadded sequence through the plain model, with cloned parameters.
    module = actor.engine.model[0].module
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    rows, topk_rows, teacher_topk, hand_topk, topk_diff, ids_equal = [], [], None, [], 0.0, True
    for i in range(BATCH):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
        n = int(mask[i].sum())
        if n == 0:
            rows.append(torch.zeros(RESPONSE))
            topk_rows.append(None)
            continue
        logits = (
            torch.func.functional_call(
                module, params, (ids, torch.arange(ids.shape[1])[None]), {"attention_mask": None}
            )[0].float()
            / temperature
        )
        lp = logits.log_softmax(-1)[ids.shape[1] - n - 1 : ids.shape[1] - 1].gather(-1, ids[0, -n:, None]).squeeze(-1)
        rows.append(torch.cat([lp, torch.zeros(RESPONSE - n)]))
        if topk:
            with torch.no_grad():
                full = logits.log_softmax(-1)[ids.shape[1] - n - 1 : ids.shape[1] - 1].topk(dcfg.topk, dim=-1)
            hand_topk.append((i, full.values, full.indices))
            topk_rows.append(
                compute_forward_kl_topk(
                    logits[None, ids.shape[1] - n - 1 : ids.shape[1] - 1],
                    batch["teacher_topk_log_probs"][i : i + 1, :n],
                    batch["teacher_topk_ids"][i : i + 1, :n],
                    dcfg.log_prob_min_clamp,
                )
            )
    lp = torch.stack(rows)
    if topk:  # per-row results padded to [BATCH, RESPONSE]

        def padded(field):
            return torch.stack(
                [
                    torch.zeros(RESPONSE)
                    if t is None
                    else F.pad(getattr(t, field)[0].float(), (0, RESPONSE - getattr(t, field).shape[1]))
                    for t in topk_rows
                ]
            )

        teacher_topk = TopKDistillation(
            padded("distillation_losses"),
            padded("student_mass"),
            padded("teacher_mass"),
            padded("overlap_count"),
            padded("overlap_token_advantage"),
            dcfg.topk,
        )
        # The teacher side of the role (its own top-k, here of the same model) against the hand top-k.
        own = actor.compute_topk_log_probs(batch, k=dcfg.topk, temperature=temperature)
        for i, values, ids in hand_topk:
            n = values.shape[0]
            topk_diff = max(topk_diff, float((own["topk_log_probs"][i, :n] - values).abs().max()))
            ids_equal = ids_equal and torch.equal(own["topk_ids"][i, :n], ids)
    gbi = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": int((mask.sum(-1) > 0).sum())}
    inputs = DistillationInputs(
        response_mask=mask,
        student_log_probs=lp,
        teacher_log_probs=batch["teacher_log_probs"],
        old_log_probs=batch.get("old_log_probs"),
        topk=teacher_topk,
    )
    loss, _ = compute_distillation_loss(inputs, dcfg, "token-mean", gbi)
    hand_distill = float(loss)
    if dcfg.use_task_rewards:
        pg_loss, _ = POLICY_LOSSES["vanilla"](
            old_log_prob=batch["old_log_probs"],
            log_prob=lp,
            advantages=batch["advantages"],
            response_mask=mask,
            loss_agg_mode="token-mean",
            config=dataclasses.replace(actor.config, global_batch_info=gbi),
        )
        loss = pg_loss + dcfg.distillation_loss_coef * loss
    loss.backward()
    grads = {n: p.grad for n, p in params.items()}
    grad_norm = math.sqrt(sum(float((gr.double() ** 2).sum()) for gr in grads.values()))

    before = {n: p.detach().clone() for n, p in actor.engine.named_parameters()}
    n = BATCH // world_size
    shard = {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}
    metrics = actor.update_policy(
        shard, temperature=temperature, distillation_loss={"distillation_loss": distillation, "enabled": True}
    )
    weight_diff = max(
        float((before[n] - p.detach() - SGD["lr"] * grads[n]).abs().max()) for n, p in actor.engine.named_parameters()
    )
    scales = {
        "lp": float(lp.abs().max()),
        "grad": max(float(gr.abs().max()) for gr in grads.values()),
        "weight": max(float(p.abs().max()) for p in before.values()),
        "adv": float(batch["advantages"].abs().max()) if "advantages" in batch else 0.0,
    }
    return (
        metrics,
        hand_distill,
        float(loss),
        grad_norm,
        weight_diff,
        _bad_inputs(actor, shard),
        (topk_diff, ids_equal),
        scales,
    )


def _bad_inputs(actor, batch) -> list[str]:
    """The errors of a bad loss_mode, of forward_kl_topk without the teacher's top-k, of a batch without
    teacher log-probs and of compute_rm_score on an LM engine (a reward role over the actor's engine)."""
    from megatron_rl.config import RewardModelConfig
    from megatron_rl.roles import RewardModel

    batch = {k: v for k, v in batch.items() if not k.startswith("teacher_")}
    batch.update(
        old_log_probs=torch.zeros_like(batch["response_mask"], dtype=torch.float32),
        advantages=torch.zeros_like(batch["response_mask"], dtype=torch.float32),
    )
    errors = []
    for distillation in (
        {"loss_mode": "k9"},
        {"loss_mode": "forward_kl_topk", "use_policy_gradient": False},
        {"loss_mode": "k3"},
    ):
        try:
            actor.update_policy(batch, distillation_loss=distillation)
            errors.append("")
        except ValueError as exc:
            errors.append(str(exc))
    try:
        RewardModel(actor.engine, RewardModelConfig()).compute_rm_score(batch)
        errors.append("")
    except ValueError as exc:
        errors.append(str(exc))
    return errors


@pytest.mark.parametrize(
    "distillation,world_size,mbs,empty_rows",
    [
        # Supervised reverse-KL (k3) alone: no advantages/old log-probs in the batch; mbs=1 has an empty micro-batch.
        ({"loss_mode": "k3", "use_policy_gradient": False, "use_task_rewards": False}, 1, 1, ()),
        # k1 as policy-gradient reward, added (x0.5) to the task's vanilla PPO loss; two data-parallel ranks.
        (
            {"loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": True, "distillation_loss_coef": 0.5},
            2,
            2,
            (),
        ),
        # ... where rank 1's shard has no response token (its metrics lack keys rank 0 has).
        (
            {"loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": True, "distillation_loss_coef": 0.5},
            2,
            2,
            (4, 6, 7),
        ),
        # Top-k forward KL (k=8 of 96) against the student's vocab-parallel logits, back-propagated; one empty row.
        (
            {"loss_mode": "forward_kl_topk", "topk": 8, "use_policy_gradient": False, "use_task_rewards": False},
            1,
            2,
            (5,),
        ),
        # ... and as a policy-gradient reward next to the task loss.
        (
            {
                "loss_mode": "forward_kl_topk",
                "topk": 8,
                "use_policy_gradient": True,
                "use_task_rewards": True,
                "distillation_loss_coef": 0.5,
            },
            1,
            4,
            (),
        ),
    ],
)
def test_distillation_update_equals_hand_computed_loss_and_gradient(distillation, world_size, mbs, empty_rows):
    results = run_distributed(_distill_case, world_size, distillation, mbs, 0.8, empty_rows)
    metrics, hand_distill, hand_total, grad_norm, weight_diff, errors, (topk_diff, ids_equal), scales = results[0]
    tag = f"distillation {distillation['loss_mode']} ws={world_size} mbs={mbs}"
    # compute_topk_log_probs == the hand top-k of log_softmax: log-probs of the same forward.
    assert_within(topk_diff, _two_paths(FORWARD_TERMS, scales["lp"]), f"{tag} topk")
    assert ids_equal
    assert all(r[0] == metrics for r in results)  # every rank reports the global metrics
    # The loss: a token mean (<= BATCH * RESPONSE terms) of per-token losses whose derivative in the
    # log-prob is <= e^0.3 (teacher - student in [-0.3, 0]), so scaled like the log-probs.
    assert_within(
        abs(metrics["distillation/loss"] - hand_distill),
        _two_paths(FORWARD_TERMS + BATCH * RESPONSE, 1.35 * scales["lp"]),
        f"{tag} loss",
    )
    # The gradient norm, relative: each gradient within the backward's bound of its scale.
    assert_within(
        abs(metrics["actor/grad_norm"] - grad_norm) / max(1.0, grad_norm),
        _two_paths(BACKWARD_TERMS, 1.0),
        f"{tag} grad_norm (relative)",
    )
    # SGD, lr=1: w - g rounds once at the weights' scale; g itself is the backward's.
    step_bound = rounding_bound(1, scales["weight"]) + 2 * rounding_bound(BACKWARD_TERMS, SGD["lr"] * scales["grad"])
    assert_within(max(r[4] for r in results), step_bound, f"{tag} weight step")
    assert grad_norm > 1e-2  # the step moved the weights
    assert -math.inf < metrics["distillation/loss_min"] <= metrics["distillation/loss_max"] < math.inf
    if distillation["loss_mode"] == "forward_kl_topk":  # mass and overlap diagnostics of the top-k
        assert 0 < metrics["distillation/student_mass"] < 1 and 0 < metrics["distillation/teacher_mass"] < 1
        assert 0 <= metrics["distillation/overlap_ratio"] <= 1
    else:
        assert "distillation/abs_loss" in metrics
    if distillation["use_task_rewards"]:
        # The PPO loss moves with the log-probs times the advantages (the ratio's derivative is ~1).
        pg_bound = _two_paths(FORWARD_TERMS + BATCH * RESPONSE, scales["lp"] * max(1.0, scales["adv"]))
        assert_within(abs(metrics["actor/pg_loss"] + 0.5 * hand_distill - hand_total), pg_bound, f"{tag} pg_loss")
        assert {"distillation/pg_clipfrac", "distillation/ppo_kl"} <= set(metrics)
    else:
        assert "actor/pg_loss" not in metrics
    bad_mode, topk, missing, rm = errors
    assert bad_mode.startswith("distillation_loss.loss_mode='k9' is not allowed; choose one of ['forward_kl_topk'")
    assert topk.startswith("batch is missing field(s) ['teacher_topk_log_probs', 'teacher_topk_ids']")
    assert missing.startswith("batch is missing field(s) ['teacher_log_probs']")
    assert rm == "compute_rm_score needs a scalar-head engine (role 'reward'); this one is 'actor'"
