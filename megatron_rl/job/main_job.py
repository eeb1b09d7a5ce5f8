"""The main job, ``megatron-rl train [recipe] [key=value ...]``: one RL run from a recipe to an HF
checkpoint, with a progress bar, ``metrics.jsonl``, a reward-curve PNG and a closing summary.

* ``prepare_policy_model(config, out_dir)``: the HF directory the run starts from -- the
  recipe's ``model.path``, or for an inline model (``model.config`` + ``family``) a freshly
  materialised checkpoint (``megatron_rl.models.tiny``), optionally after
  ``trainer.sft_warmup_steps`` supervised steps on the built-in task.
* ``run_train(recipe, overrides)``: load the config, start Ray, ``RayPPOTrainer.fit`` with a tqdm
  bar, save the actor as an HF checkpoint, plot the reward curve and print the summary.

Run directory (``trainer.default_local_dir``, default ``outputs/<experiment_name>``)::

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

from megatron_rl.algos.utils import cfg_get

__all__ = ["prepare_policy_model", "prepare_teacher_model", "plot_reward_curve", "run_train", "REWARD_KEY"]

REWARD_KEY = "critic/score/mean"
"""The per-step mean training reward (rule score of every sampled response)."""
_RUN_ARTIFACTS = ("base_model", "sft_model", "teacher_base", "teacher_model", "final_hf", "metrics.jsonl",
                  "reward_curve.png", "summary.json", "train.parquet", "val.parquet")


def _task_rows(config: Any, num: int, seed: int) -> list[dict]:
    from megatron_rl.data.datasets import toy_rows

    task = cfg_get(config, "data.task")
    kwargs = dict(cfg_get(config, "data.task_kwargs") or {})
    kwargs.pop("num_samples", None)
    return toy_rows(task, num, seed, **kwargs)


def prepare_policy_model(config: Any, out_dir: str | Path, *, log=print) -> str:
    """The HF checkpoint directory the run's policy starts from (see the module docstring).

    Raises ValueError for an inline model without ``data.task`` (its tokenizer is trained on the
    task's texts) or a warm-up without ``data.task`` (it needs the task's answers).
    """
    from megatron_rl.models.tiny import materialize_inline_model, sft_warmup, task_texts

    out_dir = Path(out_dir)
    path = cfg_get(config, "actor_rollout_ref.model.path")
    task = cfg_get(config, "data.task")
    steps = int(cfg_get(config, "trainer.sft_warmup_steps", 0) or 0)
    seed = int(cfg_get(config, "data.seed") or 1)
    if path is None:
        inline = cfg_get(config, "actor_rollout_ref.model.config")
        if inline is None:
            raise ValueError("actor_rollout_ref.model: set path (an HF checkpoint directory) or config + family")
        if task is None:
            raise ValueError("an inline actor_rollout_ref.model.config needs data.task (its tokenizer is trained "
                             "on the built-in task's texts); got data.task=None")
        start = time.perf_counter()
        model = materialize_inline_model(out_dir / "base_model", inline, cfg_get(config, "actor_rollout_ref.model.family"),
                                         task_texts(_task_rows(config, 1024, seed)),
                                         seed=int(cfg_get(config, "actor_rollout_ref.actor.megatron.seed", 42)))
        n_params = _num_params(model["path"])
        log(f"built {model['path']} (qwen3, {n_params / 1e6:.2f}M parameters, vocab {len(model['tokenizer'])}) "
            f"in {time.perf_counter() - start:.1f}s")
        path = model["path"]
    path = str(Path(path).expanduser())
    if steps > 0:
        if task is None:
            raise ValueError(f"trainer.sft_warmup_steps={steps} needs data.task (the built-in task's answers); "
                             "got data.task=None")
        start, losses = time.perf_counter(), []
        # Warm-up prompts are drawn with another seed than the RL prompts.
        path = str(sft_warmup(path, out_dir / "sft_model", _task_rows(config, 2048, seed + 10007), steps=steps,
                              lr=float(cfg_get(config, "trainer.sft_warmup_lr", 3e-3)), seed=seed, log=losses))
        log(f"SFT warm-up: {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"in {time.perf_counter() - start:.1f}s -> {path}")
    return path


def prepare_teacher_model(config: Any, out_dir: str | Path, student_path: str | Path, *, log=print) -> str:
    """The distillation teacher's HF directory: ``distillation.teacher_model.model_path``, or an
    inline ``config`` materialised with the student's tokenizer (same task texts) and warmed up by
    ``teacher_model.sft_warmup_steps`` supervised steps. ValueError if the vocabularies differ."""
    from megatron_rl.models.tiny import materialize_inline_model, sft_warmup, task_texts

    out_dir = Path(out_dir)
    teacher = cfg_get(config, "distillation.teacher_model")
    if cfg_get(teacher, "model_path"):
        return str(Path(cfg_get(teacher, "model_path")).expanduser())
    inline = cfg_get(teacher, "config")
    if inline is None:
        raise ValueError("distillation.teacher_model: set model_path (an HF checkpoint) or config (an inline model)")
    if cfg_get(config, "data.task") is None:
        raise ValueError("an inline distillation.teacher_model.config needs data.task; got data.task=None")
    seed = int(cfg_get(config, "data.seed") or 1)
    start = time.perf_counter()
    model = materialize_inline_model(out_dir / "teacher_base", inline, cfg_get(config, "actor_rollout_ref.model.family"),
                                     task_texts(_task_rows(config, 1024, seed)), seed=seed + 1)
    student_vocab = json.loads((Path(student_path) / "tokenizer.json").read_text())["model"]["vocab"]
    if student_vocab != json.loads((Path(model["path"]) / "tokenizer.json").read_text())["model"]["vocab"]:
        raise ValueError("the inline teacher's tokenizer differs from the student's; give both the same vocab_size")
    path = str(model["path"])
    steps = int(cfg_get(teacher, "sft_warmup_steps", 0) or 0)
    if steps > 0:
        losses: list = []
        path = str(sft_warmup(path, out_dir / "teacher_model", _task_rows(config, 2048, seed + 20011), steps=steps,
                              lr=float(cfg_get(config, "trainer.sft_warmup_lr", 3e-3)), seed=seed, log=losses))
        log(f"teacher: {_num_params(path) / 1e6:.2f}M parameters, SFT {steps} steps, loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f} in {time.perf_counter() - start:.1f}s -> {path}")
    return path


def _num_params(path: str | Path) -> int:
    """Parameters stored in an HF directory's safetensors files (read from the headers only)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= int(d)
                total += n
    return total


def plot_reward_curve(history: Sequence[dict], path: str | Path, title: str = "", window: int = 10) -> Path:
    """Mean training reward per step, its ``window``-step moving average and (when logged) the
    exact-answer rate ``reward/acc/mean``, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    steps = [int(h["training/global_step"]) for h in history]
    mean = [float(h[REWARD_KEY]) for h in history]
    smooth = [sum(mean[max(0, i - window + 1):i + 1]) / len(mean[max(0, i - window + 1):i + 1]) for i in range(len(mean))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, mean, color="C0", alpha=0.35, linewidth=1, label="mean reward")
    ax.plot(steps, smooth, color="C0", linewidth=2, label=f"mean reward ({window}-step avg)")
    if all("reward/acc/mean" in h for h in history):
        ax.plot(steps, [float(h["reward/acc/mean"]) for h in history], color="C1", alpha=0.7, linewidth=1,
                label="exact answers")
    ax.set_xlabel("step")
    ax.set_ylabel("training reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
    return Path(path)


def _output_dir(raw: dict) -> Path:
    trainer = raw.get("trainer") or {}
    if trainer.get("default_local_dir"):
        return Path(trainer["default_local_dir"]).expanduser()
    return Path("outputs") / str(trainer.get("experiment_name") or "run")


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

    from megatron_rl.config import TrainerRunConfig
    from megatron_rl.config.loader import compose, dump_config
    from megatron_rl.trainer.ppo_trainer import RayPPOTrainer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load "Loading weights" bars would bury the run's own
    wall = time.perf_counter()
    raw = compose(recipe, overrides)
    out_dir = _output_dir(raw).resolve()
    raw.setdefault("trainer", {})["default_local_dir"] = str(out_dir)
    config = TrainerRunConfig.from_dict(raw)
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
    total = int(config.trainer.total_training_steps or 1)
    log(f"megatron-rl train: {recipe or 'grpo'} -> {out_dir}")

    model_path = prepare_policy_model(config, out_dir, log=log)
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
    trainer = RayPPOTrainer(config, model_path=model_path, log_dir=out_dir)
    bar = None

    def on_step(metrics: dict) -> None:
        if REWARD_KEY in metrics:
            bar.set_postfix({"reward": f"{metrics[REWARD_KEY]:.3f}", "resp_len": f"{metrics['response_length/mean']:.1f}",
                             "s/step": f"{metrics['timing_s/step']:.1f}"}, refresh=False)
        else:
            bar.set_postfix({"skipped": "reward failed"}, refresh=False)
        bar.update(1)

    try:
        start = time.perf_counter()
        trainer.init_workers()
        log(f"workers started in {time.perf_counter() - start:.1f}s (the first step also waits for them to load)")
        bar = tqdm(total=total, desc=config.algorithm.adv_estimator.upper(), unit="step", disable=not progress,
                   dynamic_ncols=True)
        start = time.perf_counter()
        history = trainer.fit(total, on_step=on_step)
        rl_seconds = time.perf_counter() - start
        bar.close()
        final = trainer.save_hf_checkpoint(out_dir / "final_hf")
    finally:
        if bar is not None:
            bar.close()
        trainer.shutdown()
        if started_ray:
            ray.shutdown()
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
