"""Uneven pipeline stages (``num_layers_in_first/last_pipeline_stage`` through
``megatron.override_transformer_config``, as verl's DeepSeek-V3 61-layer and Qwen3-235B 94-layer
scripts set them) on real Megatron-Core with gloo ranks.

A 5-layer model at PP=2 as 3 + 2 layers and at PP=3 as 2 + 2 + 1 must give the single-rank
result: actor log-probs, entropy and PPO metrics (loss, grad norm), critic values and metrics,
and the weights after one SGD step (the gradients, through lr 0.5) -- to the tolerances of
``test_engine``. Each stage reports the global layer numbers it built, so a run that silently
fell back to an even split (impossible here: 5 layers do not split evenly) or shifted the layer
offsets would fail. Weights move between layouts through distributed checkpoints, so the
checkpoints' layer keys follow the uneven split too. An MoE model records the same router
choices (``routed_experts``) at 3 + 2 as on one rank, and a replayed update routes exactly as
recorded. Bad splits are refused with the field named.
"""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import (
    ACTOR_CFG,
    CRITIC_CFG,
    DENSE,
    PADDED,
    _budget,
    _check,
    _load_roles,
    make_batch,
    make_role,
)

UNEVEN = dict(DENSE, num_layers=5)
# name -> (world size, parallel layout, override_transformer_config, training-config overrides)
LAYOUTS = {
    "pp2_3+2": (2, dict(pipeline_model_parallel_size=2), {"num_layers_in_first_pipeline_stage": 3}, _budget(12)),
    "pp3_2+2+1": (
        3,
        dict(pipeline_model_parallel_size=3),
        {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 1},
        {},
    ),
}
STAGES = {"pp2_3+2": [[1, 2, 3], [4, 5]], "pp3_2+2+1": [[1, 2], [3, 4], [5]]}
"""The 1-based ``layer_number``s each pipeline stage must hold."""


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _run(rank, world_size, par, overrides, model_kw, train_cfgs, ckpts):
    """Both roles on one mesh: load (or save) the initial weights, compute, update once, save."""
    import os

    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    par = dict(par)
    remove_padding = par.pop("remove_padding", True)  # a megatron.* key, not a ParallelConfig field
    mesh = init_mesh(ParallelConfig(**par), seed=1234)
    results = {}
    for role, train_cfg in train_cfgs.items():
        worker = make_role(
            role, model_kw, mesh, train_cfg, transformer_overrides=overrides, remove_padding=remove_padding
        )
        ckpt_in, ckpt_out = ckpts[role]
        if os.path.exists(ckpt_in):
            load_model(worker.engine.model, ckpt_in)
        else:
            save_model(worker.engine.model, ckpt_in)
        batch = make_batch(model_kw["vocab_size"], ragged=True)
        result = {
            "layers": [
                int(layer.layer_number) for chunk in worker.engine.model for layer in _unwrap(chunk).decoder.layers
            ]
        }
        if role == "actor":
            out = worker.compute_log_prob(batch, calculate_entropy=True)
            batch["old_log_probs"] = out["log_probs"] + batch["offset"]
            result.update(out, metrics=worker.update_policy(batch))
        else:
            out = worker.compute_values(batch)
            batch["values"] = out["values"] + 2 * batch["offset"]
            result.update(out, metrics=worker.update_critic(batch))
        save_model(worker.engine.model, ckpt_out)
        results[role] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in result.items()}
    return results


@pytest.fixture(scope="module")
def uneven_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    roles = {"actor": ACTOR_CFG, "critic": CRITIC_CFG}

    def ckpts(name):
        return {role: (str(root / f"{role}_init"), str(root / f"{role}_{name}")) for role in roles}

    # The reference: one rank, padded rows, micro-batches of 2 (as in test_engine).
    (ref,) = run_distributed(_run, 1, PADDED, {}, UNEVEN, roles, ckpts("ref"))
    results, ranks, paths = {r: {} for r in roles}, {}, {r: [ckpts("ref")[r][1]] for r in roles}
    for name, (world, par, overrides, train) in LAYOUTS.items():
        res = run_distributed(
            _run,
            world,
            par,
            overrides,
            UNEVEN,
            {r: {**c, **train} for r, c in roles.items()},
            ckpts(name),
            timeout_s=600,
        )
        ranks[name] = res
        for role in roles:
            results[role][name] = res[-1][role]  # every stage returns the same per-row results
            paths[role].append(ckpts(name)[role][1])
    weights = run_distributed(_load_roles, 1, UNEVEN, paths)[0]
    return {role: (ref[role], results[role], weights[role]) for role in roles}, ranks, ref


def test_stages_hold_the_uneven_split(uneven_runs):
    _, ranks, ref = uneven_runs
    assert ref["actor"]["layers"] == [1, 2, 3, 4, 5]
    for name, res in ranks.items():
        for role in ("actor", "critic"):
            assert [r[role]["layers"] for r in res] == STAGES[name], (name, role)
            # The per-row results are handed to every stage.
            for r in res:
                assert torch.equal(
                    r[role]["log_probs" if role == "actor" else "values"],
                    res[-1][role]["log_probs" if role == "actor" else "values"],
                )


def test_actor_uneven_pipeline_equals_single_rank(uneven_runs):
    runs, _, _ = uneven_runs
    ref, results, weights = runs["actor"]
    _check(ref, results, weights, ["log_probs", "entropys"], layouts={n: (w, p) for n, (w, p, _, _) in LAYOUTS.items()})
    assert ref["metrics"]["actor/pg_clipfrac"] > 0 and ref["metrics"]["actor/grad_norm"] > 0


def test_critic_uneven_pipeline_equals_single_rank(uneven_runs):
    runs, _, _ = uneven_runs
    ref, results, weights = runs["critic"]
    _check(ref, results, weights, ["values"], layouts={n: (w, p) for n, (w, p, _, _) in LAYOUTS.items()})
    assert ref["metrics"]["critic/vf_clipfrac"] > 0


# ---------------------------------------------------------------------------------------------
# Router replay at 3 + 2.
# ---------------------------------------------------------------------------------------------
MOE = dict(UNEVEN, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.0)


def _replay_case(rank, world_size, par, overrides, ckpt):
    import os

    from megatron_rl.config import ActorConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine.router_replay import ROUTED_EXPERTS
    from megatron_rl.roles import build_role
    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(**par), seed=1234)
    cfg = ActorConfig.from_dict({**ACTOR_CFG, "entropy_coeff": 0.0})
    actor = build_role("actor", ModelConfig(**MOE), mesh, cfg, routing_replay=True, transformer_overrides=overrides)
    if os.path.exists(ckpt):
        load_model(actor.engine.model, ckpt)
    else:
        save_model(actor.engine.model, ckpt)
    with torch.no_grad():  # wide router logits: no near-ties whose top-k could flip between layouts
        for name, p in actor.engine.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(20.0)
    batch = make_batch(MOE["vocab_size"], ragged=True)
    old = actor.compute_log_prob(batch, routing="record")
    batch.update(old_log_probs=old["log_probs"] + batch["offset"], **{ROUTED_EXPERTS: old[ROUTED_EXPERTS]})
    with torch.no_grad():  # the update must route as recorded even after the routers changed
        for name, p in actor.engine.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn_like(p))
    metrics = actor.update_policy(batch)
    return old[ROUTED_EXPERTS], old["log_probs"], metrics


def test_router_replay_follows_the_uneven_split(tmp_path):
    ckpt = str(tmp_path / "moe_init")
    mask = make_batch(MOE["vocab_size"], ragged=True)["attention_mask"].bool()
    ref_routed, ref_lp, ref_metrics = run_distributed(_replay_case, 1, {}, {}, ckpt)[0]
    res = run_distributed(
        _replay_case, 2, dict(pipeline_model_parallel_size=2), {"num_layers_in_first_pipeline_stage": 3}, ckpt
    )
    for routed, lp, metrics in res:
        assert routed.shape == ref_routed.shape == (*mask.shape, 5, 2)
        assert torch.equal(routed[mask], ref_routed[mask])  # every layer's experts, both stages
        assert metrics["actor/router_agreement/old_vs_update"] == 1.0
        assert metrics["actor/router_agreement/old_vs_update_natural"] < 1.0  # the perturbation had teeth
    assert ref_metrics["actor/router_agreement/old_vs_update"] == 1.0
    resp = make_batch(MOE["vocab_size"], ragged=True)["response_mask"].bool()
    assert float((res[-1][1][resp] - ref_lp[resp]).abs().max()) < 2e-5


# ---------------------------------------------------------------------------------------------
# Refusals (no ranks needed).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pp,fields,message",
    [
        (
            2,
            {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 3},
            "place 6 of num_layers=5 layers on the pipeline_model_parallel_size=2 stages; the counts must add up to 5",
        ),
        (
            3,
            {"num_layers_in_first_pipeline_stage": 2},
            "leave 3 of num_layers=5 layers for the 2 middle stage(s) of pipeline_model_parallel_size=3",
        ),
        (
            2,
            {"num_layers_in_first_pipeline_stage": 0},
            "num_layers_in_first_pipeline_stage=0 is not allowed; it must be",
        ),
        (1, {"num_layers_in_last_pipeline_stage": 5}, "needs pipeline_model_parallel_size > 1, got 1"),
    ],
)
def test_bad_uneven_split_is_refused_by_name(pp, fields, message):
    from parallel.config import ParallelConfig, pipeline_stage_layers

    with pytest.raises(ValueError, match="megatron.override_transformer_config.num_layers_in_") as info:
        pipeline_stage_layers(5, pp, **fields)
    assert message in str(info.value)
    with pytest.raises(ValueError, match="num_layers_in_"):
        ParallelConfig(pipeline_model_parallel_size=pp).validate(pp, num_layers=5, **fields)


def test_stage_layer_counts_of_verl_scripts():
    """The splits verl's example scripts set: DeepSeek-V3 671B (61 layers) at PP=16 as first 4 / last 1
    (run_deepseek671b_math_megatron_80gb.sh) and at PP=12 with last 6 (..._96gb.sh), Qwen3-235B (94) at
    PP=8 with last 10 (run_qwen3-235b_megatron_96gb.sh); and VPP: each stage's count splits into its chunks."""
    from parallel.config import pipeline_stage_layers

    assert pipeline_stage_layers(61, 16, num_layers_in_first_pipeline_stage=4, num_layers_in_last_pipeline_stage=1) == (
        4,
    ) * 15 + (1,)
    assert pipeline_stage_layers(61, 12, num_layers_in_last_pipeline_stage=6) == (5,) * 11 + (6,)
    assert pipeline_stage_layers(94, 8, num_layers_in_last_pipeline_stage=10) == (12,) * 7 + (10,)
    assert pipeline_stage_layers(5, 2, num_layers_in_last_pipeline_stage=2) == (3, 2)
    assert pipeline_stage_layers(8, 4) == (2, 2, 2, 2)
    assert pipeline_stage_layers(6, 2, 2, num_layers_in_first_pipeline_stage=4) == (4, 2)
    with pytest.raises(
        ValueError,
        match=r"give pipeline stages of \[3, 2\] layers; with "
        r"virtual_pipeline_model_parallel_size=2 each must be divisible by 2",
    ):
        pipeline_stage_layers(5, 2, 2, num_layers_in_first_pipeline_stage=3)
