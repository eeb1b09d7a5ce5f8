"""Check the step-time model's structure on a CPU run: predicted vs measured share of each phase.

Runs a toy recipe (``megatron-rl train <recipe>``, no warm-up or validation) for ``--steps`` steps, reads
the ``timing_s/*`` of every step after the first (the first compiles and warms vLLM), then measures this
host's row (``megatron_rl.planner.cpu_row``: a matmul's rate on the threads a rank has, a copy's, the actor's
host work per micro-batch and optimizer step from passes of one-row micro-batches, a phase call's through the
trainer's worker group, and the vLLM engine's host work per decode step from two fixed-length generations of one and ``--engine-batch``
sequences on the run's exported checkpoint) and asks ``estimate_step_time`` for the same run with the measured mean prompt and
response lengths and generation rounds (DAPO's ``filter_groups/num_gen_batches``): the workload, not a fit. Nothing is fitted to the phases' times.
The engine is timed as the run built it: with ``lora.merge: false`` vLLM's LoRA slot and the run's exported adapter.
A ``separate_async`` run's generation overlaps the trainer: ``compare`` judges it by the engine's busy seconds.

The comparison: a phase's measured share is ``sum(timing_s/<phase>) / sum(timing_s/step)`` over the
steps kept, its predicted share ``seconds / step_time_s``; a phase passes when
``|predicted - measured| / measured <= --tolerance`` (0.3, issue 30's "within 30 %"). Phases with a
measured share below ``--min-share`` (0.05) are reported but not judged: a relative error of a few
milliseconds says nothing of the structure. The step's unmodelled remainder (``reward``, ``adv``, the loop)
is reported as its own share. The run and the row are timed one after the other on a host other work may
share: the JSON carries the 1-minute load average at the run's start and end and at the row's measurement
(figures taken under different loads do not compare). Prints a table to stderr and, last, one JSON line.

    python tools/bench_phase_share.py --recipe grpo
    python tools/bench_phase_share.py --recipe ppo --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TIMED_PHASES = ("gen", "old_log_prob", "ref", "teacher", "values", "update_critic", "update_actor", "update_weights")
"""The model's phases that the trainer times: a stage has one name (``StepSchedule``, ``timing_s/<name>``, the
planner). ``offload`` has no timer of its own (the moves run inside the phases); it is 0 on a CPU run."""
EXTRA_TIMERS = {"gen": ("gen_max",)}
"""Timers a phase of the model also covers: ReMax's greedy baseline generation (``timing_s/gen_max``, verl's key)
is part of the model's ``gen`` (its ``extra_generations``)."""
JOB_OVERRIDES = (
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.logger=[console]",
)


def run_job(recipe: str, steps: int, out_dir: Path, overrides: list[str]) -> Path:
    """Train ``recipe`` for ``steps`` steps into ``out_dir``; its ``metrics.jsonl``."""
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", recipe, f"trainer.total_training_steps={steps}"]
    cmd += [*JOB_OVERRIDES, f"trainer.default_local_dir={out_dir}", *overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"bench_phase_share: the run of {recipe} failed (exit {done.returncode})")
    return out_dir / "metrics.jsonl"


def measured_phases(metrics_path: Path, skip: int = 1) -> dict:
    """Summed ``timing_s/*`` of the steps after the first ``skip``, and the workload's mean lengths."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r and "response_length/mean" in r][skip:]
    if not rows:
        raise SystemExit(f"bench_phase_share: no step after the first {skip} in {metrics_path}")
    timing: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("timing_s/"):
                timing[k[len("timing_s/") :]] = timing.get(k[len("timing_s/") :], 0.0) + float(v)
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {
        "steps": len(rows),
        "timing": timing,
        "prompt_mean": mean("prompt_length/mean"),
        "response_mean": mean("response_length/mean"),
        "response_max": max(r["response_length/max"] for r in rows),
        # DAPO's dynamic sampling: the generation rounds a step took (1 without it)
        "gen_rounds": sum(r.get("filter_groups/num_gen_batches", 1.0) for r in rows) / len(rows),
        # agent sessions (rollout.multi_turn): how many turns and tool calls the measured steps generated
        "agent": {
            k: round(sum(r[k] for r in rows) / len(rows), 3)
            for k in ("agent/num_turns/mean", "agent/tool_call_rate")
            if all(k in r for r in rows)
        },
        # separate_async: the seconds of each step's wall time the engine was generating (None: not async)
        "rollout_busy": (
            sum(r["timing_s/step"] - r["async/rollout_idle_s"] for r in rows)
            if all("async/rollout_idle_s" in r for r in rows)
            else None
        ),
    }


def measure_engine(hf_dir: Path, rollout_cfg, prompt_len: int, batch: int, repeats: int, adapter=None) -> dict:
    """Wall seconds of a generation of ``rollout_cfg.response_length`` forced tokens for one sequence and for
    ``batch`` at once (n=1), on the run's own exported checkpoint and engine settings, in a process of its own
    as the job's rollout actor (``engine_in_child``): the median of ``repeats`` alternating rounds. (An engine
    built inside this process, beside the matmul's two OpenMP threads, swung from 1.2 to 110 ms a step
    between rounds on this 2-core host; in its own process, with one thread as the job's, rounds agree
    within ~10 %.) ``rollout_cfg`` is the engine the run built (``trainer.placement.lora_rollout_config``:
    with ``lora.merge: false`` vLLM's LoRA slot) and ``adapter`` the PEFT directory the run's engine generated
    with (its exported ``final_hf/lora_adapter``; None: the base model): vLLM's LoRA path is host work of
    every decode step (on this host it made the toy's generation 4.9x slower than the plain engine's)."""
    import torch

    from megatron_rl.workers.rollout_worker import RolloutWorker

    worker = RolloutWorker(str(hf_dir), rollout_cfg)  # the job's rollout actor, one torch thread, as the job has
    engine = worker.rollout
    if adapter is not None:
        engine.load_lora_adapter(adapter)  # every generation below uses it, as the run's did
    tokens = rollout_cfg.response_length
    vocab = engine.llm.get_tokenizer().vocab_size
    g = torch.Generator().manual_seed(0)

    def timed(b: int) -> float:
        prompts = torch.randint(3, vocab, (b, prompt_len), generator=g).tolist()
        start = time.perf_counter()
        engine.generate(prompts, n=1, ignore_eos=True, response_length=tokens)
        return time.perf_counter() - start

    timed(batch)  # warm the shapes
    out = {1: [], batch: []}
    for _ in range(repeats):  # alternating, so a burst of other work on the host hits both alike
        for b in out:
            out[b].append(timed(b))
    return {
        "one_s": sorted(out[1])[repeats // 2],
        "batch_s": sorted(out[batch])[repeats // 2],
        "batch": batch,
        "tokens": tokens,
        "rounds": {"one_s": [round(t, 4) for t in out[1]], "batch_s": [round(t, 4) for t in out[batch]]},
    }


def engine_in_child(*args) -> dict:
    """``measure_engine`` in a fresh spawned process: the engine binds its threads and sets torch's to one,
    which must not touch the matmul this process times, nor this process's threads the engine's."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_engine, *args).result()


def _pass_overheads(rank: int, world: int, model, threads: int) -> dict:
    """``cpu_row.megatron_host_overheads`` in a rank of its own with the run's rank threads."""
    import torch

    from megatron_rl.planner.cpu_row import megatron_host_overheads

    torch.set_num_threads(threads)
    return megatron_host_overheads(model)


def compare(st, measured: dict, min_share: float, tolerance: float) -> dict:
    """Per phase: predicted and measured seconds per step and shares, the relative error and the verdict.

    With ``separate_async``'s overlap (``st.overlap``) the trainer's ``timing_s/gen`` is its wait for a batch,
    not the generation: ``gen`` is then measured as the engine's busy seconds within the steps
    (``timing_s/step - async/rollout_idle_s``), and the wait is a row of its own, ``gen_wait``, predicted as
    ``max(gen - train, 0)`` (the step less the trainer's own phases). Overlapped shares sum past 1."""
    steps, timing = measured["steps"], measured["timing"]
    step_measured = timing["step"] / steps
    phases, modelled = {}, 0.0

    def row(name: str, timer, pred_s: float, meas: float, bound: str) -> dict:
        pred_share, meas_share = pred_s / st.step_time_s, meas / step_measured
        judged = meas_share >= min_share
        rel = (pred_share - meas_share) / meas_share if meas_share > 0 else None
        return {
            "timer": timer,
            "predicted_s": round(pred_s, 4),
            "measured_s": round(meas, 4),
            "predicted_share": round(pred_share, 4),
            "measured_share": round(meas_share, 4),
            "relative_error": None if rel is None else round(rel, 3),
            "bound": bound,
            "judged": judged,
            "within": None if not judged else abs(rel) <= tolerance,
        }

    if st.overlap and measured.get("rollout_busy") is None:
        raise SystemExit("bench_phase_share: an overlapped async run must log async/rollout_idle_s every step")
    for name, p in st.phases.items():
        timers = (name, *EXTRA_TIMERS.get(name, ())) if name in TIMED_PHASES else ()
        timer = "+".join(t for t in timers if t in timing) or None
        meas = sum(timing.get(t, 0.0) for t in timers) / steps  # the trainer's own time in the phase
        modelled += meas
        if st.overlap and name == "gen":  # the trainer waited ``meas``; the engine was busy for rollout_busy
            phases[name] = row(name, "step-async/rollout_idle_s", p.seconds, measured["rollout_busy"] / steps, p.bound)
            trainer_s = sum(q.seconds for n, q in st.phases.items() if n != "gen")
            phases["gen_wait"] = row("gen_wait", timer, max(st.step_time_s - trainer_s, 0.0), meas, "the slower side")
        else:
            phases[name] = row(name, timer, p.seconds, meas, p.bound)
    judged = [p for p in phases.values() if p["judged"]]
    return {
        "phases": phases,
        "predicted_step_s": round(st.step_time_s, 4),
        "measured_step_s": round(step_measured, 4),
        "unmodelled_share": round(1 - modelled / step_measured, 4),
        "all_within": all(p["within"] for p in judged),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="grpo", help="a CPU recipe under recipes/ (or a YAML path)")
    p.add_argument("--steps", type=int, default=4, help="training steps; the first is dropped (warm-up)")
    p.add_argument("--min-share", type=float, default=0.05, help="phases below this measured share are not judged")
    p.add_argument("--tolerance", type=float, default=0.3, help="allowed |pred - meas| / meas share")
    p.add_argument("--engine-batch", type=int, default=32, help="sequences of the engine's second timed generation")
    p.add_argument("--engine-repeats", type=int, default=11, help="alternating rounds; the median of each counts")
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for the run")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first step is dropped), got {args.steps}")
    if args.engine_batch < 2:
        p.error(f"--engine-batch must be >= 2, got {args.engine_batch}")

    from megatron_rl.job.main_job import load_run_config
    from megatron_rl.planner import plan_run
    from megatron_rl.planner.cpu_row import (
        call_overhead,
        cpu_hardware,
        engine_host_overheads,
        measure_host,
        rank_threads,
    )
    from parallel.testing import run_distributed
    from megatron_rl.planner.step_run import stage_work
    from megatron_rl.planner.step_time import estimate_step_time
    from megatron_rl.trainer.placement import lora_rollout_config

    overrides = [*JOB_OVERRIDES, *args.overrides]
    config, _ = load_run_config(args.recipe, overrides)
    if config.trainer.device != "cpu":
        p.error(f"--recipe {args.recipe} trains on trainer.device={config.trainer.device}; this check is for CPU runs")
    load = {"job_start": os.getloadavg()[0]}  # the host is shared: the run and the row are timed apart
    with tempfile.TemporaryDirectory(prefix="bench_phase_share_") as tmp:
        out_dir = Path(args.out or tmp) / "run"
        measured = measured_phases(run_job(args.recipe, args.steps, out_dir, args.overrides))
        load["job_end"] = os.getloadavg()[0]
        plan = plan_run(config)
        threads = rank_threads(os.cpu_count() or 1, len(plan.roles) * config.trainer.world_size, plan.engines.replicas)
        host = measure_host(plan.model.params_dtype, threads=threads)
        dense, routed, _, _ = stage_work(plan.model, (plan.model.num_layers,))[0]
        gemm_s_per_token = 2 * (dense + routed) / host["gemm_flops"]
        rollout_cfg = lora_rollout_config(config)
        slot = rollout_cfg is not config.actor_rollout_ref.rollout  # lora.merge: false: the engine has a LoRA slot
        adapter = out_dir / "final_hf" / "lora_adapter" if slot else None
        if adapter is not None and not adapter.is_dir():
            raise SystemExit(f"bench_phase_share: the run exported no LoRA adapter at {adapter}")
        engine = engine_in_child(
            out_dir / "final_hf",
            rollout_cfg,
            max(round(measured["prompt_mean"]), 1),
            args.engine_batch,
            args.engine_repeats,
            adapter,
        )
        passes = run_distributed(_pass_overheads, 1, plan.model, threads, timeout_s=600)[0]
        group_one_s = call_overhead(plan.model)
        call_s = max(group_one_s - passes["passes_s"]["one_f"], 0.0)
        load["row_measured"] = os.getloadavg()[0]
    step_s, seq_s = engine_host_overheads(
        engine["one_s"], engine["batch_s"], engine["batch"], engine["tokens"], gemm_s_per_token
    )
    row = cpu_hardware(
        gemm_flops=host["gemm_flops"],
        copy_bytes_per_s=host["copy_bytes_per_s"],
        decode_step_overhead_s=step_s,
        decode_seq_overhead_s=seq_s,
        call_overhead_s=call_s,
        forward_micro_overhead_s=passes["forward_micro_overhead_s"],
        train_micro_overhead_s=passes["train_micro_overhead_s"],
        optimizer_step_overhead_s=passes["optimizer_step_overhead_s"],
    )
    st = estimate_step_time(
        config,
        plan,
        hardware=row,
        response_length_mean=max(measured["response_mean"], 1.0),
        response_length_p99=max(measured["response_max"], measured["response_mean"], 1.0),
        prompt_length_mean=measured["prompt_mean"],
        generation_rounds=measured["gen_rounds"],
    )
    result = {
        "recipe": args.recipe,
        "steps_measured": measured["steps"],
        **compare(st, measured, args.min_share, args.tolerance),
        "tolerance": args.tolerance,
        "min_share": args.min_share,
        "workload": {
            **{k: round(measured[k], 2) for k in ("prompt_mean", "response_mean", "response_max", "gen_rounds")},
            **measured["agent"],
        },
        "host": {
            "gemm_gflops": round(host["gemm_flops"] / 1e9, 2),
            "copy_gb_per_s": round(host["copy_bytes_per_s"] / 1e9, 2),
            "threads": host["threads"],
            "engine_one_s": round(engine["one_s"], 4),
            "engine_batch_s": round(engine["batch_s"], 4),
            "engine_batch": engine["batch"],
            "engine_tokens": engine["tokens"],
            "engine_lora_adapter": adapter is not None,
            "decode_step_overhead_ms": round(step_s * 1e3, 3),
            "decode_seq_overhead_us": round(seq_s * 1e6, 2),
            "engine_rounds": engine["rounds"],
            "call_overhead_ms": round(call_s * 1e3, 3),
            "group_call_one_row_ms": round(group_one_s * 1e3, 3),
            **{k[:-2] + "_ms": round(v * 1e3, 3) for k, v in passes.items() if k.endswith("_overhead_s")},
            "tiny_passes_s": passes["passes_s"],
        },
        "load_avg_1m": {k: round(v, 2) for k, v in load.items()},
        "unmodelled_timers": sorted(set(measured["timing"]) - set(TIMED_PHASES) - {"gen_max", "step"}),
    }
    print(
        f"{args.recipe}: predicted {st.step_time_s:.3f} s/step, measured {result['measured_step_s']:.3f}",
        file=sys.stderr,
    )
    for name, ph in result["phases"].items():
        verdict = "-" if not ph["judged"] else ("ok" if ph["within"] else "MISS")
        rel = "" if ph["relative_error"] is None else f"{ph['relative_error']:+.0%}"
        print(
            f"  {name:<16} predicted {ph['predicted_share']:6.1%} ({ph['predicted_s']:.3f} s)  measured "
            f"{ph['measured_share']:6.1%} ({ph['measured_s']:.3f} s)  {rel:>6}  {verdict}",
            file=sys.stderr,
        )
    print(f"  unmodelled (reward, adv, loop): {result['unmodelled_share']:.1%} of the measured step", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
