"""The real GPU placement (``megatron_rl.trainer.placement.Placement``) on Ray with fake GPUs.

Ray hands out GPU ids from ``num_gpus`` without touching a device, so the placement code runs as it
would on a GPU cluster; probe actors stand in for the Megatron ranks and the vLLM engines and report
where they landed (node, ``CUDA_VISIBLE_DEVICES``). Checks: rank ``g`` of every colocated role sees
GPU ``g`` (one role on 8 GPUs, five on 4); each engine's head sees exactly its GPUs on its node, as the plan's
engine map says, on one node and on a two-node cluster (``ray.cluster_utils.Cluster``, 2 x 4 GPUs):
TP=2 gives four engines, none spanning; TP=8 one engine over both nodes (a headless part on the second).
"""

from __future__ import annotations


import pytest

ray = pytest.importorskip("ray")

ROLES = ("actor", "ref", "critic", "reward", "teacher")


from megatron_rl.workers.probes import EngineProbe, HeadlessProbe, RankProbe  # noqa: E402


def _config(nodes, gpus_per_node, tp, trainer=None, algorithm=None, **rollout):
    from megatron_rl.config.run_config import RunConfig

    return RunConfig.from_dict(
        {
            "data": {"task": "toy_copy", "max_prompt_length": 48, "max_response_length": 8, "train_batch_size": 8},
            "actor_rollout_ref": {
                "model": {"path": "/nonexistent/model"},
                "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 1},
                "rollout": {"tensor_model_parallel_size": tp, "n": 2, **rollout},
            },
            "algorithm": {"adv_estimator": "grpo", **(algorithm or {})},
            "trainer": {
                "device": "cuda",
                "nnodes": nodes,
                "n_gpus_per_node": gpus_per_node,
                "logger": ["console"],
                "default_local_dir": "/tmp/megatron_rl_placement_probe",
                **(trainer or {}),
            },
        }
    )


def _specs(config, roles):
    from megatron_rl.workers.spec import WorkerSpec

    actor = config.actor_rollout_ref.actor
    return {role: WorkerSpec(role, actor.megatron, actor, hf_dir="/nonexistent/model") for role in roles}


def _place(config, roles):
    from megatron_rl.trainer.placement import Placement

    return Placement(
        config,
        _specs(config, roles),
        model_path="/nonexistent/model",
        role_worker_cls=RankProbe,
        rollout_worker_cls=EngineProbe,
        headless_cls=HeadlessProbe,
    )


def _node_names(placement):
    """Ray node id -> pool node index, as the placement sorted them."""
    return {node_id: index for index, node_id, _, _ in placement.bundles.gpus}


@pytest.fixture(scope="module")
def fake_gpus():
    ray.init(address="local", num_cpus=64, num_gpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# 2, 3 and 4 roles passed too (60-140 s each on 2 cores); five roles on a 4-GPU node hold the same property as
# on 8 (20 rank actors, not 40: each is a Ray process), one role keeps the 8-GPU node
@pytest.mark.parametrize("num_roles,gpus", [(1, 8), (5, 4)])
def test_colocated_roles_rank_i_on_gpu_i(fake_gpus, num_roles, gpus):
    """Every role's rank g sees GPU g (one bundle per GPU, shared); no two ranks of a role share a GPU."""
    config = _config(1, gpus, 2)
    placement = _place(config, ROLES[:num_roles])
    try:
        roles = {}
        for role, group in placement.groups.items():
            visible = [r["visible"] for r in group.ranks]
            ids = [r["gpu_ids"] for r in group.ranks]
            assert len(set(visible)) == gpus, (role, visible)  # distinct GPUs within the role
            roles[role] = visible
            assert [i[0] for i in ids] == [placement.bundles.gpu_id(g) for g in range(gpus)]
        assert len({tuple(v) for v in roles.values()}) == 1, roles  # rank g of every role on the same GPU g
        engines = ray.get([r.actor.where.remote() for r in placement.replicas])
        assert [e["visible"] for e in engines] == [
            ",".join(str(placement.bundles.gpu_id(g)) for g in (2 * r, 2 * r + 1)) for r in range(gpus // 2)
        ]
        first_role = next(iter(roles.values()))
        for r, e in enumerate(engines):  # engine r shares its GPUs with training ranks 2r, 2r+1
            assert e["visible"] == ",".join(first_role[2 * r : 2 * r + 2])
            assert e["slept"] == [1]  # started before the roles, then put to sleep (free_cache_engine)
        assert placement.started_asleep and placement.router is not None and len(placement.router) == gpus // 2
    finally:
        placement.shutdown()


def test_separate_pool_and_refusal(fake_gpus):
    """A separate rollout (2 GPUs of its own) gets its own bundles: its engines' GPUs are none of the
    trainer's and they are not put to sleep; a layout that does not divide is refused by key before any
    worker starts."""
    config = _config(
        1,
        4,
        1,
        trainer={"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 1}}},
        algorithm={"rollout_correction": {"bypass_mode": True}},
        nnodes=1,
        n_gpus_per_node=2,
        free_cache_engine=False,
    )
    placement = _place(config, ("actor",))
    try:
        trainer_gpus = {r["visible"] for r in placement.groups["actor"].ranks}
        engines = ray.get([r.actor.where.remote() for r in placement.replicas])
        assert len(trainer_gpus) == 4 and len(engines) == 2
        assert len({e["visible"] for e in engines}) == 2 and not ({e["visible"] for e in engines} & trainer_gpus)
        assert all(e["slept"] == [] for e in engines) and not placement.started_asleep
        assert [r.nodes for r in placement.replicas] == [(0,), (0,)]  # the pool's one node
    finally:
        placement.shutdown()
    bad = _config(
        1,
        4,
        2,
        trainer={"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 1}}},
        algorithm={"rollout_correction": {"bypass_mode": True}},
        nnodes=1,
        n_gpus_per_node=3,
        free_cache_engine=False,
    )
    with pytest.raises(ValueError, match="does not divide actor_rollout_ref.rollout.n_gpus_per_node=3"):
        _place(bad, ("actor",))


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the one-node fixture's fake-GPU Ray (module order)
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 32, "num_gpus": 4})
    cluster.add_node(num_cpus=32, num_gpus=4)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _check_engine_map(placement):
    """Each engine part's node and CUDA_VISIBLE_DEVICES equal the engine map's (node, GPU) pairs."""
    names = _node_names(placement)
    ids = {(placement.bundles.node_of(s), placement.bundles.gpu_id(s)) for s in range(8)}
    assert ids == {(n, g) for n in range(2) for g in range(4)}  # fake GPU ids 0-3 on each node
    for replica, engine in zip(placement.replicas, placement.engines.engines):
        parts = [ray.get(replica.actor.where.remote())] + [ray.get(h.where.remote()) for h in replica.headless]
        expected: dict[int, list[int]] = {}
        for node, gpu in engine:
            expected.setdefault(node, []).append(gpu)
        seen = {names[p["node"]]: [int(x) for x in p["visible"].split(",")] for p in parts}
        assert seen == expected, (replica.index, seen, expected)
        assert replica.gpus == engine
    return parts


def test_two_nodes_tp2_four_engines_none_spanning(two_nodes):
    config = _config(2, 4, 2)
    placement = _place(config, ("actor", "ref"))
    try:
        assert placement.engines.replicas == 4 and placement.engines.nodes_per_engine == 1
        _check_engine_map(placement)
        assert all(not r.headless for r in placement.replicas)
        for role, group in placement.groups.items():  # ranks 0-3 on node 0, 4-7 on node 1
            names = _node_names(placement)
            assert [names[r["node"]] for r in group.ranks] == [0] * 4 + [1] * 4, role
    finally:
        placement.shutdown()


def test_two_nodes_tp8_one_engine_spanning_both(two_nodes):
    config = _config(2, 4, 8)
    placement = _place(config, ("actor",))
    try:
        assert placement.engines.replicas == 1 and placement.engines.nodes_per_engine == 2
        parts = _check_engine_map(placement)
        head, headless = ray.get(placement.replicas[0].actor.where.remote()), parts[1]
        assert head["multi_node"]["nnodes"] == 2 and head["multi_node"]["node_rank"] == 0
        assert headless["multi_node"] == {**head["multi_node"], "node_rank": 1}
        assert head["multi_node"]["master_addr"] == placement.bundles.node_ip(0)
    finally:
        placement.shutdown()
