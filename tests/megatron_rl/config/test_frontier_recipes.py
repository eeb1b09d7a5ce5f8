"""The frontier-MoE GPU recipes (DeepSeek-V3 671B, GLM-4.5-Air, GLM-4.5 355B): they load, validate,
resolve their architecture from the built-in table (no weights on this machine), and the planner
accepts their layouts with the figures their header comments state.

The planner refuses a rollout whose engine's weight shard does not fit the ``gpu_memory_utilization``
budget (``plan._phases``): GLM-4.5-Air fits on H100, GLM-4.5 355B needs H200 (its recipe's
cluster), and DeepSeek-V3's bf16 weights fit no single 8-GPU H100 / H200 node (refused by name after
its training layout has been validated and sized); with FP8 rollout weights (``rollout.quantization:
fp8``, its recipe) they are 78.4 GiB per GPU at TP=8 and its H200 cluster is accepted.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_rl.algos.needs import resolve_run
from megatron_rl.config.loader import load_config
from megatron_rl.planner import check_plan, count_params
from megatron_rl.planner.architectures import resolve_architecture

GIB = 1024**3
# recipe -> (path, table entry, nodes, (TP, PP, EP, ETP), (DP, expert DP), GPU GiB, peak GiB, peak phase,
#            actor-update GiB)
FRONTIER = {
    "gpu/glm4_5_air_grpo": (
        "~/models/GLM-4.5-Air",
        "table:glm4_5_air",
        4,
        (4, 2, 16, 1),
        (4, 1),
        80.0,
        65.91,
        "actor update",
        65.91,
    ),
    "gpu/glm4_5_355b_grpo": (
        "~/models/GLM-4.5",
        "table:glm4_5",
        16,
        (4, 4, 32, 1),
        (8, 1),
        141.0,
        116.80,
        "rollout",
        58.62,
    ),
    # FP8 rollout weights; the engine takes 0.85 x 141 GiB = 119.85 GiB while it generates
    "gpu/deepseek_v3_671b_grpo": (
        "~/models/DeepSeek-V3",
        "table:deepseek_v3",
        32,
        (8, 1, 256, 1),
        (32, 1),
        141.0,
        123.85,
        "rollout",
        61.05,
    ),
}


@pytest.mark.parametrize("recipe", sorted(FRONTIER))
def test_frontier_recipe_loads_and_the_planner_accepts_it(recipe):
    path, source, nodes, layout, dps, gpu_gib, peak, phase, update = FRONTIER[recipe]
    cfg = load_config(recipe)
    needs = resolve_run(cfg)
    assert (needs.critic, needs.reference, needs.teacher, needs.reward_model) == (False, True, False, False)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.trainer.device == "cuda"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (nodes, 8)
    arr = cfg.actor_rollout_ref
    assert arr.model.path == path and arr.model.config is None
    mp = arr.actor.megatron.parallel()
    assert (
        mp.tensor_model_parallel_size,
        mp.pipeline_model_parallel_size,
        mp.expert_model_parallel_size,
        mp.expert_tensor_parallel_size,
    ) == layout
    assert arr.ref.megatron.parallel() == mp
    plan = check_plan(cfg, gpu_memory_gb=gpu_gib)
    assert plan.model_source == source
    assert plan.fits and plan.peak_bytes < gpu_gib * GIB
    assert plan.sizes["tp"] <= plan.gpus_per_node and arr.rollout.tensor_model_parallel_size <= plan.gpus_per_node
    assert (plan.sizes["dp"], plan.sizes["expert_dp"]) == dps
    assert plan.peak_phase == phase and plan.peak_bytes / GIB == pytest.approx(peak, abs=0.01)
    assert sum(plan.phases["actor update"].values()) / GIB == pytest.approx(update, abs=0.01)
    # Actor state offloaded while vLLM generates: the rollout phase holds the engine and the reserve only.
    assert set(k for k, v in plan.phases["rollout"].items() if v) == {"vllm engine", "framework reserve"}


def _engine_shard_gib(recipe: str) -> float:
    """One vLLM engine's bf16 weights per GPU: all parameters / rollout TP."""
    cfg = load_config(recipe)
    model, _ = resolve_architecture(
        "actor_rollout_ref.model.path", path=cfg.actor_rollout_ref.model.path, config=cfg.actor_rollout_ref.model.config
    )
    return sum(count_params(model)) * 2 / (cfg.actor_rollout_ref.rollout.tensor_model_parallel_size * GIB)


def test_engine_weight_shard_against_the_vllm_budget():
    # GLM-4.5-Air: 24.9 GiB per GPU at TP=8, inside 0.6 x 80 GiB.
    air = _engine_shard_gib("gpu/glm4_5_air_grpo")
    assert air == pytest.approx(24.88, abs=0.01) and air < 0.6 * 80
    # GLM-4.5 355B: 82.1 GiB per GPU at TP=8: more than an H100 holds, inside 0.8 x 141 GiB (H200).
    glm = _engine_shard_gib("gpu/glm4_5_355b_grpo")
    assert glm == pytest.approx(82.14, abs=0.01) and 80 < glm < 0.8 * 141
    # DeepSeek-V3: 156.2 GiB per GPU at TP=8 (the largest TP inside a node): no 80 or 141 GiB GPU holds it.
    deepseek = _engine_shard_gib("gpu/deepseek_v3_671b_grpo")
    assert deepseek == pytest.approx(156.24, abs=0.01) and deepseek > 141
    # In DeepSeek's block FP8 (1 B per projection weight + a 4 B scale per 128x128 block, the rest bf16):
    # 669.07 B of its 671.03 B parameters are quantised, 40.8 M blocks; 78.37 GiB per GPU < 0.85 x 141 GiB.
    from megatron_rl.planner.memory import fp8_linear_shapes, rollout_weight_bytes

    cfg = load_config("gpu/deepseek_v3_671b_grpo")
    model, _ = resolve_architecture("actor_rollout_ref.model.path", path=cfg.actor_rollout_ref.model.path)
    shapes = fp8_linear_shapes(model)
    quantised = sum(r * c * n for r, c, n in shapes)
    blocks = sum(-(-r // 128) * -(-c // 128) * n for r, c, n in shapes)
    total = sum(count_params(model))
    assert (total, quantised, blocks) == (671_026_404_352, 669_065_609_216, 40_838_232)
    fp8 = rollout_weight_bytes(model, "bfloat16", "fp8")
    assert fp8 == quantised + 4 * blocks + 2 * (total - quantised)
    assert fp8 / (8 * GIB) == pytest.approx(78.37, abs=0.01) and fp8 / (8 * GIB) < 0.85 * 141
    # exact: the same integer byte count (< 2^53) over the same power of two, 8 * 2^30, in float64
    assert rollout_weight_bytes(model, "bfloat16") / (8 * GIB) == deepseek


DEEPSEEK_REFUSAL = (
    "actor_rollout_ref.rollout: one vLLM engine's bfloat16 weights are 156.2 GiB per GPU at "
    "tensor_model_parallel_size=8, not less than gpu_memory_utilization=0.6 x 80.0 GiB = 48.0 GiB "
    "(no room for the KV cache); raise gpu_memory_utilization or tensor_model_parallel_size (an "
    "engine stays inside one node: at most trainer.n_gpus_per_node=8 GPUs)"
)


BF16 = ["actor_rollout_ref.rollout.quantization=null"]
DEEPSEEK_H200_BF16_REFUSAL = (
    "actor_rollout_ref.rollout: one vLLM engine's bfloat16 weights are 156.2 GiB per GPU at tensor_model_parallel_size=8, "
    "not less than gpu_memory_utilization=0.85 x 141.0 GiB = 119.8 GiB (no room for the KV cache); raise "
    "gpu_memory_utilization or tensor_model_parallel_size (an engine stays inside one node: at most "
    "trainer.n_gpus_per_node=8 GPUs)"
)


def test_deepseek_v3_recipe_is_refused_in_bf16_and_accepted_with_fp8_rollout_weights():
    cfg = load_config("gpu/deepseek_v3_671b_grpo")
    needs = resolve_run(cfg)
    assert (needs.critic, needs.reference, needs.teacher, needs.reward_model) == (False, True, False, False)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.trainer.device) == (32, 8, "cuda")
    assert cfg.actor_rollout_ref.rollout.quantization == "fp8"
    mp = cfg.actor_rollout_ref.actor.megatron.parallel()
    assert (
        mp.tensor_model_parallel_size,
        mp.pipeline_model_parallel_size,
        mp.expert_model_parallel_size,
        mp.expert_tensor_parallel_size,
    ) == (8, 1, 256, 1)
    # bf16 rollout weights: refused by name on the earlier H100 cluster (0.6 x 80 GiB) and on H200 (0.85 x 141)
    # -- the roles are sized (their layouts validated) before the rollout's engine is checked
    with pytest.raises(ValueError) as err:
        check_plan(
            load_config("gpu/deepseek_v3_671b_grpo", BF16 + ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"])
        )
    assert str(err.value) == DEEPSEEK_REFUSAL
    with pytest.raises(ValueError) as err:
        check_plan(load_config("gpu/deepseek_v3_671b_grpo", BF16), gpu_memory_gb=141.0)
    assert str(err.value) == DEEPSEEK_H200_BF16_REFUSAL
    # FP8 on H100: 78.4 GiB per GPU is more than 0.85 x 80 GiB
    with pytest.raises(
        ValueError,
        match=r"fp8 block-quantised \(bfloat16 rest\) weights are 78\.4 GiB per GPU .*"
        r"=0\.85 x 80\.0 GiB = 68\.0 GiB",
    ):
        check_plan(cfg)
    # FP8 on H200: accepted; the weight sync holds the engine's 78.37 GiB FP8 weights + the actor's bf16 parameters
    plan = check_plan(cfg, gpu_memory_gb=141.0)
    assert plan.phases["weight sync"]["vllm weights"] / GIB == pytest.approx(78.37, abs=0.01)
    assert sum(plan.phases["weight sync"].values()) / GIB == pytest.approx(93.28, abs=0.01)
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "plan", "gpu/deepseek_v3_671b_grpo", "--gpu-memory-gb", "141"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "verdict: FITS -- peak 123.8 of 141.0 GiB (rollout)" in out.stdout, out.stderr
