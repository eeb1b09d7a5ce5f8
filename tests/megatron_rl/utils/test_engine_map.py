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
    (1, 8, 2, 2, 1, 4, True, 2, 1),        # EP = TP x DP
    (2, 8, 4, 2, 1, 8, True, 2, 1),
    (4, 8, 8, 2, 1, 16, True, 2, 2),      # DeepSeek-style TP=8 DP=2 EP=16 spans two nodes
    (1, 8, 2, 1, 2, 1, True, 2, 1),        # PP inside the engine
    (2, 4, 2, 1, 4, 1, True, 1, 2),
    (1, 8, 4, 1, 2, 1, True, 1, 1),
    (1, 4, 1, 1, 1, 1, False, 4, 1),       # separate pools
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
        assert list(m.training_ranks(r)) == (list(range(r * m.engine_gpus, (r + 1) * m.engine_gpus))
                                             if colocated else [])


def test_engine_map_json_and_text():
    m = engine_map(tp=2, nodes=2, gpus_per_node=4)
    assert json.loads(json.dumps(m.to_json())) == {
        "engine_gpus": 2, "replicas": 4, "nodes_per_engine": 1,
        "engines": [[[0, 0], [0, 1]], [[0, 2], [0, 3]], [[1, 0], [1, 1]], [[1, 2], [1, 3]]]}
    assert m.describe()[2] == "engine 2: node 1 GPUs 0-1 (shared with training ranks 4-5 of every role)"
    big = engine_map(tp=8, nodes=2, gpus_per_node=4)
    assert big.to_json()["engines"] == [[[0, g] for g in range(4)] + [[1, g] for g in range(4)]]
    assert big.describe() == ["engine 0: node 0 GPUs 0-3, node 1 GPUs 0-3 (shared with training ranks 0-7 of "
                              "every role)"]
    sep = engine_map(tp=1, nodes=1, gpus_per_node=2, colocated=False, first_node=3)
    assert sep.describe() == ["engine 0: node 3 GPU 0 (own pool)", "engine 1: node 3 GPU 1 (own pool)"]
    many = engine_map(tp=1, nodes=2, gpus_per_node=8)
    assert len(many.describe()) == 9 and many.describe()[-1] == "... +8 more engines"


R = "actor_rollout_ref.rollout"
REFUSALS = [
    (dict(tp=3, nodes=1, gpus_per_node=8),
     f"an engine of 3 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
     "3x1x1) does not divide trainer.n_gpus_per_node=8: an engine no larger than a node stays inside one node; use "
     "an engine size dividing 8"),
    (dict(tp=2, dp=3, nodes=1, gpus_per_node=8),
     f"an engine of 6 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
     "2x3x1) does not divide trainer.n_gpus_per_node=8: an engine no larger than a node stays inside one node; use "
     "an engine size dividing 8"),
    (dict(tp=12, nodes=2, gpus_per_node=8),
     f"an engine of 12 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
     "12x1x1) is larger than a node of trainer.n_gpus_per_node=8 GPUs but not a multiple of it: an engine larger "
     "than a node spans whole nodes"),
    (dict(tp=16, nodes=3, gpus_per_node=8),
     f"an engine of 16 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
     "16x1x1) spans 2 whole nodes, which does not divide trainer.nnodes=3"),
    (dict(tp=16, nodes=1, gpus_per_node=8),
     f"an engine of 16 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
     "16x1x1) spans 2 whole nodes, which does not divide trainer.nnodes=1"),
    (dict(tp=4, dp=2, ep=4, nodes=1, gpus_per_node=8),
     f"{R}.expert_parallel_size=4 must equal tensor_model_parallel_size x data_parallel_size = 4x2 = 8 (vLLM's "
     "expert parallelism spans the engine's TP x DP ranks, as verl requires), or be 1"),
    (dict(tp=0, nodes=1, gpus_per_node=8), f"{R}.tensor_model_parallel_size=0 must be an integer >= 1"),
    (dict(tp=1, pp=0, nodes=1, gpus_per_node=8), f"{R}.pipeline_model_parallel_size=0 must be an integer >= 1"),
    (dict(tp=1, nodes=0, gpus_per_node=8, nodes_key=f"{R}.nnodes"),
     f"{R}.nnodes=0: the rollout's pool needs at least one node of one GPU"),
    (dict(tp=8, nodes=1, gpus_per_node=4, nodes_key=f"{R}.nnodes", gpus_key=f"{R}.n_gpus_per_node"),
     f"an engine of 8 GPUs ({R}.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
     f"8x1x1) spans 2 whole nodes, which does not divide {R}.nnodes=1"),
]


@pytest.mark.parametrize("kwargs,message", REFUSALS)
def test_engine_map_refusals(kwargs, message):
    with pytest.raises(ValueError) as err:
        engine_map(**kwargs)
    assert str(err.value) == message
