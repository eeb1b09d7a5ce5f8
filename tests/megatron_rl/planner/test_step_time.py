"""The step-time model of ``megatron-rl plan``: the calibration run, hand calculations of its phases,
the KV cache and its waves, hardware scaling, async overlap, the CLI's options, output and errors.

Expected figures are worked out by hand in each test from the model's stated physics (datasheet
peaks, the named fractions of ``megatron_rl.planner.hardware``), never by calling the code's formulas.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.cli import PLANNER_HARDWARE, main
from megatron_rl.config.loader import load_config
from megatron_rl.planner import KNOWN_ARCHITECTURES, plan_run
from megatron_rl.planner.hardware import HARDWARE, get_hardware
from megatron_rl.planner.step_time import CALIBRATION, estimate_step_time, kv_bytes_per_token, vllm_stage_layers

GIB = 2**30
QWEN3_30B_PARAMS = 30.53e9  # tests/megatron_rl/test_planner.py pins the count
# The no-offload, awake-engine variant the separate pool needs (step_schedule refuses offload without sleep).
SEPARATE_ASYNC = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=8",
    "trainer.total_training_steps=10",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "actor_rollout_ref.actor.megatron.param_offload=false",
    "actor_rollout_ref.actor.megatron.grad_offload=false",
    "actor_rollout_ref.actor.megatron.optimizer_offload=false",
    "actor_rollout_ref.ref.megatron.param_offload=false",
]


@pytest.fixture(scope="module")
def calibration():
    cfg = load_config(CALIBRATION["recipe"], CALIBRATION["overrides"])
    plan = plan_run(cfg, suggest=False)
    return cfg, plan, estimate_step_time(cfg, plan, response_length_mean=CALIBRATION["response_length_mean"])


# ----------------------------------------------------------------------------- the hardware table
def test_cli_names_every_gpu_of_the_table():
    assert sorted(PLANNER_HARDWARE) == sorted(HARDWARE) == ["A100", "B200", "GB200", "H100", "H200", "H800"]


def test_datasheet_figures_and_sources():
    h100, a100, gb200 = HARDWARE["H100"], HARDWARE["A100"], HARDWARE["GB200"]
    assert (h100.bf16_flops, h100.hbm_bytes_per_s, h100.nvlink_bytes_per_s) == (989e12, 3.35e12, 450e9)
    assert HARDWARE["H200"].hbm_bytes_per_s == 4.8e12 and HARDWARE["H800"].nvlink_bytes_per_s == 200e9
    assert a100.fp8_flops is None and a100.bf16_flops == 312e12
    assert gb200.nvlink_domain == 72 and HARDWARE["B200"].nvlink_domain == 8
    assert all(len(h.source) > 40 for h in HARDWARE.values())


def test_unknown_gpu_names_the_option_and_the_allowed_names():
    with pytest.raises(ValueError) as err:
        get_hardware("V100")
    assert "--hardware='V100'" in str(err.value) and "'H100'" in str(err.value) and "'GB200'" in str(err.value)


# ----------------------------------------------------------------------------- KV cache
def test_kv_bytes_per_token_by_hand():
    qwen, dsv3 = KNOWN_ARCHITECTURES["qwen3_30b_a3b"], KNOWN_ARCHITECTURES["deepseek_v3"]
    # 48 layers x (K, V) x 4 KV heads x 128 x 2 bytes
    assert kv_bytes_per_token(qwen) == 48 * 2 * 4 * 128 * 2 == 98_304
    assert kv_bytes_per_token(qwen, tp=2) == 49_152  # 2 of the 4 heads per GPU
    assert kv_bytes_per_token(qwen, tp=8) == 24_576  # fewer heads than ranks: one head per GPU, replicated
    # MLA: 61 layers x (512 latent + 64 rotary key) x 2 bytes, the same on every TP rank; fp8 halves it
    assert kv_bytes_per_token(dsv3, tp=8) == 61 * 576 * 2 == 70_272
    assert kv_bytes_per_token(dsv3, tp=8, dtype_bytes=1) == 35_136


def test_calibration_kv_cache_and_waves(calibration):
    _, _, st = calibration
    # 0.6 x 80 GiB for vLLM - 30.53e9 x 2 B / TP 2 of weights - 2 GiB non-KV = 17.57 GiB per GPU
    free = 0.6 * 80 * GIB - QWEN3_30B_PARAMS * 2 / 2 - 2 * GIB
    assert st.kv.free_bytes_per_gpu == pytest.approx(free, rel=0.005)
    assert st.kv.capacity_tokens == pytest.approx(free / 49_152, rel=0.005)  # ~383.7 k tokens
    assert st.kv.fits_at_once == 93  # 383.7 k // (128 prompt + 3,968 p99)
    assert st.kv.sequences_per_engine == 128 and st.kv.waves == 2  # 2,048 over 32 / 2 = 16 engines
    assert any("2 waves" in w and "93 sequences" in w for w in st.warnings)


# ----------------------------------------------------------------------------- calibration and hand calculations
def test_calibration_within_20_percent_of_the_published_run(calibration):
    _, _, st = calibration
    published = CALIBRATION["published"]
    assert st.step_time_s == pytest.approx(published["step_time_s"], rel=0.20)
    assert st.tokens_per_s_per_gpu == pytest.approx(published["tokens_per_s_per_gpu"], rel=0.20)
    # 2,048 sequences x (128 + 3,200) tokens over 32 GPUs
    assert st.tokens_per_s_per_gpu == pytest.approx(2048 * 3328 / (st.step_time_s * 32), rel=1e-9)
    assert st.gpus == 32 and st.mode == "sync"
    assert st.step_time_s == pytest.approx(sum(p.seconds for p in st.phases.values()), rel=1e-9)


def test_calibration_generation_by_hand(calibration):
    _, _, st = calibration
    # Concurrency: 383.7 k tokens / (128 + 3,200) = 115.3 sequences; 128 per engine at 115.3 take
    # 128 / 115.3 x 3,200 steps, and the last wait 3,968 - 3,200 more for the longest: 4,321 steps.
    capacity = (0.6 * 80 * GIB - QWEN3_30B_PARAMS - 2 * GIB) / 49_152
    running = capacity / 3328
    steps = 128 / running * 3200 + 768
    # A step reads the 30.53 GB shard (115 tokens x top-8 touch all 128 experts) and 115.3 sequences x
    # (128 + 1,600) average context x 49,152 B, at 0.33 of 3.35 TB/s; plus 48 layers x 2 all-reduces of
    # 10 us + 115.3 x 2,048 x 2 B at 0.8 x 450 GB/s (ring factor 2 x 1/2). vLLM's 3 ms of host work per step
    # runs under the 37.5 ms of GPU work (async scheduling, on by default): the slower of the two paces it.
    read = QWEN3_30B_PARAMS + running * 1728 * 49_152
    step_s = max(read / (3.35e12 * 0.33) + 96 * (10e-6 + running * 2048 * 2 / 360e9), 3e-3)
    gen = st.phases["gen"]
    assert gen.bound == "memory bandwidth"
    assert gen.seconds == pytest.approx(steps * step_s, rel=0.01)  # ~162 s, prefill ~0.03 s
    assert "decode steps of 37.5 ms (vLLM's 3 ms per-step overhead under them: async scheduling;" in gen.detail


def test_synchronous_scheduling_adds_the_engine_overhead_to_every_decode_step(calibration):
    """``engine_kwargs.vllm.async_scheduling: false``: the host's 3 ms follow the GPU's 37.5 ms instead of
    overlapping them (vLLM PRs #19970 / #23569), so each of the 4,321 decode steps takes 40.5 ms."""
    cfg, plan, st = calibration
    sync_cfg = load_config(
        CALIBRATION["recipe"],
        CALIBRATION["overrides"] + ["actor_rollout_ref.rollout.engine_kwargs={vllm: {async_scheduling: false}}"],
    )
    sync = estimate_step_time(sync_cfg, plan_run(sync_cfg, suggest=False), response_length_mean=3200)
    capacity = (0.6 * 80 * GIB - QWEN3_30B_PARAMS - 2 * GIB) / 49_152
    running = capacity / 3328
    steps = 128 / running * 3200 + 768
    gpu_s = (QWEN3_30B_PARAMS + running * 1728 * 49_152) / (3.35e12 * 0.33) + 96 * (10e-6 + running * 2048 * 2 / 360e9)
    assert sync.phases["gen"].seconds == pytest.approx(steps * (gpu_s + 3e-3), rel=0.01)  # ~175 s
    # 13.0 s; the hand's step count from the stated 0.6 x 80 GiB budget, the plan's from its exact free bytes
    assert sync.phases["gen"].seconds - st.phases["gen"].seconds == pytest.approx(steps * 3e-3, rel=1e-3)
    assert "decode steps of 40.5 ms (3 ms of them vLLM's per-step overhead;" in sync.phases["gen"].detail
    assert sync.phases["update_actor"].seconds == st.phases["update_actor"].seconds


def test_calibration_log_prob_and_update_by_hand(calibration):
    _, _, st = calibration
    tokens_per_gpu = 2048 * 3328 / 32  # DP = 32, EP = 8 inside a node, TP = PP = 1
    # Active per token: attention projections 48 x 18.87 M + QK norms, layer norms, routers (48 x 266.5 k)
    # + the head 151,936 x 2,048 + final norm = 1.2370 G dense; 48 x 8 x 3 x 2,048 x 768 = 1.8119 G experts;
    # attention 2 x 48 x 32 heads x 128 x 3,328 = 1.3086 G FLOPs.
    # The head scores the 3,200 response positions of the 3,328 only.
    scored = 3200 / 3328
    dense = 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048) + scored * 151936 * 2048
    dense += 2048
    expert = 48 * 8 * 3 * 2048 * 768
    attention = 2 * 48 * 32 * 128 * 3328
    # Element-wise traffic outside the GEMMs, TE's fused kernels, bf16, per token and layer: 2 norms x 2 + 2
    # residual adds x 3 widths of 2,048; QK norms 2 (4,096 + 512), fused rope and flash attention's io 2 x
    # 2 (4,096 + 512); the router 4 x 128 and the fused permute / unpermute (2 + 2 x 8) x 2,048; SwiGLU 3 x 8 x 768.
    layer = 10 * 2048 + 2 * 4608 + 4 * 4608 + 4 * 128 + 18 * 2048 + 3 * 8 * 768
    # plus the embedding's lookup and the final norm (2 x 2,048 each) and the head's fused log-softmax 2 x V
    elements = 48 * layer + 4 * 2048 + scored * 2 * 151936
    traffic = tokens_per_gpu * elements * 2 / (3.35e12 * 0.79)  # ~0.98 s per forward
    forward = tokens_per_gpu * (2 * dense / (989e12 * 0.8) + 2 * expert / (989e12 * 0.4) + attention / (989e12 * 0.4))
    forward += traffic
    # EP all-to-all per MoE layer and direction: dispatch + combine of 8 copies x 2,048 x 2 B, 7/8 leave the GPU
    a2a = 48 * 2 * tokens_per_gpu * 8 * 2048 * 2 * 7 / 8 / 360e9
    assert st.phases["old_log_prob"].seconds == pytest.approx(forward + a2a, rel=0.01)  # ~5.9 s
    assert st.phases["ref"].seconds == pytest.approx(forward + a2a, rel=0.01)
    # Update: 3 passes and 3 x the all-to-all (no recompute); 4 optimizer steps each all-gather bf16 params:
    # dense (1.237 G + the 311 M embedding) over DP 32 and experts (128 x 48 x 3 x 2,048 x 768 / 8) over
    # expert-DP 4, across nodes at 0.8 x 50 GB/s; the gradient reduce-scatter hides under the compute.
    dense_local, expert_local = dense + 151936 * 2048, 128 * 48 * 3 * 2048 * 768 / 8
    gather = 4 * (dense_local * 2 * 31 / 32 + expert_local * 2 * 3 / 4) / 40e9
    adam = 4 * (dense_local / 32 + expert_local / 4) * 36 / (3.35e12 * 0.79)
    assert st.phases["update_actor"].seconds == pytest.approx(3 * (forward + a2a) + gather + adam, rel=0.01)


def test_weight_sync_and_offload_by_hand(calibration):
    _, plan, st = calibration
    # cuda_ipc: each GPU gathers its 30.53 GB engine shard from the EP group over NVLink (0.8 x 450 GB/s),
    # copies it into place (read + write at 0.79 x 3.35 TB/s) and vLLM handles 18,915 HF tensors at 50 us
    # (48 layers x (q, k, v, o, 2 QK norms, 2 norms, router, 128 x 3 experts) + embedding, norm, head).
    tensors = 48 * (4 + 2 + 2 + 1 + 384) + 3
    sync = QWEN3_30B_PARAMS / 360e9 + 2 * QWEN3_30B_PARAMS / (3.35e12 * 0.79) + tensors * 50e-6
    assert st.phases["update_weights"].seconds == pytest.approx(sync, rel=0.01)
    # Offload: the actor's parameters move 4 times (onload for log-prob, off for the reference, on for the
    # update, off after the sync), its gradients and Adam state twice, the reference's parameters twice;
    # vLLM sleeps at level 2 (weights dropped, refilled by the sync). At 0.8 x 64 GB/s.
    actor, ref = plan.roles["actor"], plan.roles["ref"]
    moved = 4 * actor.param_bytes + 2 * (actor.grad_bytes + actor.optimizer_bytes) + 2 * ref.param_bytes
    assert st.phases["offload"].seconds == pytest.approx(moved / 51.2e9, rel=1e-6)
    assert st.phases["offload"].bound == "PCIe"


def test_the_largest_lever_is_named_with_its_gain(calibration):
    _, _, st = calibration
    assert st.lever.startswith("gen is 83% of the step (memory bandwidth): ")
    assert "takes the step from 196 s to" in st.lever


def test_h200_bandwidth_shortens_the_memory_bound_decode(calibration):
    cfg, plan, h100 = calibration
    h200 = estimate_step_time(cfg, plan, hardware="H200", response_length_mean=3200)  # same 80 GiB budget
    # Only the HBM term scales (3.35 -> 4.8 TB/s); 4,321 steps x (36.47 ms x 3.35 / 4.8 + 0.96 ms of all-reduce
    # latency; the all-reduces' bytes are 0.13 ms), the engine's 3 ms overlapped under the 26.4 ms of GPU work
    capacity = (0.6 * 80 * GIB - QWEN3_30B_PARAMS - 2 * GIB) / 49_152
    running = capacity / 3328
    steps = 128 / running * 3200 + 768
    memory = (QWEN3_30B_PARAMS + running * 1728 * 49_152) / (4.8e12 * 0.33)
    assert h200.phases["gen"].seconds == pytest.approx(steps * max(memory + 96 * 10e-6, 3e-3), rel=0.01)  # ~115 s
    assert h200.phases["gen"].seconds < 0.74 * h100.phases["gen"].seconds


def test_response_lengths_default_to_the_maximum_and_the_tail_costs_steps(calibration):
    cfg, plan, st = calibration
    default = estimate_step_time(cfg, plan)
    assert default.response_mean == default.response_p99 == 3968
    short_tail = estimate_step_time(cfg, plan, response_length_mean=3200, response_length_p99=3200)
    # 768 fewer decode steps of ~37.5 ms of GPU time (the engine's 3 ms overlapped by async scheduling)
    assert st.phases["gen"].seconds - short_tail.phases["gen"].seconds == pytest.approx(768 * 0.0375, rel=0.03)
    with pytest.raises(ValueError, match=r"--response-length-mean=3500 is larger than the p99 \(3200"):
        estimate_step_time(cfg, plan, response_length_mean=3500, response_length_p99=3200)
    with pytest.raises(
        ValueError, match=r"--response-length-p99=5000.0 must be .* at most data.max_response_length=3968"
    ):
        estimate_step_time(cfg, plan, response_length_p99=5000.0)


def test_separate_async_overlaps_generation_with_training():
    cfg = load_config("gpu/qwen3_30b_a3b_grpo", SEPARATE_ASYNC)
    plan = plan_run(cfg, suggest=False)
    st = estimate_step_time(cfg, plan)
    phases = {k: p.seconds for k, p in st.phases.items()}
    training = sum(phases.values()) - phases["gen"] - phases["update_weights"]
    assert st.phases["old_log_prob"].bound == "skipped"  # bypass mode: old log-probs are the rollout's
    assert st.step_time_s == pytest.approx(max(phases["gen"], training) + phases["update_weights"], rel=1e-9)
    assert st.gpus == 16 + 8  # the trainer's 2 nodes and the rollout's own node
    on_policy = load_config(
        "gpu/qwen3_30b_a3b_grpo", SEPARATE_ASYNC + ["trainer.v1.sampler.max_off_policy_threshold=0"]
    )
    strict = estimate_step_time(on_policy, plan_run(on_policy, suggest=False))
    assert strict.step_time_s == pytest.approx(sum(phases.values()), rel=1e-9)  # staleness 0: no overlap


# ----------------------------------------------------------------------------- uneven pipeline stages
MEG = "actor_rollout_ref.actor.megatron"
SPLIT = f"{MEG}.override_transformer_config"


def test_deepseek_v3_uneven_stages_by_hand():
    """DeepSeek-V3 at PP=16 as 4 + 14 x 4 + 1 (TP=1, EP=8, DP=16 on 32 x 8 H200): per token, a layer's MLA
    projections (q_a 7168 x 1536, q_b 1536 x 128 x 192, kv_a 7168 x 576, kv_b 512 x 128 x 256, o 16,384 x 7168,
    the q/kv norms: 187,107,328) and two norms are 187,121,664 parameters; a dense layer adds 3 x 7168 x 18,432, a MoE layer
    the router 256 x 7168 and the shared expert 3 x 7168 x 2048 (dense) and 8 routed experts of 3 x 7168 x 2048.
    Stage 0 (3 dense + 1 MoE layer, the embedding a lookup) 3.39 s, a middle stage (4 MoE layers) 5.11 s, the
    last (1 MoE layer + the 129,280 x 7168 head) 2.20 s: the middle stages decide the log-prob pass."""
    cfg = load_config(
        "gpu/deepseek_v3_671b_grpo",
        [
            f"{MEG}.tensor_model_parallel_size=1",
            f"{MEG}.pipeline_model_parallel_size=16",
            f"{MEG}.expert_model_parallel_size=8",
            f"{SPLIT}.num_layers_in_first_pipeline_stage=4",
            f"{SPLIT}.num_layers_in_last_pipeline_stage=1",
        ],
    )
    st = estimate_step_time(cfg, plan_run(cfg, gpu_memory_gb=141, suggest=False), hardware="H200")
    attention, dense_mlp = 187_107_328 + 2 * 7168, 3 * 7168 * 18432
    moe_dense, routed = attention + 256 * 7168 + 3 * 7168 * 2048, 8 * 3 * 7168 * 2048
    scored = 2048 / 3072  # the head scores the response positions only
    head = scored * 129280 * 7168 + 7168  # output layer + final norm
    per_rank = 2048 * 3072 / 16  # 256 prompts x 8 samples x (1,024 + 2,048) tokens over DP 16
    mla = 2 * 128 * (128 + 64 + 128) // 2 * 3072  # causal attention FLOPs per token and layer
    # Element-wise traffic per token (TE's fused kernels, bf16, at 0.79 x 4.8 TB/s): a layer's 2 norms x 2 and
    # 2 residual adds x 3 widths of 7,168, fused rope and flash attention's io 4 x (q + k) = 4 x 2 x 128 x 192;
    # a dense layer's SwiGLU 3 x 18,432; a MoE layer's router 4 x 256, permute / unpermute (2 + 2 x 8) x 7,168
    # and SwiGLU 3 x (8 + 1 shared) x 2,048. The embedding's lookup and the final norm 2 x 7,168 each, the
    # head's fused log-softmax 2 x 129,280 per scored position.
    attention_traffic = 10 * 7168 + 4 * 2 * 128 * 192
    dense_traffic = attention_traffic + 3 * 18432
    moe_traffic = attention_traffic + 4 * 256 + 18 * 7168 + 3 * 9 * 2048

    def stage(dense, experts, layers, moe_layers, elements):
        compute = per_rank * (2 * dense / (989e12 * 0.8) + 2 * experts / (989e12 * 0.4) + layers * mla / (989e12 * 0.4))
        compute += per_rank * elements * 2 / (4.8e12 * 0.79)
        a2a = moe_layers * 2 * per_rank * 8 * 7168 * 2 * 7 / 8 / 360e9  # dispatch + combine over NVLink
        return compute, a2a

    hand = (
        [stage(3 * (attention + dense_mlp) + moe_dense, routed, 4, 1, 3 * dense_traffic + moe_traffic + 2 * 7168)]
        + [stage(4 * moe_dense, 4 * routed, 4, 4, 4 * moe_traffic)] * 14
        + [stage(moe_dense + head, routed, 1, 1, moe_traffic + 2 * 7168 + scored * 2 * 129280)]
    )
    log_prob = st.phases["old_log_prob"]
    assert log_prob.stages == pytest.approx([c + a for c, a in hand], rel=1e-6)  # 3.39, 5.11 x 14, 2.20 s
    # the middle stage, with the bubble of 15 stages over 393,216 / 3,072 = 128 micro-batches of one sequence
    compute, a2a = hand[1]
    assert log_prob.seconds == pytest.approx(compute * (1 + 15 / 128) + a2a, rel=1e-6)  # ~5.60 s
    assert "slowest stage 1 of 16 (4 layers)" in log_prob.detail


def test_qwen3_235b_accounted_split_by_hand():
    """Qwen3-235B-A22B's 94 layers over PP=8 with the embedding and the loss counted as a layer each: 11 + 6 x 12
    + 11 (TP=4, EP=4, DP=4 on 16 x 8 H100). Per token and layer: q/o 2 x 4096 x 8192, k/v 2 x 4096 x 512, q/k
    norms, two norms and the router 128 x 4096 = 71,835,904 dense and 8 experts of 3 x 4096 x 1536; per layer two
    TP all-reduce pairs and the EP all-to-all. The last stage's 11 layers + the 151,936 x 4096 head (7.62 s) come
    close to a middle stage's 12 layers (7.64 s), which decides; the first stage's 11 layers take 7.00 s."""
    cfg = load_config(
        "gpu/qwen3_235b_a22b_grpo",
        [
            f"{MEG}.tensor_model_parallel_size=4",
            f"{MEG}.pipeline_model_parallel_size=8",
            f"{MEG}.expert_model_parallel_size=4",
            f"{SPLIT}.account_for_embedding_in_pipeline_split=True",
            f"{SPLIT}.account_for_loss_in_pipeline_split=True",
        ],
    )
    st = estimate_step_time(cfg, plan_run(cfg, suggest=False))
    layer, routed, head = 71_835_904, 8 * 3 * 4096 * 1536, 2 / 3 * 151936 * 4096 + 4096  # 2,048 of 3,072 scored
    tokens = 2048 * 3072
    per_rank, local = tokens / 16, tokens / 4  # DP 4 x TP 4; a TP group's [tokens, h]
    # per layer: 2 all-gather + reduce-scatter pairs of 3/4 of [tokens, h] bf16, and dispatch + combine of 8
    # copies of each token, 3/4 of them leaving the GPU, over NVLink (0.8 x 450 GB/s)
    comm = 2 * 2 * 3 / 4 * local * 4096 * 2 / 360e9 + 2 * per_rank * 8 * 4096 * 2 * 3 / 4 / 360e9

    # Element-wise traffic per token of a rank's tokens / (DP x TP) (TE's fused kernels, bf16, at 0.79 x 3.35
    # TB/s; sequence parallel splits the hidden-sized work over TP too): 2 norms x 2 + 2 residual adds x 3 +
    # the fused permute / unpermute (2 + 2 x 8) widths of 4,096, the router 4 x 128; the QK norms, fused rope and
    # flash attention's io 6 x (8,192 + 512); SwiGLU 3 x 8 x 1,536. The embedding's lookup and the final norm
    # 2 x 4,096 each; the head's fused log-softmax 2 x 151,936 per scored (response) position.
    traffic = 28 * 4096 + 4 * 128 + 6 * (8192 + 512) + 3 * 8 * 1536

    def compute(dense, layers, extra=0.0):
        return per_rank * (
            2 * dense / (989e12 * 0.8)
            + 2 * layers * routed / (989e12 * 0.4)
            + layers * 2 * 8192 * 3072 / (989e12 * 0.4)
            + (layers * traffic + extra) * 2 / (3.35e12 * 0.79)
        )

    hand = (
        [compute(11 * layer, 11, 2 * 4096) + 11 * comm]
        + [compute(12 * layer, 12) + 12 * comm] * 6
        + [compute(11 * layer + head, 11, 2 * 4096 + 2 / 3 * 2 * 151936) + 11 * comm]
    )
    log_prob = st.phases["old_log_prob"]
    assert log_prob.stages == pytest.approx(hand, rel=1e-6)  # 7.00, 7.64 x 6, 7.62 s
    # 1,572,864 tokens per DP rank / 3,072 = 512 micro-batches: the bubble is 7 / 512 of the middle stage's compute
    assert log_prob.seconds == pytest.approx(compute(12 * layer, 12) * (1 + 7 / 512) + 12 * comm, rel=1e-6)
    assert "slowest stage 1 of 8 (12 layers)" in log_prob.detail
    even = load_config("gpu/qwen3_235b_a22b_grpo")  # PP=2: 47 + 47 layers, the head makes the last stage slower
    stages = estimate_step_time(even, plan_run(even, suggest=False)).phases["old_log_prob"].stages
    assert stages[1] > stages[0]


def test_vllm_splits_layers_as_get_pp_indices():
    # L // PP each, the remainder on the stages before the last, from the second-to-last backwards
    assert vllm_stage_layers(94, 4) == (23, 24, 24, 23)
    assert vllm_stage_layers(61, 4) == (15, 15, 16, 15)  # vLLM's docs' example for a 61-layer model
    assert vllm_stage_layers(5, 3) == (2, 2, 1) and vllm_stage_layers(48, 2) == (24, 24)


def test_rollout_pipeline_decodes_at_its_slowest_stage():
    """Qwen3-235B-A22B in engines of rollout TP=2 x PP=4 (16 engines on 16 x 8 H100): vLLM places 23 + 24 + 24 + 23
    layers, the embedding on the first stage, the 151,936 x 4096 head on the last. Per GPU (bf16, / TP 2) a layer
    is 71,835,904 dense + 128 x 3 x 4096 x 1536 expert parameters; a middle stage holds 24 layers (55.6 GiB), the
    last 23 + the head (53.9 GiB). Every stage gets the KV blocks of the tightest worker, a middle one: 0.85 x 80 GiB
    - 55.6 - 2 GiB over 24 layers x 2 of 4 KV heads x 128 x (K, V) x 2 B. A decode step takes the middle stage's
    read (its 24 layers, the experts the batch touches, its KV cache) and its 24 x 2 all-reduces, the engine's
    3 ms per step overlapped (async scheduling, on at PP > 1 with vLLM 0.32's V2 model runner)."""
    cfg = load_config(
        "gpu/qwen3_235b_a22b_grpo",
        [
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.pipeline_model_parallel_size=4",
        ],
    )
    gen = estimate_step_time(cfg, plan_run(cfg, suggest=False)).phases["gen"]
    dense, experts, head = 71_835_904, 128 * 3 * 4096 * 1536, 151936 * 4096
    middle = 24 * (dense + experts) * 2 / 2
    last = (23 * (dense + experts) + head + 4096) * 2 / 2
    assert round(middle / GIB, 1) == 55.6 and round(last / GIB, 1) == 53.9
    kv_layer = 2 * 2 * 128 * 2
    capacity = (0.85 * 80 * GIB - middle - 2 * GIB) / (24 * kv_layer)  # ~454 k tokens
    # (1,024 prompt + 2,048 response) tokens a sequence: 147 fit, more than the 128 of each of the 16 engines
    running = min(capacity / 3072, 128)
    assert capacity / 3072 > 128
    steps = 2048  # all 128 at once, the mean = the p99
    touched = 1 - (1 - 8 / 128) ** running
    read = 24 * dense * 2 / 2 + 24 * experts * 2 / 2 * touched + running * 2048 * 24 * kv_layer
    step_s = max(read / (3.35e12 * 0.33) + 48 * (10e-6 + running * 4096 * 2 / 360e9), 3e-3)  # vLLM's 3 ms under it
    assert gen.seconds == pytest.approx(steps * step_s, rel=0.003)  # ~124 s; prefill ~0.1 s
    assert "slowest stage 1 of 4 (24 layers)" in gen.detail


# ----------------------------------------------------------------------------- every GPU recipe, and the CLI
GPU_RECIPE_STEPS = [  # (recipe, hardware, step seconds, the longest phase) as the model gives them today
    ("gpu/deepseek_v3_671b_grpo", "H200", 336.2, "update_weights"),
    ("gpu/glm4_5_355b_grpo", "H200", 449.0, "update_weights"),
    ("gpu/glm4_5_air_grpo", "H100", 440.0, "update_actor"),
    ("gpu/llama3_1_70b_dapo", "H100", 3548.6, "gen"),
    ("gpu/llama3_1_70b_grpo", "H100", 295.1, "update_actor"),
    ("gpu/qwen3_235b_a22b_dapo", "H100", 3580.8, "gen"),
    ("gpu/qwen3_235b_a22b_grpo", "H100", 431.8, "gen"),
    ("gpu/qwen3_30b_a3b_dapo", "H100", 1705.4, "gen"),
    ("gpu/qwen3_30b_a3b_dr_grpo", "H100", 103.1, "gen"),
    ("gpu/qwen3_30b_a3b_grpo", "H100", 110.1, "gen"),
    ("gpu/qwen3_30b_a3b_grpo_lora", "H100", 150.2, "gen"),
    ("gpu/qwen3_30b_a3b_gspo", "H100", 103.1, "gen"),
    ("gpu/qwen3_30b_a3b_opd", "H100", 191.7, "gen"),
    ("gpu/qwen3_30b_a3b_ppo", "H100", 67.3, "gen"),
    ("gpu/qwen3_30b_a3b_reinforce_plus_plus", "H100", 110.1, "gen"),
    ("gpu/qwen3_30b_a3b_remax", "H100", 116.3, "gen"),
    ("gpu/qwen3_30b_a3b_rloo", "H100", 110.1, "gen"),
]


def test_every_gpu_recipe_has_a_pinned_step_time():
    from megatron_rl.config.loader import list_recipes

    assert sorted(r for r in list_recipes() if r.startswith("gpu/")) == sorted(r[0] for r in GPU_RECIPE_STEPS)
    for recipe, hardware, seconds, longest in GPU_RECIPE_STEPS:
        cfg = load_config(recipe)
        plan = plan_run(cfg, gpu_memory_gb=HARDWARE[hardware].memory_gib, suggest=False)
        st = estimate_step_time(cfg, plan, hardware=hardware)
        assert st.step_time_s == pytest.approx(seconds, rel=0.002), recipe
        assert max(st.phases, key=lambda k: st.phases[k].seconds) == longest, recipe
        assert list(st.phases)[0] == "gen" and list(st.phases)[-2:] == ["update_weights", "offload"], recipe


def test_cli_prints_and_json_carries_the_step_time(capsys):
    assert main(["plan", "gpu/qwen3_30b_a3b_grpo", "--json", "--response-length-mean", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = ["gen", "old_log_prob", "ref", "update_actor", "update_weights", "offload"]
    assert list(out["phases"]) == names
    assert all(set(p) == {"seconds", "bound"} and p["seconds"] >= 0 for p in out["phases"].values())
    assert out["step_time_s"] == pytest.approx(sum(p["seconds"] for p in out["phases"].values()), abs=0.01)
    # 128 prompts x 8 samples x (1,024 prompt + 1,024 response) tokens over 16 GPUs
    assert out["tokens_per_s_per_gpu"] == pytest.approx(1024 * 2048 / (out["step_time_s"] * 16), rel=1e-3)
    assert out["hardware"] == "H100" and out["fits"] is True
    assert main(["plan", "gpu/qwen3_30b_a3b_grpo", "--hardware", "B200"]) == 0
    text = capsys.readouterr().out
    assert "step time on B200 (sync; responses: mean 2048, p99 2048 tokens):" in text
    assert "largest lever: gen is" in text and "tokens/s/GPU over 16 GPUs" in text
    assert "verdict: FITS -- peak" in text and "of 180.0 GiB" in text  # --gpu-memory-gb follows the GPU


def test_cli_bad_input_exits_2_naming_the_option(capsys):
    assert main(["plan", "gpu/qwen3_30b_a3b_grpo", "--hardware", "V100"]) == 2
    err = capsys.readouterr().err
    assert "--hardware='V100' is not a known GPU" in err and "'H100'" in err and "'GB200'" in err
    with pytest.raises(SystemExit) as stop:
        main(["plan", "gpu/qwen3_30b_a3b_grpo", "--response-length-mean", "-5"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--response-length-mean" in err and "'-5' must be a finite number of tokens > 0" in err


def test_dapo_generation_rounds_multiply_the_generation(capsys, calibration):
    """DAPO's dynamic sampling regenerates the whole batch until enough groups are informative: 2.5 rounds
    (a run's mean filter_groups/num_gen_batches) take 2.5 x the generation; the passes train one batch."""
    cfg, plan, st = calibration
    dapo = estimate_step_time(cfg, plan, response_length_mean=3200, generation_rounds=2.5)
    assert dapo.phases["gen"].seconds == pytest.approx(2.5 * st.phases["gen"].seconds, rel=1e-9)
    assert dapo.phases["gen"].detail.startswith("2.5 rounds of: 16 engines")
    assert dapo.phases["update_actor"].seconds == st.phases["update_actor"].seconds
    with pytest.raises(ValueError, match=r"--generation-rounds=0.5 must be a number of rounds >= 1"):
        estimate_step_time(cfg, plan, generation_rounds=0.5)
    assert main(["plan", "gpu/qwen3_30b_a3b_dapo", "--json", "--generation-rounds", "3"]) == 0
    three = json.loads(capsys.readouterr().out)
    assert main(["plan", "gpu/qwen3_30b_a3b_dapo", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert three["phases"]["gen"]["seconds"] == pytest.approx(3 * one["phases"]["gen"]["seconds"], rel=1e-3)
    with pytest.raises(SystemExit) as stop:
        main(["plan", "gpu/qwen3_30b_a3b_dapo", "--generation-rounds", "0"])
    assert stop.value.code == 2 and "'0' must be a finite number of rounds >= 1" in capsys.readouterr().err


def test_cpu_runs_have_no_step_time(capsys):
    assert main(["plan", "grpo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] is None and out["tokens_per_s_per_gpu"] is None and out["phases"] == {}


def test_rollout_expert_parallelism_reads_a_quarter_of_the_experts_per_gpu():
    base = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.data_parallel_size=2"]
    steps = {}
    for ep in (1, 4):
        cfg = load_config("gpu/qwen3_30b_a3b_grpo", base + [f"actor_rollout_ref.rollout.expert_parallel_size={ep}"])
        steps[ep] = estimate_step_time(cfg, plan_run(cfg, suggest=False)).phases["gen"]
    # dense 1.53 G / TP 2 + experts 29.0 G / (EP 4 or TP 2), bf16: 14.94 GiB instead of 28.44 GiB per GPU
    dense, experts = 311164928 * 2 + 2048 + 48 * (18874368 + 4352 + 262144), 48 * 128 * 3 * 2048 * 768
    assert f"weights {(dense + experts) * 2 / 2 / GIB:.1f} GiB/GPU" in steps[1].detail  # 28.4
    assert f"weights {(dense * 2 / 2 + experts * 2 / 4) / GIB:.1f} GiB/GPU" in steps[4].detail  # 14.9
    assert steps[4].seconds < steps[1].seconds
