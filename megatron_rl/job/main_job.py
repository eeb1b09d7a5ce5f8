"""The main job, ``megatron-rl train [recipe] [key=value ...]``: one RL run from a recipe to an HF
checkpoint, with a progress bar, ``metrics.jsonl``, a reward-curve PNG and a closing summary.

``run_train(recipe, overrides)``, in order: load the config (an invalid layout names the nearest
valid one), the fail-fast checks (``megatron_rl.job.preflight``: model paths, the checkpoint to
resume, data, reward, loggers, sampling) and the planner's -- all before Ray starts; prepare the
starting models (``megatron_rl.job.prepare``; a resumed run reuses them, no second SFT warm-up) and
build the data and reward; start Ray (with ``megatron_rl.job.reaper`` watching, so that nothing of
the run outlives a killed driver), the workers, ``RayPPOTrainer.fit`` with a tqdm bar, whose end exports the HF checkpoint (the
``FinalExport`` callback, ``megatron_rl.job.final_export``); then the reward curve and the summary. ``build_trainer(config, run_dir)`` is its middle part.

Nothing lost: a run replaces the previous run's ``final_hf/``, ``reward_curve.png`` and
``summary.json`` only once its own are complete (built under hidden names, then renamed); a fresh
start moves an earlier ``metrics.jsonl`` to ``metrics.jsonl.prev`` when training begins; a failed
run leaves them as they were. Signals (``megatron_rl.trainer.watchdog.StopSignals``): SIGTERM and
SIGINT stop the run cleanly, the workers and Ray shut down, and ``run_train`` raises ``Stopped``
(exit 143 / 130 from the CLI).

Run directory (``trainer.default_local_dir``; the CPU recipes set ``outputs/<experiment_name>``)::

    base_model/  sft_model/  train.parquet  config.yaml  metrics.jsonl  global_step_N/  stacks/
    validation/<step>.jsonl  reward_curve.png  final_hf/  summary.json

The terminal shows one ``[val]`` line per validation (step, mean reward, exact-answer fraction); the samples
are in ``validation/<step>.jsonl`` (``trainer.validation_data_dir``, which the job sets there when it is
unset). ``summary.json`` and the closing ``done:`` line give the validation reward at the first and the last
validation beside the training reward.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from megatron_rl.config import RunConfig
from megatron_rl.job.final_export import FinalExport
from megatron_rl.job.prepare import atomic_text, prepare_policy_model, prepare_teacher_model, replace_dir, staging_dir
from megatron_rl.job.report import (
    REWARD_KEY,
    algorithm_label,
    as_number,
    fmt_ratio,
    network_report,
    plot_reward_curve,
    validation_exact,
    validation_reward,
)
from megatron_rl.trainer.step_checkpoints import Selection, last_good_checkpoint
from megatron_rl.trainer.watchdog import StopSignals, Stopped, kill_workers
from parallel.netbind import joining_ray, ray_on_loopback
from parallel.checkpoint import DiskFullError, fmt_bytes, free_bytes, is_disk_full

__all__ = ["build_trainer", "run_train", "load_run_config", "checked_plan", "Stopped"]

_TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def build_trainer(
    config: RunConfig,
    run_dir: Optional[str | Path] = None,
    *,
    log=print,
    resume: Optional[Selection] = None,
    **trainer_kwargs: Any,
):
    """The ``RayPPOTrainer`` of ``config`` in ``run_dir`` (default ``trainer.default_local_dir``), its
    policy (and teacher) prepared first. With ``resume`` (a checkpoint to resume), the starting model
    that checkpoint's run used is taken as it is (its weights come from the checkpoint anyway)."""
    from megatron_rl.trainer.ppo_trainer import RayPPOTrainer

    run_dir = Path(run_dir if run_dir is not None else config.trainer.default_local_dir).expanduser()
    saved = resume.state().get("model_path") if resume is not None and resume.path is not None else None
    if saved and (Path(saved) / "config.json").is_file():
        log(f"resuming from {resume.path.name}: the starting model is {saved} (no new model build or SFT warm-up)")
        model_path = saved
    else:
        model_path = prepare_policy_model(config, run_dir, log=log)
    teacher_path = (
        prepare_teacher_model(config, run_dir, model_path, log=log, reuse=saved is not None)
        if config.distillation.enabled
        else None
    )
    return RayPPOTrainer(config, model_path=model_path, log_dir=run_dir, teacher_path=teacher_path, **trainer_kwargs)


def load_run_config(recipe: Optional[str] = None, overrides: Sequence[str] = ()) -> tuple[RunConfig, dict]:
    """``load_config``, and a layout the config refuses gets the nearest valid layout named
    (``megatron_rl.job.layout_hint``); returns the config and the composed mapping (for ``checked_plan``)."""
    from megatron_rl.config.loader import compose
    from megatron_rl.job.layout_hint import with_layout_hint

    raw = compose(recipe, overrides)
    with with_layout_hint(raw):
        config = RunConfig.from_dict(raw)
    return config, raw


def checked_plan(config: RunConfig, raw: dict):
    """``megatron_rl.planner.check_plan``; a layout it finds invalid gets the nearest valid one named."""
    from megatron_rl.job.layout_hint import with_layout_hint
    from megatron_rl.planner import check_plan

    with with_layout_hint(raw):
        return check_plan(config)


@contextlib.contextmanager
def _quiet_ray_start() -> Iterator[None]:
    """Ray's processes started now ignore SIGINT (a terminal's Ctrl-C reaches its whole process group:
    the driver stops, then shuts Ray down); Ray's token-auth notice is not shown."""
    notice = logging.getLogger(_TOKEN_NOTICE_LOGGER)
    level = notice.level
    notice.setLevel(logging.ERROR)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
    try:
        yield
    finally:
        notice.setLevel(level)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _start_ray(signals: StopSignals) -> bool:
    """Start Ray (or join ``RAY_ADDRESS``) unless it runs; True when this call started it. Ray's core
    installs its own SIGTERM handler (a stack dump and exit 134): ``signals`` takes it back."""
    import ray

    if ray.is_initialized():
        return False
    with _quiet_ray_start():
        if os.environ.get("RAY_ADDRESS"):
            # Join the running cluster (recipes/slurm/train.sbatch, `ray job submit`); Ray refuses
            # num_cpus/num_gpus when connecting, and shutdown() then only disconnects this driver.
            with joining_ray(os.environ["RAY_ADDRESS"]):
                ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
        else:
            # A local cluster on loopback: Ray's GCS/raylet/worker gRPC servers, the workers'
            # gloo/NCCL masters and stores all listen on 127.0.0.1 (ray_on_loopback says why it
            # takes more than _node_ip_address; network.json lists every listener).
            with ray_on_loopback():
                ray.init(
                    address="local",
                    num_cpus=os.cpu_count() or 1,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    _node_ip_address="127.0.0.1",
                )
    signals.claim()
    return True


def _disk_full(err: BaseException, out_dir: Path) -> DiskFullError:
    where = getattr(err, "filename", None) or out_dir
    return DiskFullError(
        f"disk full: writing {where} failed ({err}); {fmt_bytes(free_bytes(out_dir))} are free "
        f"under {out_dir}; {last_good_checkpoint(out_dir)}",
        path=where,
        free=free_bytes(out_dir),
    )


def _metrics_rows(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_train(
    recipe: Optional[str] = None, overrides: Sequence[str] = (), *, progress: bool = True, log=print
) -> dict[str, Any]:
    """Run ``recipe`` (None = the CPU toy ``grpo``) with ``overrides``; return the summary dict.

    ``ValueError`` for bad input, found before Ray starts (nothing trained, nothing changed);
    ``RuntimeError`` (``DiskFullError``, ``PhaseTimeout`` ...) for a failure during the run; ``Stopped``
    for SIGTERM / SIGINT (``signum``). See the module docstring for the order and the run directory.
    """
    from tqdm import tqdm

    from megatron_rl.config.loader import dump_config
    from megatron_rl.job.preflight import preflight

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load "Loading weights" bars would bury the run's own
    wall = time.perf_counter()
    with StopSignals(log=log) as signals, _signals_as_stopped(signals):
        config, raw = load_run_config(recipe, overrides)
        out_dir = Path(config.trainer.default_local_dir).expanduser().resolve()
        config = config.with_values({"trainer.default_local_dir": str(out_dir)})  # one absolute run directory
        resume = preflight(config, out_dir, log=log)
        plan = checked_plan(config, raw)  # a layout that cannot run is refused before anything is allocated
        log(
            f"plan: fits, peak {plan.peak_bytes / 2**30:.2f} of {plan.memory_budget_bytes / 2**30:.1f} GiB per "
            f"{'GPU' if plan.device == 'cuda' else 'rank'} ({plan.peak_phase})"
        )
        log(
            f"megatron-rl train: {recipe or 'grpo'} -> {out_dir}"
            + (f" (resuming {resume.path.name})" if resume.path else "")
        )
        if config.trainer.validation_data_dir is None:  # samples go to <run dir>/validation/<step>.jsonl, the
            # terminal gets one [val] line each
            config = config.with_values({"trainer.validation_data_dir": str(out_dir / "validation")})
        config_text = dump_config(config)
        if progress:  # the bar replaces the console logger's line per step
            config = config.with_values(
                {"trainer.logger": [name for name in config.trainer.logger if name != "console"]}
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        trainer = build_trainer(config, out_dir, log=log, resume=resume)  # models, data, reward: still no Ray
        atomic_text(out_dir / "config.yaml", config_text)  # the run's config; checkpoints keep a copy
        return _train(
            config, trainer, resume, out_dir, signals, progress=progress, log=log, wall=wall, tqdm=tqdm, recipe=recipe
        )


@contextlib.contextmanager
def _signals_as_stopped(signals: StopSignals) -> Iterator[None]:
    """A signal before the workers run (checks, model preparation) stops the run as ``Stopped`` too."""
    try:
        yield
    except KeyboardInterrupt:
        if signals.signum is None:
            raise
        raise Stopped(
            signals.signum, f"stopped by {signals.name} before training started; nothing was trained"
        ) from None


def _train(
    config: RunConfig,
    trainer: Any,
    resume: Selection,
    out_dir: Path,
    signals: StopSignals,
    *,
    progress: bool,
    log,
    wall: float,
    tqdm,
    recipe: Optional[str],
) -> dict[str, Any]:
    import ray

    from megatron_rl.job.reaper import start_reaper, stop_reaper

    bar = reaper = None
    started_ray = False
    export = FinalExport(out_dir / "final_hf")  # at fit's end, before the user's on_fit_end
    trainer.callbacks.add(export)

    def on_step(metrics: dict) -> None:
        if REWARD_KEY in metrics:
            bar.set_postfix(
                {
                    "reward": f"{metrics[REWARD_KEY]:.3f}",
                    "resp_len": f"{metrics['response_length/mean']:.1f}",
                    "s/step": f"{metrics['timing_s/step']:.1f}",
                },
                refresh=False,
            )
        else:
            bar.set_postfix({"skipped": "reward failed"}, refresh=False)
        bar.update(1)

    try:
        if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
            reaper = start_reaper()  # before Ray: it records every process Ray starts
        started_ray = _start_ray(signals)
        start = time.perf_counter()
        trainer.init_workers()
        ray.get(trainer.rollout.pad_token_id.remote())  # vLLM is up: the bar's ETA does not count start-up
        log(f"workers started in {time.perf_counter() - start:.1f}s")
        network_report(out_dir, log, joined=not started_ray)
        metrics_file = out_dir / "metrics.jsonl"
        if resume.path is None and metrics_file.exists() and not config.trainer.val_only:
            os.replace(metrics_file, out_dir / "metrics.jsonl.prev")  # a fresh start: the old run's rows stay apart
            log(f"the previous run's metrics.jsonl is kept as {out_dir / 'metrics.jsonl.prev'}")
        total = trainer.total_steps
        bar = tqdm(
            total=total,
            initial=min(resume.step, total),
            desc=algorithm_label(config),
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        start = time.perf_counter()
        history = trainer.fit(total, on_step=on_step)
        rl_seconds = time.perf_counter() - start
        bar.close()
    except KeyboardInterrupt:
        if signals.signum is None:
            raise
        kill_workers(trainer.placement)  # an abandoned call never returns: do not wait for it
        raise Stopped(
            signals.signum,
            f"stopped by {signals.name} at step {trainer.global_steps} (abandoned); {last_good_checkpoint(out_dir)}",
        ) from None
    except Stopped:
        raise
    except Exception as err:
        if signals.signum is not None:  # the signal took workers down too (scancel signals every process)
            raise Stopped(
                signals.signum,
                f"stopped by {signals.name} at step {trainer.global_steps} ({err}); {last_good_checkpoint(out_dir)}",
            ) from err
        if isinstance(err, OSError) and is_disk_full(err):
            raise _disk_full(err, out_dir) from err
        raise
    finally:
        if bar is not None:
            bar.close()
        trainer.shutdown()
        if started_ray:
            ray.shutdown()
        stop_reaper(reaper)
    try:
        return _report(config, out_dir, history, export.staged, rl_seconds, wall, log)
    finally:
        export.discard()


def _report(
    config: RunConfig, out_dir: Path, history: list, staged: Optional[Path], rl_seconds: float, wall: float, log
) -> dict[str, Any]:
    """The summary (and reward curve, and HF checkpoint) of a finished run, each put in place only
    once all of them are complete."""
    if config.trainer.val_only:  # nothing was trained: the validation metrics are the result
        summary = {
            "val_metrics": history[0] if history else {},
            "wall_seconds": time.perf_counter() - wall,
            "output_dir": str(out_dir),
            "metrics": str(out_dir / "metrics.jsonl"),
        }
        atomic_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        log(
            "\ndone: validation only (trainer.val_only); "
            + ", ".join(f"{k}={v:.4g}" for k, v in summary["val_metrics"].items() if as_number(v) is not None)
        )
        return summary
    rows = _metrics_rows(out_dir)  # the whole run (a resumed one included)
    history = [row for row in rows if as_number(row.get(REWARD_KEY)) is not None]  # steps not skipped
    if not history:
        raise RuntimeError(f"no training step of {out_dir} produced a reward (see metrics.jsonl)")
    val_rows = [row for row in rows if validation_reward(row) is not None]
    validation = [(int(row["step"]), validation_reward(row)) for row in val_rows]
    png = out_dir / "reward_curve.png"
    png_tmp = staging_dir(png)
    try:
        plot_reward_curve(
            history,
            png_tmp,
            validation=validation,
            title=f"{config.trainer.experiment_name}: {algorithm_label(config)} on {config.data.task}",
        )
    except BaseException:
        png_tmp.unlink(missing_ok=True)
        raise
    rewards = [float(h[REWARD_KEY]) for h in history]
    tail = rewards[-min(3, len(rewards)) :]
    final = out_dir / "final_hf"
    summary = {
        "steps": len(history),
        "first_step_reward": rewards[0],
        "last_step_reward": rewards[-1],
        "last3_mean_reward": sum(tail) / len(tail),
        "max_reward": max(rewards),
        "reward_gain": rewards[-1] - rewards[0],
        # exact-answer rate (rule rewards that report "acc"); None when not logged or not finite
        "first_step_exact": as_number(history[0].get("reward/acc/mean")),
        "last_step_exact": as_number(history[-1].get("reward/acc/mean")),
        # greedy validation reward (and exact-answer rate) at the first and the last validation
        "first_val_step": validation[0][0] if validation else None,
        "first_val_reward": validation[0][1] if validation else None,
        "first_val_exact": validation_exact(val_rows[0]) if validation else None,
        "last_val_step": validation[-1][0] if validation else None,
        "last_val_reward": validation[-1][1] if validation else None,
        "last_val_exact": validation_exact(val_rows[-1]) if validation else None,
        "rl_seconds": rl_seconds,
        "wall_seconds": time.perf_counter() - wall,
        "output_dir": str(out_dir),
        "metrics": str(out_dir / "metrics.jsonl"),
        "reward_curve": str(png),
        "hf_checkpoint": str(final),
    }
    replace_dir(staged, final)
    os.replace(png_tmp, png)
    atomic_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log(
        f"\ndone: {summary['steps']} steps in {summary['wall_seconds']:.0f}s "
        f"(RL {rl_seconds:.0f}s); mean reward {rewards[0]:.3f} (step 1) -> {rewards[-1]:.3f} "
        f"(step {len(rewards)}), gain {summary['reward_gain']:+.3f}"
        + (
            f"; exact answers {fmt_ratio(summary['first_step_exact'])} -> {fmt_ratio(summary['last_step_exact'])}"
            if history[-1].get("reward/acc/mean") is not None
            else ""
        )
        + (
            f"\n  validation:     reward {summary['first_val_reward']:.3f} (step {summary['first_val_step']}) -> "
            f"{summary['last_val_reward']:.3f} (step {summary['last_val_step']})"
            + (
                f", exact {fmt_ratio(summary['first_val_exact'])} -> {fmt_ratio(summary['last_val_exact'])}"
                if summary["last_val_exact"] is not None
                else ""
            )
            if validation
            else ""
        )
        + "\n"
        f"  metrics:        {summary['metrics']}\n  reward curve:   {png}\n  HF checkpoint:  {final}"
    )
    return summary
