"""The HF <-> Megatron bridge under an uneven pipeline split at PP=3 (2 + 1 + 1 of 4 layers through
``num_layers_in_first/last_pipeline_stage``): a tiny HF checkpoint loaded at that layout reproduces HF's
logits, exports back bit for bit from every stage's layer offsets, and its distributed checkpoint
loads on one rank with the same logits. (PP=2 as 3 + 1 runs in ``test_families``' matrix.)"""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed
from tests.megatron_rl.models.test_families import (
    CASES,
    LOGIT_TOL,
    _export_check,
    make_input_ids,
    pipeline_logits,
    read_hf_tensors,
    save_hf_model,
)

SPLIT = {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 1}
FAMILIES = ["llama", "qwen2_moe"]


def _uneven_ranks(rank, world_size, cases, split):
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import check_layout, load_hf_checkpoint
    from parallel.checkpoint import save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    pc = ParallelConfig(pipeline_model_parallel_size=3)
    mesh = init_mesh(pc, seed=1234)
    out = {}
    for c in cases:
        check_layout(pc, world_size, c["model_cfg"], split)
        weight_map = get_family(c["architecture"]).weight_map(c["model_cfg"])
        chunks = build_model(c["model_cfg"], build_transformer_config(c["model_cfg"], pc, **split))
        load_hf_checkpoint(chunks, weight_map, c["hf_dir"], mesh=mesh)
        logits = pipeline_logits(chunks, mesh, c["input_ids"], c["model_cfg"].vocab_size)
        res = _export_check(chunks, weight_map, mesh, read_hf_tensors(c["hf_dir"]), bucket_bytes=20_000, all_ranks=True)
        res["layers"] = [int(layer.layer_number) for layer in chunks[0].decoder.layers]
        if logits is not None:
            res["diff"] = float((logits - c["hf_logits"]).abs().max())
            res["logits"] = logits
        save_model(chunks, c["ckpt"])
        out[c["name"]] = res
    return out


def _one_rank(rank, world_size, cases):
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.checkpoint import load_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    pc = ParallelConfig()
    mesh = init_mesh(pc, seed=7)
    out = {}
    for c in cases:
        chunks = build_model(c["model_cfg"], build_transformer_config(c["model_cfg"], pc))
        load_model(chunks, c["ckpt"])
        out[c["name"]] = pipeline_logits(chunks, mesh, c["input_ids"], c["model_cfg"].vocab_size)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_rl.models.families import get_family

    work = tmp_path_factory.mktemp("uneven_bridge")
    cases = []
    for name in FAMILIES:
        hf_dir, hf_logits = save_hf_model(name, work / name / "hf")
        cases.append(
            dict(
                name=name,
                architecture=CASES[name][0]["architectures"][0],
                hf_dir=str(hf_dir),
                hf_logits=hf_logits,
                input_ids=make_input_ids(),
                ckpt=str(work / name / "mcore_pp3"),
                model_cfg=get_family(hf_dir).model_config(hf_dir, make_vocab_size_divisible_by=64),
            )
        )
    stages = run_distributed(_uneven_ranks, 3, cases, SPLIT, timeout_s=400)
    single = run_distributed(_one_rank, 1, cases, timeout_s=200)[0]
    return cases, stages, single


@pytest.mark.parametrize("name", FAMILIES)
def test_pp3_uneven_load_export_and_checkpoint(name, runs):
    cases, stages, single = runs
    hf_logits = next(c["hf_logits"] for c in cases if c["name"] == name)
    per_rank = [r[name] for r in stages]
    assert [r["layers"] for r in per_rank] == [[1, 2], [3], [4]]
    for r in per_rank:  # every stage yields the whole model's HF tensors, bit for bit
        assert r["names_equal"] and r["not_bit_equal"] == [], r
        assert r["num_buckets"] > 3 and r["max_live_bytes"] <= r["bound"], r
    assert per_rank[-1]["diff"] < LOGIT_TOL, per_rank[-1]["diff"]
    # The PP=3 dist checkpoint, loaded on one rank, gives the same logits.
    assert torch.equal(single[name], per_rank[-1]["logits"])
    assert float((single[name] - hf_logits).abs().max()) < LOGIT_TOL
