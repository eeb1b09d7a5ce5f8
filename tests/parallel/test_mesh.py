"""ParallelConfig validation (no process group touched) and init_mesh on spawned gloo ranks.

Group membership is checked against ranks computed here from Megatron's documented order
``tp-cp-ep-dp-pp`` (dense: r = tp + TP*(cp + CP*(dp + DP*pp)); experts:
r = etp + ETP*(ep + EP*(edp + EDP*pp))), independently of Megatron's RankGenerator.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from parallel.config import ParallelConfig
from parallel.testing import run_distributed

# ---------------------------------------------------------------------------------------------
# Validation: exact messages, nothing initialised.
# ---------------------------------------------------------------------------------------------
INVALID_LAYOUTS = [
    (
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        6,
        {},
        "world_size=6 is not divisible by tensor_model_parallel_size * pipeline_model_parallel_size * "
        "context_parallel_size = 2*2*1 = 4",
    ),
    (
        dict(tensor_model_parallel_size=3, context_parallel_size=2),
        8,
        {},
        "world_size=8 is not divisible by tensor_model_parallel_size * pipeline_model_parallel_size * "
        "context_parallel_size = 3*1*2 = 6",
    ),
    (
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=3),
        8,
        {},
        "expert_model_parallel_size * expert_tensor_parallel_size = 3*2 = 6 does not divide the 8 ranks of a "
        "pipeline stage (world_size=8 / pipeline_model_parallel_size=1)",
    ),
    (
        dict(pipeline_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
        4,
        {},
        "expert_model_parallel_size * expert_tensor_parallel_size = 4*1 = 4 does not divide the 2 ranks of a "
        "pipeline stage (world_size=4 / pipeline_model_parallel_size=2)",
    ),
    (
        dict(tensor_model_parallel_size=4),
        4,
        dict(num_attention_heads=6),
        "num_attention_heads=6 is not divisible by tensor_model_parallel_size=4",
    ),
    (
        dict(tensor_model_parallel_size=4),
        4,
        dict(num_attention_heads=12, num_query_groups=6),
        "num_query_groups=6 must be a multiple or a divisor of tensor_model_parallel_size=4",
    ),
    (
        dict(tensor_model_parallel_size=2),
        2,
        dict(num_attention_heads=8, num_query_groups=6),
        "num_attention_heads=8 is not divisible by num_query_groups=6",
    ),
    (
        dict(pipeline_model_parallel_size=4),
        4,
        dict(num_layers=6),
        "num_layers=6 is not divisible by pipeline_model_parallel_size=4",
    ),
    (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        2,
        dict(num_layers=6),
        "num_layers=6 is not divisible by pipeline_model_parallel_size * virtual_pipeline_model_parallel_size "
        "= 2*2 = 4",
    ),
    (
        dict(expert_model_parallel_size=4),
        4,
        dict(num_experts=6),
        "num_experts=6 is not divisible by expert_model_parallel_size=4",
    ),
    (
        dict(context_parallel_size=2),
        2,
        dict(seq_length=6),
        "seq_length=6 is not divisible by 2 * context_parallel_size = 4",
    ),
    (
        dict(tensor_model_parallel_size=4),
        4,
        dict(seq_length=6, sequence_parallel=True),
        "seq_length=6 is not divisible by tensor_model_parallel_size * context_parallel_size = 4 "
        "(sequence_parallel=True)",
    ),
    (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        2,
        dict(num_microbatches=3),
        "num_microbatches=3 is not divisible by pipeline_model_parallel_size=2 (interleaved schedule, "
        "virtual_pipeline_model_parallel_size=2)",
    ),
    (dict(), 0, {}, "world_size=0 is not allowed; it must be an int >= 1"),
    (dict(), 4, dict(num_layers=0), "num_layers=0 is not allowed; it must be an int >= 1"),
]


@pytest.mark.parametrize("layout, world_size, model_dims, message", INVALID_LAYOUTS)
def test_invalid_layout_raises_naming_the_numbers(layout, world_size, model_dims, message):
    config = ParallelConfig(**layout)
    with pytest.raises(ValueError) as info:
        config.validate(world_size, **model_dims)
    assert str(info.value) == message
    assert not dist.is_initialized()


INVALID_FIELDS = [
    (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size=0 is not allowed; it must be an int >= 1"),
    (dict(pipeline_model_parallel_size=1.5), "pipeline_model_parallel_size=1.5 is not allowed; it must be an int >= 1"),
    (dict(context_parallel_size=True), "context_parallel_size=True is not allowed; it must be an int >= 1"),
    (dict(expert_tensor_parallel_size=0), "expert_tensor_parallel_size=0 is not allowed; it must be an int >= 1"),
    (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1),
        "virtual_pipeline_model_parallel_size=1 is not allowed; it must be None (no interleaving) or an int >= 2",
    ),
    (
        dict(virtual_pipeline_model_parallel_size=2),
        "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1, "
        "got pipeline_model_parallel_size=1",
    ),
]


@pytest.mark.parametrize("fields, message", INVALID_FIELDS)
def test_invalid_field_raises_on_construction(fields, message):
    with pytest.raises(ValueError) as info:
        ParallelConfig(**fields)
    assert str(info.value) == message


def test_sizes_and_valid_layout():
    config = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    sizes = config.validate(
        16, num_layers=8, num_attention_heads=8, num_query_groups=2, num_experts=8, seq_length=64, num_microbatches=4
    )
    assert sizes == {"world": 16, "tp": 2, "pp": 2, "vpp": 2, "cp": 1, "dp": 4, "ep": 4, "etp": 1, "expert_dp": 2}
    # Query groups may divide TP (Megatron replicates KV heads then), as in Megatron's own check.
    tp4 = ParallelConfig(tensor_model_parallel_size=4)
    assert tp4.validate(4, num_attention_heads=8, num_query_groups=2)["dp"] == 1
    assert ParallelConfig(tensor_model_parallel_size=2).effective_expert_tensor_parallel_size == 2
    assert ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2).model_parallel_size == 4


def test_from_dict_accepts_dictconfig_and_rejects_unknown_keys():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"tensor_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None})
    config = ParallelConfig.from_dict(cfg)
    assert config == ParallelConfig(tensor_model_parallel_size=2)
    assert config.get("tensor_model_parallel_size") == 2 and config["context_parallel_size"] == 1
    with pytest.raises(ValueError) as info:
        ParallelConfig.from_dict({"tp": 2})
    assert str(info.value) == (
        "unknown parallel config keys ['tp']; allowed keys: ['context_parallel_size', "
        "'expert_model_parallel_size', 'expert_tensor_parallel_size', 'pipeline_model_parallel_size', "
        "'tensor_model_parallel_size', 'virtual_pipeline_model_parallel_size']"
    )


def test_init_mesh_rejects_invalid_layout_before_creating_any_group(monkeypatch):
    from parallel.mesh import init_mesh

    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun would set it; no rendezvous is attempted
    with pytest.raises(ValueError) as info:
        init_mesh(ParallelConfig(tensor_model_parallel_size=4), num_attention_heads=6)
    assert str(info.value) == "num_attention_heads=6 is not divisible by tensor_model_parallel_size=4"
    with pytest.raises(ValueError) as info:
        init_mesh({"pipeline_model_parallel_size": 3})
    assert str(info.value).startswith("world_size=4 is not divisible by")
    assert not dist.is_initialized()
    import sys

    if "megatron.core.parallel_state" in sys.modules:
        assert not sys.modules["megatron.core.parallel_state"].model_parallel_is_initialized()


# ---------------------------------------------------------------------------------------------
# Real groups on spawned gloo ranks.
# ---------------------------------------------------------------------------------------------
def _expected_groups(world, tp=1, pp=1, cp=1, ep=1, etp=None):
    """Global ranks of every group for every rank, from Megatron's order tp-cp-ep-dp-pp."""
    etp = etp or tp
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    dense = {r: (r % tp, r // tp % cp, r // (tp * cp) % dp, r // (tp * cp * dp)) for r in range(world)}
    expert = {r: (r % etp, r // etp % ep, r // (etp * ep) % edp, r // (etp * ep * edp)) for r in range(world)}

    def members(coords, rank, vary):  # ranks equal to `rank` outside the dims in `vary`
        return [r for r in range(world) if all(coords[r][i] == coords[rank][i] for i in range(4) if i not in vary)]

    out = {}
    for r in range(world):
        pp_ranks = members(dense, r, {3})
        out[r] = {
            "tp": members(dense, r, {0}),
            "cp": members(dense, r, {1}),
            "dp": members(dense, r, {2}),
            "pp": pp_ranks,
            "dp_cp": members(dense, r, {1, 2}),
            "mp": members(dense, r, {0, 3}),
            "etp": members(expert, r, {0}),
            "ep": members(expert, r, {1}),
            "expert_dp": members(expert, r, {2}),
            "embd": sorted({pp_ranks[0], pp_ranks[-1]}) if r in (pp_ranks[0], pp_ranks[-1]) else [],
        }
    return out


LAYOUTS_4 = [
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    dict(tensor_model_parallel_size=2),
    dict(expert_model_parallel_size=2),
    dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    dict(context_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
    dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
]
_SORTED = ("dp_cp", "mp", "embd")  # multi-dimensional groups: compare membership, not order


def _mesh_groups(rank, world_size, layouts):
    import warnings

    warnings.simplefilter("ignore")
    from megatron.core import parallel_state

    from parallel.mesh import destroy_mesh, init_mesh

    out = []
    for layout in layouts:
        mesh = init_mesh(layout)
        names = ("tp", "pp", "dp", "cp", "dp_cp", "ep", "etp", "expert_dp", "mp", "embd")
        groups = {n: mesh.ranks(n) for n in names}
        pgc = mesh.pg_collection
        out.append(
            {
                "groups": groups,
                "sizes": mesh.sizes(),
                "coords": (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.ep_rank),
                "stages": (mesh.is_first_pp_stage, mesh.is_last_pp_stage),
                "pgc_same": (
                    pgc.tp is mesh.tp_group,
                    pgc.pp is mesh.pp_group,
                    pgc.dp is mesh.dp_group,
                    pgc.cp is mesh.cp_group,
                    pgc.ep is mesh.ep_group,
                    pgc.dp_cp is mesh.dp_cp_group,
                    pgc.expt_tp is mesh.etp_group,
                    pgc.expt_dp is mesh.expert_dp_group,
                ),
                "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            }
        )
        destroy_mesh(mesh)
    return out


def test_group_ranks_on_4_ranks():
    results = run_distributed(_mesh_groups, 4, LAYOUTS_4, timeout_s=240)
    for i, layout in enumerate(LAYOUTS_4):
        config = ParallelConfig(**layout)
        expected = _expected_groups(
            4,
            config.tensor_model_parallel_size,
            config.pipeline_model_parallel_size,
            config.context_parallel_size,
            config.expert_model_parallel_size,
            config.expert_tensor_parallel_size,
        )
        for rank in range(4):
            got = results[rank][i]
            groups = {n: sorted(v) if n in _SORTED else v for n, v in got["groups"].items()}
            assert groups == expected[rank], (layout, rank)
            e = expected[rank]
            assert got["coords"] == (
                e["tp"].index(rank),
                e["pp"].index(rank),
                e["dp"].index(rank),
                e["cp"].index(rank),
                e["ep"].index(rank),
            ), (layout, rank)
            assert got["stages"] == (e["pp"][0] == rank, e["pp"][-1] == rank)
            assert got["sizes"] == config.sizes(4)
            assert all(got["pgc_same"]), (layout, rank)
            assert got["vpp"] == config.virtual_pipeline_model_parallel_size
    # Spot-check the formula itself on the first layout (TP=2 x PP=2): stages are {0,1} and {2,3}.
    assert [results[r][0]["groups"]["tp"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [results[r][0]["groups"]["pp"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _mesh_lifecycle(rank, world_size, seed):
    import warnings

    warnings.simplefilter("ignore")
    from megatron.core import tensor_parallel

    from parallel.mesh import destroy_mesh, init_mesh

    out = {}
    mesh = init_mesh({"tensor_model_parallel_size": 2}, seed=seed)
    # init_mesh seeded Megatron's tracker: the default stream restarts from `seed`, the TP region
    # from seed + 2718 + tp_rank (Megatron's offsets), on the CPU generator.
    default_draw = torch.rand(3)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(3)
    out["draws"] = (default_draw, tp_draw)
    try:
        init_mesh({"tensor_model_parallel_size": 2})
    except RuntimeError as exc:
        out["double_init"] = str(exc)
    try:
        init_mesh({"tensor_model_parallel_size": 2}, backend="nccl")
    except ValueError as exc:
        out["backend"] = str(exc)
    destroy_mesh(mesh)

    # Without a default group, init_mesh creates it from the environment and destroy_mesh ends it.
    # A fresh rendezvous port: the old store may still hold MASTER_PORT while it shuts down.
    import os

    from parallel.testing import find_free_port

    port = torch.tensor([find_free_port() if rank == 0 else 0])
    dist.broadcast(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port.item())
    mesh = init_mesh({"pipeline_model_parallel_size": 2}, seed=seed)
    out["owned"] = (mesh.owns_default_group, dist.get_backend(), mesh.ranks("pp"), mesh.describe())
    destroy_mesh(mesh)
    out["after_destroy"] = dist.is_initialized()
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-backed RNG tracker (cpu_compat)")
def test_mesh_seeds_rng_rejects_double_init_and_owns_group_it_creates():
    seed = 77
    results = run_distributed(_mesh_lifecycle, 2, seed, timeout_s=180)
    for rank, got in enumerate(results):
        torch.manual_seed(seed)
        assert torch.equal(got["draws"][0], torch.rand(3))
        torch.manual_seed(seed + 2718 + rank)  # tp_rank == rank at TP=2
        assert torch.equal(got["draws"][1], torch.rand(3))
        assert got["double_init"] == "Megatron parallel state is already initialised; call destroy_mesh() first"
        assert got["backend"] == "backend='nccl' but torch.distributed is already initialised with 'gloo'"
        assert got["owned"] == (True, "gloo", [0, 1], f"rank {rank}/2: tp 0/1 pp {rank}/2 cp 0/1 dp 0/1 ep 0/1")
        assert got["after_destroy"] is False
    assert not torch.equal(results[0]["draws"][1], results[1]["draws"][1])  # TP ranks draw differently


def test_expected_groups_formula_matches_hand_written_layout():
    # TP=2, CP=2 on 8 ranks (DP=2): rank 5 = tp 1, cp 0, dp 1.
    groups = _expected_groups(8, tp=2, cp=2)[5]
    assert groups["tp"] == [4, 5] and groups["cp"] == [5, 7] and groups["dp"] == [1, 5]
    assert groups["dp_cp"] == [1, 3, 5, 7] and groups["mp"] == [4, 5]
    assert list(itertools.chain(*(_expected_groups(2, pp=2)[r]["embd"] for r in range(2)))) == [0, 1, 0, 1]
