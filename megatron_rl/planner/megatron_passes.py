"""The Megatron passes of the step-time model: log-prob forwards and updates, per pipeline stage, with
their exposed communication and the optimizer step (``step_time``'s docstring, "log-prob and update passes")."""

from __future__ import annotations

import math

from megatron_rl.planner.hardware import (
    ATTENTION_EFFICIENCY,
    DENSE_GEMM_EFFICIENCY,
    GROUPED_GEMM_EFFICIENCY,
    HBM_COPY_EFFICIENCY,
)
from megatron_rl.planner.activation_traffic import head_elements, layer_elements, norm_widths
from megatron_rl.planner.memory import count_params
from megatron_rl.planner.step_run import Pass, PhaseTime, Run, attention_width, link, stage_work
from megatron_rl.models.gpt import padded_vocab_size

__all__ = ["megatron_pass"]


def megatron_pass(run: Run, p: Pass) -> PhaseTime:
    """Seconds of the Megatron pass ``p`` of ``run``: its slowest stage's compute and exposed communication,
    the pipeline bubble, and for an update the optimizer step's all-gather and Adam."""
    if p.skipped:
        return PhaseTime(0.0, "skipped", "bypass mode: the rollout's log-probs are the old ones")
    m, hw, s = p.model, run.hw, p.sizes
    world, tp, pp, cp, ep, etp = s["world"], s["tp"], s["pp"], s["cp"], s["ep"], s["etp"]
    dp, vpp = s["dp"], s["vpp"] or 1
    seq = run.prompt_length + run.response_mean
    tokens = run.sequences * seq
    passes = (3 if p.trainable else 1) + (1 if p.trainable and p.recompute == "full" else 0)
    attn_passes = passes + (1 if p.trainable and p.recompute == "selective" else 0)
    directions = passes  # every forward and backward moves the layer's activations once
    per_rank = tokens / (dp * tp * cp)  # what one rank of a stage computes: its DP share, split over TP x CP
    local = tokens / (dp * cp)  # the [tokens, h] a TP group's collectives move
    width = attention_width(m)
    stages, overlapped_by_stage, split_by_stage = [], [], []
    base_passes = passes - (1 if p.trainable and p.frozen_base else 0)  # a frozen base: no weight-gradient GEMMs
    adapter_work = p.adapter_work or (0,) * len(p.stage_layers)
    # the LM head scores the response positions only (the engine projects just the positions its loss reads)
    scored = run.response_mean / seq
    head = 0 if p.value_head else padded_vocab_size(m.vocab_size, 1, m.make_vocab_size_divisible_by) * m.hidden_size
    memory_bw = hw.hbm_bytes_per_s * HBM_COPY_EFFICIENCY
    sp = p.sequence_parallel and tp > 1
    dense_layer = layer_elements(m, tp=tp, sequence_parallel=sp, fused=p.fused_kernels, moe=False)
    moe_layer = layer_elements(m, tp=tp, sequence_parallel=sp, fused=p.fused_kernels, moe=True)
    work = stage_work(m, p.stage_layers, p.value_head)
    for i, ((dense, expert, layers, moe_layers), adapter) in enumerate(zip(work, adapter_work)):
        last = i == len(work) - 1
        if last:
            dense -= head * (1 - scored)
        elements = (layers - moe_layers) * dense_layer + moe_layers * moe_layer
        if i == 0:
            elements += 2 * m.hidden_size * (1 if sp else tp)  # the embedding's lookup: read and write h
        if last:  # the final norm; the log-softmax over the vocabulary of the scored positions
            elements += norm_widths(m, fused=p.fused_kernels) * m.hidden_size * (1 if sp else tp)
            elements += 0 if p.value_head else scored * head_elements(m, fused=p.fused_kernels)
        memory = per_rank * passes * elements * p.activation_bytes / memory_bw
        gemm = per_rank * (
            base_passes * 2 * dense / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY)
            + base_passes * 2 * expert / (hw.bf16_flops * GROUPED_GEMM_EFFICIENCY)
            + passes * 2 * adapter / (hw.bf16_flops * DENSE_GEMM_EFFICIENCY)
            + attn_passes * 2 * layers * width * seq / (hw.bf16_flops * ATTENTION_EFFICIENCY)
        )
        compute = gemm + memory  # the element-wise kernels run between the GEMMs, not under them
        comm = 0.0
        if tp > 1:  # per layer and direction: all-gather + reduce-scatter of [tokens, h] (= one all-reduce) twice
            bw, _ = link(hw, tp)
            comm += layers * directions * 2 * 2 * (tp - 1) / tp * local * m.hidden_size * 2 / bw
        if m.is_moe and ep > 1:  # dispatch + combine of top-k copies of each token, per MoE layer and direction
            bw, _ = link(hw, ep * etp)
            comm += moe_layers * directions * 2 * per_rank * m.moe_router_topk * m.hidden_size * 2 * (ep - 1) / ep / bw
        ring = 0.0
        if cp > 1:
            bw, _ = link(hw, tp * cp)
            kv_heads = max((m.num_query_groups or m.num_attention_heads) // tp, 1)
            ring = layers * directions * (cp - 1) * 2 * local * kv_heads * m.head_dim * 2 / bw
        stages.append((compute, comm))
        overlapped_by_stage.append(ring)
        split_by_stage.append((gemm, memory))
    # the slowest stage decides: every micro-batch waits for it, and the bubble is (pp - 1) / (vpp x micro) of it
    slowest = max(range(pp), key=lambda i: sum(stages[i]) + max(overlapped_by_stage[i] - stages[i][0], 0))
    compute, exposed = stages[slowest]
    overlapped = overlapped_by_stage[slowest]
    steps = run.mini_batches if p.trainable else 1
    micro = max(tokens / dp / steps / p.micro_tokens, 1.0)
    compute *= 1 + (pp - 1) / (vpp * micro)
    if p.trainable:  # per optimizer step: gradient reduce-scatter (overlapped), parameter all-gather (exposed)
        dense_local, expert_local = (
            p.adapter_local
            if p.frozen_base
            else count_params(m, tp=tp, pp=pp, ep=ep, etp=etp, value_head=p.value_head, stage_layers=p.stage_layers)
        )  # most loaded stage
        bw, _ = link(hw, world // pp)
        for params, group in ((dense_local, dp * cp), (expert_local, s["expert_dp"])):
            if group > 1 and params:
                overlapped += steps * params * 4 * (group - 1) / group / bw
                if p.distributed_optimizer:
                    exposed += steps * params * 2 * (group - 1) / group / bw
        shard = (
            (dense_local / (dp * cp) + expert_local / s["expert_dp"])
            if p.distributed_optimizer
            else dense_local + expert_local
        )
        exposed += steps * shard * 2 * 18 / (hw.hbm_bytes_per_s * HBM_COPY_EFFICIENCY)  # Adam reads + writes 18 B
    seconds = (max(compute, overlapped) + exposed) * p.repeats
    gemm, memory = split_by_stage[slowest]
    bound = "compute" if gemm >= memory else "memory bandwidth"
    bound = "communication" if exposed + max(overlapped - compute, 0) > compute else bound
    # the host's own work: one call to the role's workers, each micro-batch's and each optimizer step's
    per_step = run.sequences / dp / steps
    if p.micro_rows:
        micro_batches = steps * math.ceil(per_step / p.micro_rows)
    else:
        micro_batches = steps * max(math.ceil(per_step * seq / p.micro_tokens), 1)
    micro_host = (hw.train_micro_overhead_s if p.trainable else hw.forward_micro_overhead_s) or 0.0
    host = micro_batches * micro_host + (steps * (hw.optimizer_step_overhead_s or 0.0) if p.trainable else 0.0)
    host = host * p.repeats + (hw.call_overhead_s or 0.0)
    if host > seconds:
        bound = "host overhead"
    seconds += host
    where = f", slowest stage {slowest} of {pp} ({p.stage_layers[slowest]} layers)" if pp > 1 else ""
    frozen = f" (LoRA: the frozen base's GEMMs {base_passes})" if base_passes != passes else ""
    detail = (
        f"{tokens / 1e6:.2f} M tokens, {passes} pass{'es' if passes > 1 else ''}{frozen}, compute {compute:.1f} s "
        f"(GEMMs {gemm:.1f} s, element-wise memory traffic {memory:.1f} s), "
        f"exposed communication {exposed + max(overlapped - compute, 0):.1f} s{where}"
        + (f", host work {host:.3f} s ({micro_batches} micro-batches)" if host else "")
    )
    return PhaseTime(seconds, bound, detail, stages=tuple(c + e for c, e in stages))
