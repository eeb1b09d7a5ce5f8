"""The planner under an uneven pipeline split (``num_layers_in_first/last_pipeline_stage`` or
``account_for_embedding/loss_in_pipeline_split`` in ``megatron.override_transformer_config``): each stage
is counted with its own layers, checked against a hand calculation for Qwen3-235B-A22B (94 layers, which
PP=4 does not split evenly)."""

from __future__ import annotations

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.planner import KNOWN_ARCHITECTURES, count_params, estimate_role, plan_run

MEG = "actor_rollout_ref.actor.megatron"
SPLIT = [
    f"{MEG}.pipeline_model_parallel_size=4",
    f"{MEG}.expert_model_parallel_size=32",
    f"{MEG}.override_transformer_config.num_layers_in_first_pipeline_stage=23",
    f"{MEG}.override_transformer_config.num_layers_in_last_pipeline_stage=23",
]
# One Qwen3-235B layer on a TP=4, EP=32, ETP=1 rank: QKV (16 + 2 x 1 heads of 128) x 4096, the output
# projection 16 x 128 x 4096, two norms of 4096, q/k norms of 128, the router 128 x 4096 (replicated);
# routed experts: 128 / 32 = 4 experts of gate + up + down, 3 x 1536 x 4096.
DENSE_LAYER = 18 * 128 * 4096 + 16 * 128 * 4096 + 2 * 4096 + 2 * 128 + 128 * 4096
EXPERT_LAYER = 4 * 3 * 1536 * 4096
HEAD = 151936 // 4 * 4096 + 4096  # the output layer's vocabulary shard + the final norm
EMBED = 151936 // 4 * 4096


def test_stage_counts_by_hand():
    m = KNOWN_ARCHITECTURES["qwen3_235b_a22b"]
    split = (23, 24, 24, 23)
    stages = [count_params(m, tp=4, pp=4, ep=32, etp=1, stage=s, stage_layers=split) for s in range(4)]
    assert stages == [
        (23 * DENSE_LAYER + EMBED, 23 * EXPERT_LAYER),
        (24 * DENSE_LAYER, 24 * EXPERT_LAYER),
        (24 * DENSE_LAYER, 24 * EXPERT_LAYER),
        (23 * DENSE_LAYER + HEAD, 23 * EXPERT_LAYER),
    ]
    # The most loaded stage is the last (23 layers + head: 2.314 G) -- a middle stage has 2.253 G.
    assert count_params(m, tp=4, pp=4, ep=32, etp=1, stage_layers=split) == stages[3]
    with pytest.raises(
        ValueError,
        match=r"stage_layers=\[23, 24, 24\] must give each of the "
        r"pipeline_model_parallel_size=4 stages its layers, num_layers=94 in all",
    ):
        count_params(m, pp=4, stage_layers=(23, 24, 24))


def test_activations_follow_the_stage_layers():
    """Activations of stage s hold its own layers: more layers on the first stage (which also keeps the
    most micro-batches in flight under 1F1B) raise the estimate."""
    m = KNOWN_ARCHITECTURES["qwen3_235b_a22b"]
    kw = dict(tp=4, pp=4, ep=32, etp=1, micro_batch_size=1, seq_length=4096, num_microbatches=8)
    heavy_first = estimate_role(m, stage_layers=(32, 21, 21, 20), **kw)
    light_first = estimate_role(m, stage_layers=(20, 21, 21, 32), **kw)
    assert heavy_first.activation_bytes > light_first.activation_bytes
    # the first stage holds PP = 4 micro-batches of 32 vs 20 layers (+ one layer input each)
    ratio = heavy_first.activation_bytes / light_first.activation_bytes
    assert 1.4 < ratio < 1.6, ratio


def test_plan_of_an_uneven_split():
    """The 94-layer recipe at PP=4 is refused evenly, planned as 23 + 24 + 24 + 23 (verl's script style)."""
    with pytest.raises(ValueError, match=r"num_layers=94 is not divisible by pipeline_model_parallel_size=4"):
        plan_run(load_config("gpu/qwen3_235b_a22b_grpo", SPLIT[:2]))
    plan = plan_run(load_config("gpu/qwen3_235b_a22b_grpo", SPLIT))
    actor = plan.roles["actor"]
    assert (actor.params_dense, actor.params_expert) == (23 * DENSE_LAYER + HEAD, 23 * EXPERT_LAYER)
    assert actor.params_dense == 577_832_704 and actor.params_expert == 1_736_441_856
    bad = SPLIT[:3] + [f"{MEG}.override_transformer_config.num_layers_in_last_pipeline_stage=24"]
    with pytest.raises(ValueError, match=r"leave 47 of num_layers=94 layers for the 2 middle stage\(s\)"):
        plan_run(load_config("gpu/qwen3_235b_a22b_grpo", bad))


def test_deepseek_v3_split_keeps_global_layer_indices():
    """DeepSeek-V3 at PP=16 as 4 + 14 x 4 + 1 (verl's 80 GB script): stage 0 holds the 3 dense layers and
    one MoE layer, stage 15 the last MoE layer -- each stage's layers are counted by their global index."""
    m = KNOWN_ARCHITECTURES["deepseek_v3"]
    split = (4,) + (4,) * 14 + (1,)
    kw = dict(tp=1, pp=16, ep=8, etp=1, stage_layers=split)
    dense_layer, moe_layer = m.layer_params(0, tp=1, ep=8, etp=1), m.layer_params(3, tp=1, ep=8, etp=1)
    assert dense_layer[1] == 0 and moe_layer[1] > 0  # layers 0-2 dense, 3+ MoE
    embed = m.vocab_size * m.hidden_size
    assert count_params(m, stage=0, **kw) == (3 * dense_layer[0] + moe_layer[0] + embed, moe_layer[1])
    assert count_params(m, stage=1, **kw) == (4 * moe_layer[0], 4 * moe_layer[1])
    assert count_params(m, stage=15, **kw) == (moe_layer[0] + embed + m.hidden_size, moe_layer[1])


ACCOUNTED = SPLIT[:2] + [
    f"{MEG}.override_transformer_config.account_for_embedding_in_pipeline_split=True",
    f"{MEG}.override_transformer_config.account_for_loss_in_pipeline_split=True",
]


def test_plan_with_embedding_and_loss_counted_as_layers():
    """Megatron's account_for_embedding/loss_in_pipeline_split (verl's Qwen3-235B script): 94 + 2 = 96 over
    PP=4 is 24 per stage, the first and last building 23 decoder layers -- the same stages as 23 + 24 + 24 + 23
    set by count, so the same most loaded stage (the last: 23 layers + head). One flag alone, 95 over PP=4,
    is refused with the key named."""
    plan = plan_run(load_config("gpu/qwen3_235b_a22b_grpo", ACCOUNTED))
    actor = plan.roles["actor"]
    assert (actor.params_dense, actor.params_expert) == (23 * DENSE_LAYER + HEAD, 23 * EXPERT_LAYER)
    by_count = plan_run(load_config("gpu/qwen3_235b_a22b_grpo", SPLIT)).roles["actor"]
    assert actor.activation_bytes == by_count.activation_bytes
    with pytest.raises(
        ValueError,
        match=r"override_transformer_config.account_for_embedding_in_pipeline_split=True "
        r"counts the embedding as a layer: num_layers \+ 1 = 95 is not divisible by "
        r"pipeline_model_parallel_size=4",
    ):
        plan_run(load_config("gpu/qwen3_235b_a22b_grpo", ACCOUNTED[:3]))
