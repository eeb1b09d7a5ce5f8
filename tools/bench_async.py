"""Benchmark the trainer modes on one toy GRPO workload: synchronous-colocated vs one-step
off-policy vs fully asynchronous, on 2 CPU cores (the rollout on core 0, the trainer on core 1).

The workload is the toy GRPO recipe (``recipes/grpo.yaml``'s inline Qwen3-shaped model, briefly
SFT-warmed once and shared by every mode; task ``toy_reverse``) with a long-tailed response-length
distribution: each prompt batch's responses run to a length drawn from a Pareto tail
(``--min-len`` .. ``--max-len`` tokens, ``ignore_eos``), chosen by the batch's generation seed --
so the modes see the same lengths for the same batch. The modes:

* ``sync``: ``trainer.v1.trainer_mode=sync`` (today's loop: every step waits for the slowest batch);
* ``one_step_off``: ``colocate_async`` with one batch ahead (step k trains on weights after k-2);
* ``async``: ``separate_async`` (``recipes/grpo_async.yaml``: the rollout on its own CPU, bypass
  mode), ``--async-ahead`` batches ahead, staleness bound of the same number of versions;
* ``async_partial``: ``async`` with ``trainer.v1.partial_rollout=true`` (a weight push pauses the
  generation in flight, which continues with the new weights; ``partial_ratio``: the share of
  trained samples whose tokens span more than one version).

Every Ray worker thread of the rollout is pinned to core 0 and every thread of the actor's ranks
to core 1 (``os.sched_setaffinity`` per thread) after the workers start. Steps per minute are
measured from the end of step 1 to the end of the last step (step 1 holds the engines' warm-up and,
off-policy, is synchronous anyway); the reward is the mean ``critic/score/mean`` of the last two
steps, with the samples trained on so far. On CPU the only win is overlap of generation (core 0)
with training (core 1). Run (about 7 minutes)::

    python tools/bench_async.py [--steps 8] [--batch 8] [--n 4]

The last line printed is one JSON object with ``steps_per_min_sync``, ``steps_per_min_one_step_off``,
``steps_per_min_async``, ``steps_per_min_async_partial``, their ratios to sync, rewards, staleness
and peak RSS per mode (and ``partial_ratio_async_partial``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("sync", "one_step_off", "async", "async_partial")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="training steps per mode (>= 3)")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--min-len", type=int, default=8, help="shortest response (tokens)")
    p.add_argument("--max-len", type=int, default=96, help="longest response (tokens; the tail's cap)")
    p.add_argument("--alpha", type=float, default=1.1, help="Pareto tail index of the response length")
    p.add_argument("--async-ahead", type=int, default=2, help="batches the fully async rollouter runs ahead")
    p.add_argument("--sft-steps", type=int, default=20, help="supervised warm-up of the shared starting model")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps={args.steps} must be >= 3 (rates are measured after step 1)")
    for name in ("batch", "n", "min_len", "async_ahead"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.max_len < args.min_len:
        p.error(f"--max-len={args.max_len} must be >= --min-len={args.min_len}")
    if args.alpha <= 0:
        p.error(f"--alpha={args.alpha} must be > 0")
    args.modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(args.modes) - set(MODES))
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    return args


def response_length(seed: int, min_len: int, max_len: int, alpha: float) -> int:
    """The long-tailed length of the batch generated with ``seed``: ``min_len`` times a Pareto(alpha)
    draw, capped at ``max_len`` (deterministic in ``seed``)."""
    import random

    u = random.Random(seed).random()
    return int(min(max_len, math.ceil(min_len * (1.0 - u) ** (-1.0 / alpha))))


def steps_per_min(step_end_times: list[float]) -> float:
    """Steps per minute from the end of the first step to the end of the last."""
    if len(step_end_times) < 2:
        raise ValueError("steps_per_min needs at least two step end times")
    return 60.0 * (len(step_end_times) - 1) / (step_end_times[-1] - step_end_times[0])


class LongTailRollout:
    """The rollout worker's handle, with every training generation run to the long-tailed length
    its seed picks (``ignore_eos``); validation and everything else pass through."""

    def __init__(self, handle, min_len: int, max_len: int, alpha: float):
        self._handle, self._shape = handle, (min_len, max_len, alpha)

    def __getattr__(self, name):
        attr = getattr(self._handle, name)
        if name not in ("generate", "generate_tagged"):
            return attr
        shape = self._shape

        class _Method:
            def remote(self, prompts, **kwargs):
                if "seed" in kwargs and not kwargs.get("validate"):
                    kwargs.update(response_length=response_length(kwargs["seed"], *shape), ignore_eos=True)
                return attr.remote(prompts, **kwargs)

        return _Method()


def _overrides(args, mode: str) -> tuple[str, list[str]]:
    common = [
        f"trainer.total_training_steps={args.steps}",
        "trainer.sft_warmup_steps=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[console]",
        f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch * args.n}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"data.max_response_length={args.max_len}",
        f"actor_rollout_ref.rollout.max_num_seqs={args.batch * args.n}",
        "data.task_kwargs={num_samples: 512}",
    ]
    if mode == "sync":
        return "grpo", common
    if mode == "one_step_off":
        return "grpo", [
            *common,
            "trainer.v1.trainer_mode=colocate_async",
            "trainer.v1.colocate_async.num_warmup_batches=1",
            "trainer.v1.sampler.max_off_policy_threshold=1",
        ]
    partial = ["trainer.v1.partial_rollout=true"] if mode == "async_partial" else []
    return "grpo_async", [
        *common,
        "trainer.v1.separate_async.parameter_sync_step=1",
        f"trainer.v1.separate_async.num_warmup_batches={args.async_ahead}",
        f"trainer.v1.sampler.max_off_policy_threshold={args.async_ahead}",
        *partial,
    ]


def _pin(trainer) -> dict:
    """Rollout threads on core 0, the actor ranks' threads on core 1; returns the pids."""
    import ray

    def pin_actor_rank(worker):  # runs inside each actor rank (pickled by value)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), {1})
            except OSError:  # a thread that ended meanwhile
                pass
        return os.getpid()

    rollout_pid = ray.get(trainer.rollout.__ray_call__.remote(lambda self: (self.pin_cpus([0]), os.getpid())[1]))
    actor_pids = ray.get([w.__ray_call__.remote(pin_actor_rank) for w in trainer.actor.workers])
    return {"rollout": rollout_pid, "actor": actor_pids}


def _run_mode(args, mode: str, model_path: str, root: str) -> dict:
    import psutil

    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.trainer import RayPPOTrainer

    recipe, overrides = _overrides(args, mode)
    config = RunConfig.from_dict(compose(recipe, [*overrides, f"trainer.default_local_dir={root}/{mode}"]))
    trainer = RayPPOTrainer(config, model_path=model_path, log_dir=f"{root}/{mode}")
    ends, peak = [], [0]
    try:
        trainer.init_workers()
        pids = _pin(trainer)
        router = trainer.rollout_phase.rollout  # generation goes through the router's copies only
        router.replicas = [
            dataclasses.replace(r, actor=LongTailRollout(r.actor, args.min_len, args.max_len, args.alpha))
            for r in router.replicas
        ]
        procs = [psutil.Process(p) for p in [pids["rollout"], *pids["actor"]]]

        def on_step(metrics):
            ends.append(time.perf_counter())
            peak[0] = max(peak[0], sum(p.memory_info().rss for p in procs))

        start = time.perf_counter()
        history = trainer.fit(on_step=on_step)
        wall = time.perf_counter() - start
    finally:
        trainer.shutdown()
    rewards = [h["critic/score/mean"] for h in history]
    return {
        "steps_per_min": steps_per_min(ends),
        "wall_s": wall,
        "first_step_s": ends[0] - start,
        "reward_last2": sum(rewards[-2:]) / 2,
        "reward_per_step": rewards,
        "response_length_mean": sum(h["response_length/mean"] for h in history) / len(history),
        "staleness_mean": sum(h.get("async/staleness_mean", 0.0) for h in history) / len(history),
        "trainer_idle_s": sum(h.get("async/trainer_idle_s", 0.0) for h in history),
        "partial_ratio": sum(h.get("async/partial/partial_ratio", 0.0) for h in history) / len(history),
        "samples": len(history) * args.batch * args.n,
        "peak_rss_gb": peak[0] / 2**30,
    }


def main(argv=None) -> dict:
    args = _parse(argv)
    import ray

    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose
    from megatron_rl.job.main_job import prepare_policy_model

    root = tempfile.mkdtemp(prefix="bench_async_")  # the model and the runs' checkpoints; removed at the end
    results = {}
    try:
        base = RunConfig.from_dict(
            compose("grpo", [*_overrides(args, "sync")[1], f"trainer.sft_warmup_steps={args.sft_steps}"])
        )
        model_path = prepare_policy_model(base, f"{root}/model")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for mode in args.modes:
                results[mode] = _run_mode(args, mode, model_path, root)
                print(f"{mode}: {json.dumps(results[mode])}", flush=True)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {f"steps_per_min_{m}": r["steps_per_min"] for m, r in results.items()}
    if "sync" in results:
        out.update(
            {
                f"speedup_{m}": r["steps_per_min"] / results["sync"]["steps_per_min"]
                for m, r in results.items()
                if m != "sync"
            }
        )
    out.update({f"reward_{m}": r["reward_last2"] for m, r in results.items()})
    out.update({f"staleness_mean_{m}": r["staleness_mean"] for m, r in results.items()})
    out.update({f"peak_rss_gb_{m}": r["peak_rss_gb"] for m, r in results.items()})
    if "async_partial" in results:
        out["partial_ratio_async_partial"] = results["async_partial"]["partial_ratio"]
    out.update(
        steps=args.steps,
        batch=args.batch,
        n=args.n,
        min_len=args.min_len,
        max_len=args.max_len,
        alpha=args.alpha,
        async_ahead=args.async_ahead,
        samples=args.steps * args.batch * args.n,
        cores={"rollout": 0, "trainer": 1},
    )
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
