"""The main job, ``megatron-rl train [recipe] [key=value ...]``: one RL run from a recipe to an HF
checkpoint, with a progress bar, ``metrics.jsonl``, a reward-curve PNG and a closing summary.

``run_train(recipe, overrides)``: load and check the config (the planner's checks first), start
Ray, prepare the starting models (``megatron_rl.job.prepare``), ``RayPPOTrainer.fit`` with a tqdm
bar, save the actor as an HF checkpoint, plot the reward curve and print the summary.
``build_trainer(config, run_dir)`` is its middle part (models prepared, trainer constructed).

Run directory (``trainer.default_local_dir``; the CPU recipes set ``outputs/<experiment_name>``)::

    base_model/  sft_model/  train.parquet  config.yaml  metrics.jsonl
    reward_curve.png  final_hf/  summary.json
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_rl.config import TrainerRunConfig
from megatron_rl.job.prepare import prepare_policy_model, prepare_teacher_model
from megatron_rl.job.report import REWARD_KEY, plot_reward_curve

__all__ = ["build_trainer", "run_train"]

_RUN_ARTIFACTS = ("base_model", "sft_model", "teacher_base", "teacher_model", "final_hf", "metrics.jsonl",
                  "reward_curve.png", "summary.json", "train.parquet", "val.parquet")


def build_trainer(config: TrainerRunConfig, run_dir: Optional[str | Path] = None, *, log=print,
                  **trainer_kwargs: Any):
    """The ``RayPPOTrainer`` of ``config`` in ``run_dir`` (default ``trainer.default_local_dir``), its
    policy (and teacher) prepared first."""
    from megatron_rl.trainer.ppo_trainer import RayPPOTrainer

    run_dir = Path(run_dir if run_dir is not None else config.trainer.default_local_dir).expanduser()
    model_path = prepare_policy_model(config, run_dir, log=log)
    teacher_path = prepare_teacher_model(config, run_dir, model_path, log=log) if config.distillation.enabled else None
    return RayPPOTrainer(config, model_path=model_path, log_dir=run_dir, teacher_path=teacher_path, **trainer_kwargs)


def run_train(recipe: Optional[str] = None, overrides: Sequence[str] = (), *, progress: bool = True,
              log=print) -> dict[str, Any]:
    """Run ``recipe`` (None = the CPU toy ``grpo``) with ``overrides``; return the summary dict.

    Checks the layout with the planner first (ValueError if it cannot run), starts Ray when it
    is not running (or joins ``RAY_ADDRESS``), writes the run directory (module docstring) and
    prints a summary. Artifacts of an earlier run in the same directory are replaced -- except
    when a checkpoint there is resumed (``trainer.resume_mode``): then metrics.jsonl continues.
    """
    import ray
    from tqdm import tqdm

    from megatron_rl.config.loader import compose, dump_config

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load "Loading weights" bars would bury the run's own
    wall = time.perf_counter()
    config = TrainerRunConfig.from_dict(compose(recipe, overrides))
    out_dir = Path(config.trainer.default_local_dir).expanduser().resolve()
    config.trainer.default_local_dir = str(out_dir)  # one absolute run directory for every process
    from megatron_rl.planner import check_plan
    from megatron_rl.trainer.checkpoint import find_resume_dir

    plan = check_plan(config)  # a layout that cannot run is refused before anything is allocated
    log(f"plan: fits, peak {plan.peak_bytes / 2**30:.2f} of {plan.memory_budget_bytes / 2**30:.1f} GiB per "
        f"{'GPU' if plan.device == 'cuda' else 'rank'} ({plan.peak_phase})")
    resume = find_resume_dir(out_dir, config.trainer.resume_mode, config.trainer.resume_from_path)
    for name in _RUN_ARTIFACTS:
        if resume is not None and name == "metrics.jsonl":  # the resumed run appends to it
            continue
        target = out_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(dump_config(config))
    log(f"megatron-rl train: {recipe or 'grpo'} -> {out_dir}")

    if progress:  # the bar replaces the console logger's line per step
        config.trainer.logger = [name for name in config.trainer.logger if name != "console"]
    started_ray = not ray.is_initialized()
    if started_ray:
        if os.environ.get("RAY_ADDRESS"):
            # Join the running cluster (recipes/slurm/train.sbatch, `ray job submit`); Ray refuses
            # num_cpus/num_gpus when connecting, and shutdown() then only disconnects this driver.
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
        else:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
    trainer = bar = None

    def on_step(metrics: dict) -> None:
        if REWARD_KEY in metrics:
            bar.set_postfix({"reward": f"{metrics[REWARD_KEY]:.3f}", "resp_len": f"{metrics['response_length/mean']:.1f}",
                             "s/step": f"{metrics['timing_s/step']:.1f}"}, refresh=False)
        else:
            bar.set_postfix({"skipped": "reward failed"}, refresh=False)
        bar.update(1)

    try:
        trainer = build_trainer(config, out_dir, log=log)
        total = trainer.total_steps
        start = time.perf_counter()
        trainer.init_workers()
        log(f"workers started in {time.perf_counter() - start:.1f}s (the first step also waits for them to load)")
        bar = tqdm(total=total, desc=config.algorithm.adv_estimator.upper(), unit="step", disable=not progress,
                   dynamic_ncols=True)
        start = time.perf_counter()
        history = trainer.fit(total, on_step=on_step)
        rl_seconds = time.perf_counter() - start
        bar.close()
        final = None if config.trainer.val_only else trainer.save_hf_checkpoint(out_dir / "final_hf")
    finally:
        if bar is not None:
            bar.close()
        if trainer is not None:
            trainer.shutdown()
        if started_ray:
            ray.shutdown()
    if config.trainer.val_only:  # nothing was trained: the validation metrics are the result
        summary = {"val_metrics": history[0] if history else {}, "wall_seconds": time.perf_counter() - wall,
                   "output_dir": str(out_dir), "metrics": str(out_dir / "metrics.jsonl")}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log("\ndone: validation only (trainer.val_only); " + ", ".join(
            f"{k}={v:.4g}" for k, v in summary["val_metrics"].items()))
        return summary
    # The whole run (a resumed one included), training steps that were not skipped.
    history = [row for row in (json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()
                               if line.strip()) if REWARD_KEY in row]
    if not history:
        raise RuntimeError(f"no training step of {out_dir} produced a reward (see metrics.jsonl)")
    png = plot_reward_curve(history, out_dir / "reward_curve.png",
                            title=f"{config.trainer.experiment_name}: {config.algorithm.adv_estimator} on {config.data.task}")
    rewards = [float(h[REWARD_KEY]) for h in history]
    tail = rewards[-min(3, len(rewards)):]
    summary = {
        "steps": len(history), "first_step_reward": rewards[0], "last_step_reward": rewards[-1],
        "last3_mean_reward": sum(tail) / len(tail), "max_reward": max(rewards),
        "reward_gain": rewards[-1] - rewards[0],
        # exact-answer rate (rule rewards that report "acc"); None when not logged
        "first_step_exact": history[0].get("reward/acc/mean"), "last_step_exact": history[-1].get("reward/acc/mean"),
        "rl_seconds": rl_seconds,
        "wall_seconds": time.perf_counter() - wall, "output_dir": str(out_dir),
        "metrics": str(out_dir / "metrics.jsonl"), "reward_curve": str(png), "hf_checkpoint": str(final),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"\ndone: {summary['steps']} steps in {summary['wall_seconds']:.0f}s "
        f"(RL {rl_seconds:.0f}s); mean reward {rewards[0]:.3f} (step 1) -> {rewards[-1]:.3f} "
        f"(step {len(rewards)}), gain {summary['reward_gain']:+.3f}"
        + (f"; exact answers {summary['first_step_exact']:.1%} -> {summary['last_step_exact']:.1%}"
           if summary["last_step_exact"] is not None else "") + "\n"
        f"  metrics:        {summary['metrics']}\n  reward curve:   {png}\n  HF checkpoint:  {final}")
    return summary
