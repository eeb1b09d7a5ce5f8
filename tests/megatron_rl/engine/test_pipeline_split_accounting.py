"""Megatron-Core's ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``
(through ``megatron.override_transformer_config``, as verl's Qwen3-235B script sets them): the embedding
(the loss) counts as one layer of the first (last) pipeline stage, so ``num_layers + 1`` (``+ 2``) splits
evenly over PP and that stage builds one decoder layer fewer.

On real Megatron-Core with gloo ranks, a 5-layer model at PP=2 is built as 2 + 3 layers with the embedding
counted and as 3 + 2 with the loss counted: each stage reports the global layer numbers it built (an even
split of 5 layers is impossible, and the two flags give mirror-image splits, so a flag dropped on its way
to ``TransformerConfig`` fails here), and the actor's log-probs, entropy and PPO metrics (loss, grad norm)
equal the single-rank run's; 5 + 2 over PP=2 is refused by the engine with the key named. The stage counts of ``parallel.config.pipeline_stage_layers`` follow
Megatron's ``get_num_layers_to_build`` (checked against it directly), and bad splits are refused with the
key, its value and the rule named.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import (
    ACTOR_CFG,
    DENSE,
    LOGPROB_TOL,
    PADDED,
    _budget,
    _max_diff,
    make_batch,
    make_role,
)

MODEL = dict(DENSE, num_layers=5)
EMBEDDING = {"account_for_embedding_in_pipeline_split": True}
LOSS = {"account_for_loss_in_pipeline_split": True}
BOTH = {**EMBEDDING, **LOSS}
CASES = {"embedding": EMBEDDING, "loss": LOSS}
STAGES = {"embedding": [[1, 2], [3, 4, 5]], "loss": [[1, 2, 3], [4, 5]]}
"""The 1-based ``layer_number``s each of the two stages must hold: (5 + 1) / 2 = 3 per stage, the counted
embedding (loss) taking one of the first (last) stage's."""


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _run(rank, world_size, par, cases, ckpt):
    """The actor under each override set of ``cases`` on one mesh: load (or save) the initial weights,
    compute log-probs and entropy, update once."""
    import os

    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    par = dict(par)
    remove_padding = par.pop("remove_padding", True)  # a megatron.* key, not a ParallelConfig field
    mesh = init_mesh(ParallelConfig(**par), seed=1234)
    cfg = {**ACTOR_CFG, **(_budget(12) if remove_padding else {})}
    results = {}
    for name, overrides in cases.items():
        actor = make_role("actor", MODEL, mesh, cfg, transformer_overrides=overrides, remove_padding=remove_padding)
        if os.path.exists(ckpt):
            load_model(actor.engine.model, ckpt)
        else:
            save_model(actor.engine.model, ckpt)
        batch = make_batch(MODEL["vocab_size"], ragged=True)
        out = actor.compute_log_prob(batch, calculate_entropy=True)
        batch["old_log_probs"] = out["log_probs"] + batch["offset"]
        result = {
            "layers": [
                int(layer.layer_number) for chunk in actor.engine.model for layer in _unwrap(chunk).decoder.layers
            ],
            "built": [bool(getattr(actor.engine.tf_config, k)) for k in BOTH],
            **{k: v.cpu() for k, v in out.items()},
            "metrics": actor.update_policy(batch),
        }
        results[name] = result
    if world_size == 2:  # 5 + 2 layers do not split over PP=2: the engine names the key before Megatron asserts
        try:
            make_role("actor", MODEL, mesh, cfg, transformer_overrides=BOTH, remove_padding=remove_padding)
        except ValueError as err:
            results["refused"] = str(err)
    return results


@pytest.fixture(scope="module")
def accounted_runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("accounted") / "actor_init")
    (ref,) = run_distributed(_run, 1, PADDED, {"ref": {}}, ckpt)
    ranks = run_distributed(_run, 2, dict(pipeline_model_parallel_size=2), CASES, ckpt, timeout_s=600)
    return ref["ref"], ranks


def test_stages_build_the_accounted_split(accounted_runs):
    ref, ranks = accounted_runs
    assert ref["layers"] == [1, 2, 3, 4, 5]
    for name, overrides in CASES.items():
        assert [r[name]["layers"] for r in ranks] == STAGES[name], name
        assert ranks[0][name]["built"] == [k in overrides for k in BOTH]  # Megatron's own config has the flag
    assert (
        "account_for_embedding_in_pipeline_split=True and megatron.override_transformer_config."
        "account_for_loss_in_pipeline_split=True count the embedding and the loss as one layer each: "
        "num_layers + 2 = 7 is not divisible by pipeline_model_parallel_size=2"
    ) in ranks[0].get("refused", "")


def test_accounted_split_equals_single_rank(accounted_runs):
    ref, ranks = accounted_runs
    mask = make_batch(MODEL["vocab_size"], ragged=True)["response_mask"].bool()
    assert ref["metrics"]["actor/pg_clipfrac"] > 0 and ref["metrics"]["actor/grad_norm"] > 0
    for name in CASES:
        res = ranks[-1][name]
        for key in ("log_probs", "entropys"):
            assert torch.equal(ranks[0][name][key], res[key])  # every stage is handed the per-row results
            diff = _max_diff(res[key][mask], ref[key][mask])
            assert diff < LOGPROB_TOL, (name, key, diff)
        for metric, value in ref["metrics"].items():
            assert math.isclose(res["metrics"][metric], value, rel_tol=1e-4, abs_tol=1e-5), (
                name,
                metric,
                res["metrics"][metric],
                value,
            )


# ---------------------------------------------------------------------------------------------
# Stage counts and refusals (no ranks needed).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_layers,pp,vpp,flags,stages",
    [
        (94, 8, None, BOTH, (11,) + (12,) * 6 + (11,)),  # verl's run_qwen3-235b_megatron_96gb.sh: 96 / 8
        (6, 2, None, BOTH, (3, 3)),
        (5, 2, None, EMBEDDING, (2, 3)),
        (5, 2, None, LOSS, (3, 2)),
        (7, 4, None, EMBEDDING, (1, 2, 2, 2)),
        (5, 1, None, BOTH, (5,)),  # one stage: embedding and loss both on it, every layer built
        (6, 2, 2, BOTH, (3, 3)),  # 4 per stage, 2 per chunk; the first and last chunk build 1
        (10, 2, 2, BOTH, (5, 5)),
    ],
)
def test_stage_layers_follow_megatron(num_layers, pp, vpp, flags, stages):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from parallel.config import pipeline_stage_layers

    assert pipeline_stage_layers(num_layers, pp, vpp, **flags) == stages
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        **flags,
    )
    assert (
        tuple(
            sum(get_num_layers_to_build(config, vp_stage=v, pp_rank=rank) for v in range(vpp or 1))
            for rank in range(pp)
        )
        == stages
    )


KEY = "megatron.override_transformer_config"


@pytest.mark.parametrize(
    "num_layers,pp,vpp,fields,message",
    [
        (
            94,
            8,
            None,
            EMBEDDING,
            f"{KEY}.account_for_embedding_in_pipeline_split=True counts the embedding as a layer: "
            "num_layers + 1 = 95 is not divisible by pipeline_model_parallel_size=8",
        ),
        (
            95,
            8,
            None,
            BOTH,
            "count the embedding and the loss as one layer each: num_layers + 2 = 97 is not divisible by "
            "pipeline_model_parallel_size=8",
        ),
        (
            8,
            2,
            2,
            BOTH,
            "(num_layers + 2) / pipeline_model_parallel_size = 10/2 = 5 layers per stage is not divisible by "
            "virtual_pipeline_model_parallel_size=2",
        ),
        (2, 2, 2, BOTH, "without a decoder layer; a stage without one is not built here"),
        (
            3,
            4,
            None,
            EMBEDDING,
            "leaves a pipeline stage of num_layers=3 at pipeline_model_parallel_size=4 without a decoder",
        ),
        (
            94,
            8,
            None,
            {**BOTH, "num_layers_in_last_pipeline_stage": 10},
            f"{KEY}.num_layers_in_last_pipeline_stage=10 cannot be combined with {KEY}.account_for_embedding_in_pipeline_split"
            f"=True, {KEY}.account_for_loss_in_pipeline_split=True (Megatron-Core refuses both)",
        ),
        (
            6,
            2,
            None,
            {"account_for_loss_in_pipeline_split": "yes"},
            f"{KEY}.account_for_loss_in_pipeline_split='yes' is not allowed; it must be true or false",
        ),
    ],
)
def test_bad_accounted_split_is_refused_by_name(num_layers, pp, vpp, fields, message):
    from parallel.config import ParallelConfig, pipeline_stage_layers

    with pytest.raises(ValueError) as info:
        pipeline_stage_layers(num_layers, pp, vpp, **fields)
    assert message in str(info.value)
    with pytest.raises(ValueError) as info:
        ParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp).validate(
            pp, num_layers=num_layers, **fields
        )
    assert message in str(info.value)


def test_override_fields_pick_the_accounting_flags():
    from parallel.config import uneven_pipeline_fields

    assert uneven_pipeline_fields({**BOTH, "apply_rope_fusion": True}) == BOTH
    assert (
        uneven_pipeline_fields(
            {"account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": None}
        )
        == {}
    )
    assert uneven_pipeline_fields(None) == {}
