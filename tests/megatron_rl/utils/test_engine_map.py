"""Rollout replica arithmetic (``megatron_rl.utils.engine_map``): replica counts, node spans, no GPU
used twice and every refusal's exact message, over cluster shapes from 1 to 32 nodes."""

import json

import pytest

from megatron_rl.utils.engine_map import engine_map

# (nodes, gpus_per_node, tp, dp, pp, ep, colocated) -> (replicas, nodes_per_engine)
SHAPES = [
    (1, 4, 1, 1, 1, 1, True, 4, 1),
    (1, 4, 2, 1, 1, 1, True, 2, 1),
    (1, 4, 4, 1, 1, 1, True, 1, 1),
    (1, 8, 1, 1, 1, 1, True, 8, 1),
    (1, 8, 2, 1, 1, 1, True, 4, 1),
    (1, 8, 4, 1, 1, 1, True, 2, 1),
    (1, 8, 8, 1, 1, 1, True, 1, 1),
    (2, 4, 2, 1, 1, 1, True, 4, 1),
    (2, 4, 8, 1, 1, 1, True, 1, 2),
    (2, 4, 4, 1, 1, 1, True, 2, 1),
    (2, 8, 8, 1, 1, 1, True, 2, 1),
    (2, 8, 16, 1, 1, 1, True, 1, 2),
    (4, 8, 4, 1, 1, 1, True, 8, 1),
    (4, 8, 8, 1, 1, 1, True, 4, 1),
    (4, 8, 16, 1, 1, 1, True, 2, 2),
    (4, 4, 16, 1, 1, 1, True, 1, 4),
    (8, 8, 8, 1, 1, 1, True, 8, 1),
    (8, 8, 16, 1, 1, 1, True, 4, 2),
    (16, 8, 8, 1, 1, 1, True, 16, 1),
    (16, 8, 16, 1, 1, 1, True, 8, 2),
    (32, 8, 8, 1, 1, 1, True, 32, 1),
    (32, 8, 16, 1, 1, 1, True, 16, 2),
    (32, 4, 16, 1, 1, 1, True, 8, 4),
    (1, 8, 2, 2, 1, 4, True, 2, 1),  # EP = TP x DP
    (2, 8, 4, 2, 1, 8, True, 2, 1),
    (4, 8, 8, 2, 1, 16, True, 2, 2),  # DeepSeek-style TP=8 DP=2 EP=16 spans two nodes
    (1, 8, 2, 1, 2, 1, True, 2, 1),  # PP inside the engine
    (2, 4, 2, 1, 4, 1, True, 1, 2),
    (1, 8, 4, 1, 2, 1, True, 1, 1),
    (1, 4, 1, 1, 1, 1, False, 4, 1),  # separate pools
    (2, 8, 8, 1, 1, 1, False, 2, 1),
    (2, 8, 16, 1, 1, 1, False, 1, 2),
    (4, 4, 4, 1, 1, 1, False, 4, 1),
    (3, 8, 8, 1, 1, 1, True, 3, 1),
    (6, 4, 8, 1, 1, 1, True, 3, 2),
]


@pytest.mark.parametrize("nodes,gpn,tp,dp,pp,ep,colocated,replicas,span", SHAPES)
def test_engine_map_shapes(nodes, gpn, tp, dp, pp, ep, colocated, replicas, span):
    first = 5 if not colocated else 0
    m = engine_map(tp=tp, dp=dp, pp=pp, ep=ep, nodes=nodes, gpus_per_node=gpn, colocated=colocated, first_node=first)
    assert (m.replicas, m.nodes_per_engine, m.engine_gpus) == (replicas, span, tp * dp * pp)
    used = [pair for engine in m.engines for pair in engine]
    assert len(used) == len(set(used)) == nodes * gpn  # every GPU once, none twice
    assert set(used) == {(first + n, g) for n in range(nodes) for g in range(gpn)}
    for r, engine in enumerate(m.engines):
        engine_nodes = sorted({n for n, _ in engine})
        assert len(engine_nodes) == span  # inside one node, or whole nodes
        if span == 1:
            gpus = [g for _, g in engine]
            assert gpus == list(range(gpus[0], gpus[0] + m.engine_gpus))  # consecutive GPUs of one node
        else:
            assert engine == tuple((n, g) for n in engine_nodes for g in range(gpn))  # whole nodes
        assert list(m.training_ranks(r)) == (
            list(range(r * m.engine_gpus, (r + 1) * m.engine_gpus)) if colocated else []
        )


def test_engine_map_json_and_text():
    m = engine_map(tp=2, nodes=2, gpus_per_node=4)
    assert json.loads(json.dumps(m.to_json())) == {
        "engine_gpus": 2,
        "replicas": 4,
        "nodes_per_engine": 1,
        "engines": [[[0, 0], [0, 1]], [[0, 2], [0, 3]], [[1, 0], [1, 1]], [[1, 2], [1, 3]]],
    }
    assert m.describe()[2] == "engine 2: node 1 GPUs 0-1 (shared with training ranks 4-5 of every role)"
    big = engine_map(tp=8, nodes=2, gpus_per_node=4)
    assert big.to_json()["engines"] == [[[0, g] for g in range(4)] + [[1, g] for g in range(4)]]
    assert big.describe() == [
        "engine 0: node 0 GPUs 0-3, node 1 GPUs 0-3 (shared with training ranks 0-7 of every role)"
    ]
    sep = engine_map(tp=1, nodes=1, gpus_per_node=2, colocated=False, first_node=3)
    assert sep.describe() == ["engine 0: node 3 GPU 0 (own pool)", "engine 1: node 3 GPU 1 (own pool)"]
    many = engine_map(tp=1, nodes=2, gpus_per_node=8)
    assert len(many.describe()) == 9 and many.describe()[-1] == "... +8 more engines"


R = "actor_rollout_ref.rollout"
REFUSALS = [
    (
        dict(tp=3, nodes=1, gpus_per_node=8),
        f"an engine of 3 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
        "3x1x1) does not divide trainer.n_gpus_per_node=8: an engine no larger than a node stays inside one node; use "
        "an engine size dividing 8",
    ),
    (
        dict(tp=2, dp=3, nodes=1, gpus_per_node=8),
        f"an engine of 6 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
        "2x3x1) does not divide trainer.n_gpus_per_node=8: an engine no larger than a node stays inside one node; use "
        "an engine size dividing 8",
    ),
    (
        dict(tp=12, nodes=2, gpus_per_node=8),
        f"an engine of 12 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
        "12x1x1) is larger than a node of trainer.n_gpus_per_node=8 GPUs but not a multiple of it: an engine larger "
        "than a node spans whole nodes",
    ),
    (
        dict(tp=16, nodes=3, gpus_per_node=8),
        f"an engine of 16 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
        "16x1x1) spans 2 whole nodes, which does not divide trainer.nnodes=3",
    ),
    (
        dict(tp=16, nodes=1, gpus_per_node=8),
        f"an engine of 16 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
        "16x1x1) spans 2 whole nodes, which does not divide trainer.nnodes=1",
    ),
    (
        dict(tp=4, dp=2, ep=4, nodes=1, gpus_per_node=8),
        f"{R}.expert_parallel_size=4 must equal tensor_model_parallel_size x data_parallel_size = 4x2 = 8 (vLLM's "
        "expert parallelism spans the engine's TP x DP ranks, as verl requires), or be 1",
    ),
    (dict(tp=0, nodes=1, gpus_per_node=8), f"{R}.tensor_model_parallel_size=0 must be an integer >= 1"),
    (dict(tp=1, pp=0, nodes=1, gpus_per_node=8), f"{R}.pipeline_model_parallel_size=0 must be an integer >= 1"),
    (
        dict(tp=1, nodes=0, gpus_per_node=8, nodes_key=f"{R}.nnodes"),
        f"{R}.nnodes=0: the rollout's pool needs at least one node of one GPU",
    ),
    (
        dict(tp=8, nodes=1, gpus_per_node=4, nodes_key=f"{R}.nnodes", gpus_key=f"{R}.n_gpus_per_node"),
        f"an engine of 8 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
        f"8x1x1) spans 2 whole nodes, which does not divide {R}.nnodes=1",
    ),
]


@pytest.mark.parametrize("kwargs,message", REFUSALS)
def test_engine_map_refusals(kwargs, message):
    with pytest.raises(ValueError) as err:
        engine_map(**kwargs)
    assert str(err.value) == message


def test_engine_weight_share_per_gpu_counts_rollout_expert_parallelism():
    """Dense weights are TP x PP-sharded in every DP rank of an engine; routed experts too, unless vLLM's
    expert parallelism (EP = TP x DP) spreads them over the engine's EP x PP GPUs."""
    from megatron_rl.utils.engine_map import engine_weight_bytes_per_gpu

    assert engine_weight_bytes_per_gpu(1000, 800, tp=2, dp=2) == 100 + 400  # no EP: each DP rank a full copy
    assert engine_weight_bytes_per_gpu(1000, 800, tp=2, dp=2, ep=4) == 100 + 200
    assert engine_weight_bytes_per_gpu(1000, 800, tp=2, dp=2, pp=2, ep=4) == 50 + 100
    assert engine_weight_bytes_per_gpu(1000, 0, tp=4, dp=2, ep=8) == 250  # dense: EP changes nothing
    with pytest.raises(ValueError, match=r"expert_bytes=1200 must lie in \[0, total_bytes=1000\]"):
        engine_weight_bytes_per_gpu(1000, 1200, tp=1)


def test_plan_weight_sync_phase_holds_the_ep_share_of_the_experts():
    """``megatron-rl plan`` on Qwen3-30B-A3B, rollout TP=2 x DP=2: with EP=4 an engine GPU holds a quarter of
    the routed experts, not the half each DP rank would hold without it (weight-sync phase, weights awake)."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.planner import plan_run
    from megatron_rl.planner.memory import count_params

    base = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.data_parallel_size=2"]
    no_ep = plan_run(load_config("gpu/qwen3_30b_a3b_grpo", base))
    ep = plan_run(load_config("gpu/qwen3_30b_a3b_grpo", [*base, "actor_rollout_ref.rollout.expert_parallel_size=4"]))
    dense, expert = count_params(no_ep.model)
    assert no_ep.phases["weight sync"]["vllm weights"] == (dense + expert) * 2 // 2  # bf16, TP=2
    assert ep.phases["weight sync"]["vllm weights"] == dense * 2 // 2 + expert * 2 // 4
