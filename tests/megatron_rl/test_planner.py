"""The dry-run planner: memory estimate vs measured, GPU recipes accepted, bad layouts refused.

Measured memory (``tools/measure_memory.py``): the peak of *live tensor-storage bytes* on each
rank during one steady-state actor step (forward + backward + Adam step, after a warm-up step
that creates the optimizer state), tracked op by op with a ``TorchDispatchMode`` and weak
references to the storages. Parameters, Megatron's gradient buffer and optimizer state are
registered before the step. RSS is not used: on CPU it mixes allocator caching and Python
objects. The model (~5.3 M params, sequence 256) makes every term tens of MB.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.config.model import ModelConfig
from megatron_rl.planner import KNOWN_ARCHITECTURES, check_plan, count_params, estimate_role, plan_run
from parallel.testing import run_distributed
from tools.measure_memory import DEFAULT_BATCH, DEFAULT_MODEL, measure_train_step

GPU_RECIPES = [
    "gpu/qwen3_30b_a3b_grpo",
    "gpu/qwen3_30b_a3b_grpo_lora",
    "gpu/qwen3_30b_a3b_dapo",
    "gpu/qwen3_30b_a3b_dr_grpo",
    "gpu/qwen3_30b_a3b_gspo",
    "gpu/qwen3_30b_a3b_opd",
    "gpu/qwen3_30b_a3b_ppo",
    "gpu/qwen3_30b_a3b_reinforce_plus_plus",
    "gpu/qwen3_30b_a3b_remax",
    "gpu/qwen3_30b_a3b_rloo",
    "gpu/qwen3_235b_a22b_grpo",
    "gpu/qwen3_235b_a22b_dapo",
    "gpu/llama3_1_70b_grpo",
    "gpu/llama3_1_70b_dapo",
]
TP, PP = (
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
)
# Figures computed with Adam state replicated on every DP rank (the default shards it: use_distributed_optimizer=True)
UNSHARDED = [
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
    "critic.megatron.use_distributed_optimizer=false",
]


def test_cli_help_names_every_built_in_architecture():
    from megatron_rl.cli import PLANNER_ARCHITECTURES

    assert sorted(PLANNER_ARCHITECTURES) == sorted(KNOWN_ARCHITECTURES)


def test_published_parameter_counts():
    totals = {k: sum(count_params(m)) / 1e9 for k, m in KNOWN_ARCHITECTURES.items()}
    assert totals["qwen3_30b_a3b"] == pytest.approx(30.53, abs=0.01)
    assert totals["qwen3_235b_a22b"] == pytest.approx(235.09, abs=0.01)
    assert totals["llama3_1_70b"] == pytest.approx(70.55, abs=0.01)


def test_estimate_matches_measured_peak_within_20_percent():
    layouts = [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}]
    two = run_distributed(measure_train_step, 2, layouts, DEFAULT_MODEL, DEFAULT_BATCH, timeout_s=240)
    one = run_distributed(measure_train_step, 1, [{}], DEFAULT_MODEL, DEFAULT_BATCH, timeout_s=240)
    model = ModelConfig(**DEFAULT_MODEL)
    seq = DEFAULT_BATCH["prompt_length"] + DEFAULT_BATCH["response_length"]
    cases = [(one[0][0], 1, 1), (two[0][0], 2, 1), (two[0][1], 1, 2), (two[1][1], 1, 2)]
    for measured, tp, pp in cases:
        est = estimate_role(
            model,
            tp=tp,
            pp=pp,
            dtype="float32",
            sequence_parallel=False,
            micro_batch_size=DEFAULT_BATCH["micro_batch_size"],
            seq_length=seq,
            response_length=DEFAULT_BATCH["response_length"],
            num_microbatches=2,
        )
        # Persistent state is counted exactly; the peak within 20 %.
        assert est.state_bytes == pytest.approx(measured["static"], rel=0.01), (tp, pp)
        assert est.peak_bytes == pytest.approx(measured["peak"], rel=0.20), (tp, pp, est, measured)
    # The terms are well above noise: activations + scratch are > 30 % of the peak.
    assert one[0][0]["peak"] - one[0][0]["static"] > 0.3 * one[0][0]["peak"]


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_fit_80gb(recipe):
    plan = check_plan(load_config(recipe))
    assert plan.fits and plan.peak_bytes < 80 * 1024**3
    assert plan.sizes["tp"] <= plan.gpus_per_node


def test_lora_puts_qwen3_30b_on_one_node_where_full_fine_tuning_does_not_fit():
    """The LoRA recipe fits one 8 x 80 GB node with room to spare: the base is resident without gradients
    or Adam state, there is no reference worker; the same layout training every parameter does not fit."""
    lora = plan_run(load_config("gpu/qwen3_30b_a3b_grpo_lora"), suggest=False)
    full = plan_run(load_config("gpu/qwen3_30b_a3b_grpo_lora", ["actor_rollout_ref.model.lora.rank=0"]), suggest=False)
    assert lora.fits and lora.peak_bytes < 72 * 1024**3 and lora.sizes["world"] == lora.gpus_per_node == 8
    assert set(lora.roles) == {"actor"} and set(full.roles) == {"actor", "ref"}  # the reference: adapters off
    actor, base = lora.roles["actor"], full.roles["actor"]
    assert actor.grad_bytes < 0.05 * base.grad_bytes and actor.optimizer_bytes < 0.05 * base.optimizer_bytes
    assert not full.fits and full.peak_bytes > 100 * 1024**3


def test_published_cluster_sizes():
    assert plan_run(load_config("gpu/qwen3_30b_a3b_grpo", ["trainer.nnodes=1", f"{PP}=1"])).fits
    assert plan_run(load_config("gpu/llama3_1_70b_grpo", ["trainer.nnodes=8"])).fits
    # 235B on 8 nodes: TP=4 with EP=32 does not fit (unsharded Adam state); TP=8 does.
    ep32 = "actor_rollout_ref.actor.megatron.expert_model_parallel_size=32"
    plan = plan_run(load_config("gpu/qwen3_235b_a22b_grpo", ["trainer.nnodes=8", ep32, *UNSHARDED]))
    assert not plan.fits and plan.suggestion.startswith(
        "Nearest layout that fits: tensor_model_parallel_size=8 "
        "pipeline_model_parallel_size=2 expert_model_parallel_size=32"
    )
    assert plan_run(load_config("gpu/qwen3_235b_a22b_grpo", ["trainer.nnodes=8", ep32, f"{TP}=8", *UNSHARDED])).fits
    # With the Adam state sharded over DP (the default), TP=4 with EP=32 fits
    assert plan_run(load_config("gpu/qwen3_235b_a22b_grpo", ["trainer.nnodes=8", ep32])).fits


def test_llama70b_unsharded_refused_with_suggestion():
    cfg = load_config("gpu/llama3_1_70b_grpo", [f"{TP}=1", f"{PP}=1", *UNSHARDED])
    with pytest.raises(
        ValueError,
        match=r"needs 1194\.\d GiB per GPU.*optimizer state.*Nearest layout that fits: "
        r"tensor_model_parallel_size=8 pipeline_model_parallel_size=2",
    ):
        check_plan(cfg)
    one_node = plan_run(load_config("gpu/llama3_1_70b_grpo", ["trainer.nnodes=1", f"{TP}=1", f"{PP}=1", *UNSHARDED]))
    assert not one_node.fits and one_node.suggestion.startswith("No layout fits on 1 node(s); on 2 nodes")


def test_invalid_layouts_refused():
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=16 exceeds --gpus-per-node=8"):
        plan_run(load_config("gpu/qwen3_30b_a3b_grpo", [f"{TP}=16", "trainer.nnodes=4"]))
    with pytest.raises(ValueError, match=r"num_experts=96 is not divisible by expert_model_parallel_size=64"):
        plan_run(
            load_config("gpu/qwen3_235b_a22b_grpo", ["actor_rollout_ref.model.override_config.num_moe_experts=96"])
        )
    with pytest.raises(ValueError, match=r"num_layers=94 is not divisible by pipeline_model_parallel_size=4"):
        plan_run(
            load_config(
                "gpu/qwen3_235b_a22b_grpo",
                [f"{PP}=4", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=32"],
            )
        )


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "plan", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_fit_and_misfit():
    ok = _cli("gpu/llama3_1_70b_grpo", "--nodes", "4", "--gpus-per-node", "8")
    assert ok.returncode == 0, ok.stderr
    assert "node 3: ranks 24-31, pp stage(s) [3], tp groups [24-31]" in ok.stdout
    assert "verdict: FITS" in ok.stdout and "actor update" in ok.stdout
    bad = _cli("gpu/llama3_1_70b_grpo", "--nodes", "4", f"{TP}=1", f"{PP}=1")
    assert bad.returncode == 1 and "verdict: DOES NOT FIT" in bad.stdout
    invalid = _cli("gpu/qwen3_30b_a3b_grpo", "--nodes", "8", "--gpus-per-node", "2")
    assert invalid.returncode == 2 and "tensor_model_parallel_size=4 exceeds --gpus-per-node=2" in invalid.stderr


def test_cpu_toy_recipe_uses_host_ram():
    plan = check_plan(load_config("grpo"))
    assert plan.device == "cpu" and plan.memory_budget_bytes < 64 * 1024**3
    assert plan.phases["rollout"]["framework reserve"] == 0


def test_gpu_rollout_engine_map_in_plan_and_placement():
    """The plan's engine map is the trainer's (``megatron_rl.utils.engine_map.rollout_layout``): colocated
    TP=4 engines on 2 x 8 GPUs are 4 replicas; a separate pool of 2 nodes gets its own; a layout that does
    not divide is refused by key by both."""
    from megatron_rl.trainer.placement import gpu_rollout_placement_error
    from megatron_rl.utils.engine_map import rollout_layout

    plan = check_plan(load_config("gpu/qwen3_30b_a3b_grpo"))  # 16 GPUs, rollout TP=4, colocated
    assert (plan.engines.replicas, plan.engines.engine_gpus, plan.engines.nodes_per_engine) == (4, 4, 1)
    assert plan.engines.engines[2] == ((1, 0), (1, 1), (1, 2), (1, 3))
    assert not any("one vLLM engine" in w or "refuses" in w for w in plan.warnings), plan.warnings
    assert gpu_rollout_placement_error(load_config("gpu/qwen3_30b_a3b_grpo")) is None
    sep = [
        "actor_rollout_ref.rollout.nnodes=2",
        "actor_rollout_ref.rollout.n_gpus_per_node=8",
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.rollout.free_cache_engine=false",
    ]
    sep_map = rollout_layout(load_config("gpu/qwen3_30b_a3b_grpo", sep))  # its pool's nodes follow the trainer's
    assert (sep_map.replicas, sep_map.colocated, sep_map.engines[0][0], sep_map.engines[3][-1]) == (
        4,
        False,
        (2, 0),
        (3, 7),
    )
    assert gpu_rollout_placement_error(load_config("gpu/qwen3_30b_a3b_grpo", sep)) is None
    bad = load_config("gpu/qwen3_30b_a3b_grpo", [*sep[:1], *sep[2:], "actor_rollout_ref.rollout.n_gpus_per_node=6"])
    assert gpu_rollout_placement_error(bad) == (
        "an engine of 4 GPUs (actor_rollout_ref.rollout.tensor_model_parallel_size x data_parallel_size x "
        "pipeline_model_parallel_size = 4x1x1) does not divide actor_rollout_ref.rollout.n_gpus_per_node=6: an engine "
        "no larger than a node stays inside one node; use an engine size dividing 6"
    )
    wrong = load_config("gpu/qwen3_30b_a3b_grpo", ["actor_rollout_ref.rollout.num_replicas=2"])
    assert "num_replicas=2, but the rollout's GPUs hold 4 engine(s) of 4 GPUs" in gpu_rollout_placement_error(wrong)
    assert gpu_rollout_placement_error(load_config("grpo")) is None  # CPU: one engine unless num_replicas says more


def test_cli_plan_json_engine_map():
    """``plan --json``: one JSON object whose "rollout" member is the engine map, nodes and GPUs from 0."""
    out = _cli("gpu/qwen3_30b_a3b_grpo", "--json", "actor_rollout_ref.rollout.tensor_model_parallel_size=8")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["rollout"] == {
        "engine_gpus": 8,
        "replicas": 2,
        "nodes_per_engine": 1,
        "engines": [[[0, g] for g in range(8)], [[1, g] for g in range(8)]],
    }
    span = json.loads(
        _cli(
            "gpu/qwen3_30b_a3b_grpo",
            "--json",
            "--gpus-per-node",
            "4",
            "--nodes",
            "4",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
        ).stdout
    )["rollout"]
    assert (span["replicas"], span["nodes_per_engine"]) == (2, 2)
    assert span["engines"][1] == [[2, g] for g in range(4)] + [[3, g] for g in range(4)]
