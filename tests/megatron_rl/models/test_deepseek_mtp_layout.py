"""MTP and pipeline layouts (issue 20, bad input "MTP with a PP layout that cannot place the shared
embedding"). The checkpoint's MTP layers are side data, never placed on a stage, so every PP / VPP
layout converts and trains (the FP8 round trip of test_deepseek_fp8_export.py runs at PP=2 with an
MTP layer); what would make Megatron-Core place an MTP block and its word-embedding replica on a
stage -- ``mtp_num_layers`` / ``mtp_loss_scaling_factor`` or a ``pipeline_model_parallel_layout``
with ``m`` stages in ``megatron.override_transformer_config`` -- is refused by name, with the value
and what is allowed, before the model is built.
"""

from __future__ import annotations

import pytest

from parallel.config import ParallelConfig
from parallel.testing import run_distributed

PP2 = ParallelConfig(pipeline_model_parallel_size=2)
KEY = "megatron.override_transformer_config"


@pytest.mark.parametrize(
    "parallel,overrides,message",
    [
        (
            ParallelConfig(),
            {"mtp_num_layers": 1},
            f"{KEY}.mtp_num_layers=1 is not allowed: the Megatron model builds no multi-token-prediction block",
        ),
        (
            PP2,
            {"mtp_num_layers": 2},
            "at pipeline_model_parallel_size=2 Megatron-Core would expect the block and a replica of the shared word "
            "embedding on the last stage",
        ),
        (
            PP2,
            {"mtp_loss_scaling_factor": 0.3},
            f"{KEY}.mtp_loss_scaling_factor=0.3 is not allowed: the Megatron model builds no multi-token-prediction block",
        ),
        (
            PP2,
            {"pipeline_model_parallel_layout": "Et|tmL"},
            f"{KEY}.pipeline_model_parallel_layout='Et|tmL' places MTP layers ('m') on pipeline stage(s) [1] of "
            "pipeline_model_parallel_size=2",
        ),
        (
            ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            {"pipeline_model_parallel_layout": "E|t|t|mL"},
            "on pipeline stage(s) [3] of pipeline_model_parallel_size=2",
        ),
        (
            PP2,
            {"pipeline_model_parallel_layout": [["embedding", "decoder"], ["decoder", "mtp", "loss"]]},
            "places MTP layers ('m') on pipeline stage(s) [1]",
        ),
    ],
)
def test_layouts_that_would_place_mtp_are_refused_by_name(parallel, overrides, message):
    from parallel.bridge.mtp import check_mtp_layout

    with pytest.raises(ValueError) as err:
        check_mtp_layout(parallel, overrides)
    assert message in str(err.value) and "Allowed: " in str(err.value)


@pytest.mark.parametrize(
    "parallel,overrides",
    [
        (ParallelConfig(), None),
        (PP2, {"mtp_num_layers": None, "recompute_granularity": "full"}),
        (PP2, {"mtp_num_layers": 0}),
        (ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), {}),
        (PP2, {"pipeline_model_parallel_layout": "Et|tL"}),
    ],
)
def test_layouts_without_an_mtp_block_are_allowed(parallel, overrides):
    from parallel.bridge.mtp import check_mtp_layout

    check_mtp_layout(parallel, overrides)


def _engine_error(rank, world_size, overrides):
    import megatron_rl.engine.engine as engine_module
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine.engine import MegatronEngine
    from parallel.mesh import init_mesh

    built = []  # records whether the engine got as far as a TransformerConfig (then the model)
    original = engine_module.build_transformer_config
    engine_module.build_transformer_config = lambda *a, **k: built.append(1) or original(*a, **k)
    mesh = init_mesh(ParallelConfig(pipeline_model_parallel_size=world_size), seed=1)
    try:
        MegatronEngine(
            ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64),
            mesh,
            transformer_overrides=overrides,
        )
    except ValueError as exc:
        return str(exc), len(built)
    return None, len(built)


def test_engine_refuses_mtp_overrides_before_building():
    """The trainer's path (workers build a MegatronEngine from ``megatron.override_transformer_config``):
    the engine refuses ``mtp_num_layers`` before a TransformerConfig or model exists."""
    results = run_distributed(_engine_error, 1, {"mtp_num_layers": 1}, timeout_s=300)
    for message, built in results:
        assert message is not None and f"{KEY}.mtp_num_layers=1 is not allowed" in message and built == 0
