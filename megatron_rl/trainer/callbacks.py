"""The side concerns of the loop, as callbacks: ``Validator``, ``Checkpointer``, ``MetricsLog``, ``SkipGuard``
(each owning its own "when"), and the user's own (``trainer.callbacks``: ``TrainerCallback`` subclasses by
dotted path). The trainer calls hooks, never a side concern by name: ``Callbacks.call(hook, trainer, ...)``
runs every callback's ``hook`` by ``order`` (OLMo-core's callbacks; torchtitan's
``checkpointer.save(step, last_step=...)``). The frequencies (``trainer.save_freq``, ``trainer.test_freq``,
``trainer.val_before_train``, ``trainer.max_consecutive_skipped_steps``) live in the callbacks. The main
job adds its own: ``megatron_rl.job.final_export.FinalExport`` (the HF checkpoint at ``on_fit_end``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_rl.config import TrainerConfig
from megatron_rl.data.rewards import RewardError, finite_means
from megatron_rl.trainer.metrics import METRICS_ROW, MetricsLogger, metrics_row
from megatron_rl.trainer.step_checkpoints import (
    StepCheckpoint,
    ensure_space_for_checkpoint,
    estimate_checkpoint_bytes,
    last_good_checkpoint,
    prune_checkpoints,
    select_checkpoint,
)
from megatron_rl.trainer.watchdog import phase
from parallel.checkpoint import DiskFullError, free_bytes, fmt_bytes, is_disk_full

__all__ = [
    "Checkpointer",
    "Validator",
    "MetricsLog",
    "StepFunction",
    "SkipGuard",
    "GenerationDump",
    "validation_line",
    "TrainerCallback",
    "Callbacks",
    "CallbackError",
    "HOOKS",
    "load_callbacks",
]

HOOKS = ("on_fit_start", "on_validation_end", "on_checkpoint", "on_step_end", "on_fit_end")
"""The hooks a ``TrainerCallback`` may define, in the order one run calls them: ``on_fit_start`` once
(after a resume, before the validation before training), then per step ``on_validation_end`` (when the
step validated), ``on_checkpoint`` (when it saved), ``on_step_end``; ``on_fit_end`` once (also after
``trainer.val_only``'s validation)."""

INTERNAL_HOOKS = ("before_training", "close")
"""Hooks of the built-in callbacks only: ``before_training(trainer, step, row)`` -- the validation before
training fills ``row`` (a user callback sees it as ``on_validation_end``) and the metrics log writes it;
``close()`` -- once after ``fit``, also when it failed (a ``Callbacks.during`` callback)."""


class TrainerCallback:
    """Base of a callback (``trainer.callbacks: [my_pkg.module.MyCallback]``): override any of ``HOOKS``;
    each gets the trainer first. Constructed once with no arguments, in the driver, before any worker
    starts. A hook that raises stops the run (the error names the callback and the hook)."""

    order: int = 0
    """Where the callback runs among the others: ascending, the listed order among equal ones. The
    built-ins: ``Validator`` -30 and ``Checkpointer`` -20 (a user's ``on_step_end`` at 0 sees the step's
    validation and ``timing_s/save_checkpoint``; the main job's ``FinalExport`` -10: a user's ``on_fit_end``
    finds the HF checkpoint staged), ``MetricsLog`` 10 (what a user's hook added is logged),
    ``StepFunction`` 15 (``fit``'s ``on_step``), ``SkipGuard`` 20 (the step is logged before it stops the run)."""

    def on_fit_start(self, trainer: Any, step: int) -> None:
        """Training starts (or resumes) after step ``step``."""

    def on_validation_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """A validation at ``step`` finished; ``metrics`` are its ``val-core/...`` / ``val-aux/...``."""

    def on_checkpoint(self, trainer: Any, step: int, path: Path) -> None:
        """The checkpoint of ``step`` is complete at ``path``."""

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """Step ``step`` is done (its metrics, validation and checkpoint included)."""

    def on_fit_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        """The run is over; ``history`` is this call's per-step metrics."""

    def before_training(self, trainer: Any, step: int, row: dict[str, float]) -> None:
        """Built-ins only (``INTERNAL_HOOKS``): the validation before training, into ``row``."""

    def close(self) -> None:
        """Built-ins only (``INTERNAL_HOOKS``): release what the callback holds (files, loggers)."""


def load_callbacks(paths: list) -> "Callbacks":
    """``trainer.callbacks`` -> the constructed callbacks; ``ValueError`` naming the entry when a path is
    not ``module.Class``, cannot be imported, or is not a ``TrainerCallback`` subclass."""
    found = []
    for i, path in enumerate(paths):
        where = f"trainer.callbacks[{i}]={path!r}"
        module, _, name = str(path).rpartition(".")
        if not isinstance(path, str) or not module or not name:
            raise ValueError(f"{where}: expected a dotted path 'package.module.Class'")
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as err:
            raise ValueError(f"{where}: cannot import module {module!r} ({err})") from err
        except AttributeError:
            raise ValueError(f"{where}: module {module!r} has no attribute {name!r}") from None
        if not (isinstance(cls, type) and issubclass(cls, TrainerCallback)):
            raise ValueError(f"{where}: {name} is not a subclass of megatron_rl.trainer.callbacks.TrainerCallback")
        found.append(cls())
    return Callbacks(found)


class CallbackError(RuntimeError):
    """A user callback's hook raised (the message names the callback and the hook)."""


class Callbacks:
    """The run's callbacks -- the trainer's own side concerns (``add``, ``during``) and the user's
    (``trainer.callbacks``) -- called hook by hook by ``order``, the listed order among equal ones (the
    built-ins before the user's). A user callback's error is a ``CallbackError`` naming it and the hook;
    a built-in's propagates as it is (``DiskFullError``, the skip guard's ``RuntimeError``, ``Stopped``)."""

    def __init__(self, callbacks: list[TrainerCallback]):
        self.user = list(callbacks)
        self.builtin: list[TrainerCallback] = []

    def __len__(self) -> int:
        return len(self.user) + len(self.builtin)

    def add(self, *callbacks: TrainerCallback) -> None:
        """The run's own callbacks, for every ``fit`` call."""
        self.builtin.extend(callbacks)

    @contextlib.contextmanager
    def during(self, *callbacks: TrainerCallback) -> Iterator["Callbacks"]:
        """``callbacks`` join for one ``fit`` call: removed and closed after it, also when it fails."""
        self.builtin.extend(callbacks)
        with contextlib.ExitStack() as stack:
            for cb in callbacks:
                stack.callback(cb.close)
                stack.callback(self.builtin.remove, cb)
            yield self

    def ordered(self) -> list[tuple[TrainerCallback, bool]]:
        """``(callback, is_user)`` by ``order``; the sort is stable, so equal orders keep the listed order."""
        return sorted([(cb, False) for cb in self.builtin] + [(cb, True) for cb in self.user], key=lambda c: c[0].order)

    def call(self, hook: str, trainer: Any, *args: Any) -> None:
        """Call ``hook`` (one of ``HOOKS`` or ``INTERNAL_HOOKS``) on every callback."""
        assert hook in HOOKS or hook in INTERNAL_HOOKS, hook
        for cb, is_user in self.ordered():
            if not is_user:
                getattr(cb, hook)(trainer, *args)
                continue
            try:
                getattr(cb, hook)(trainer, *args)
            except CallbackError:
                raise
            except Exception as err:
                raise CallbackError(
                    f"trainer.callbacks: {type(cb).__module__}.{type(cb).__qualname__}.{hook} "
                    f"raised {type(err).__name__}: {err}"
                ) from err


class GenerationDump:
    """Samples as ``<dir>/<step>.jsonl`` (verl's ``trainer.rollout_data_dir`` / ``validation_data_dir``
    format: one line per sample with ``input``, ``output``, ``gts``, ``score``, ``step`` and the
    reward's per-sample fields)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory).expanduser()

    @classmethod
    def create(cls, directory: Optional[str]) -> Optional["GenerationDump"]:
        """A dump into ``directory``, or None (nothing dumped) when it is None."""
        return None if directory is None else cls(directory)

    def write(
        self, step: int, inputs: list, outputs: list, gts: list, scores: list, extra: Optional[dict[str, list]] = None
    ) -> Path:
        """Write one step's samples (fields of another length than ``inputs`` are left out)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        n = len(inputs)
        columns = {
            "input": list(inputs),
            "output": list(outputs),
            "gts": list(gts),
            "score": list(scores),
            "step": [step] * n,
            **{k: list(v) for k, v in (extra or {}).items() if len(v) == n},
        }
        path = self.dir / f"{step}.jsonl"
        with open(path, "w") as f:
            for i in range(n):
                f.write(json.dumps({k: v[i] for k, v in columns.items()}, ensure_ascii=False, default=str) + "\n")
        return path


def ground_truths(batch: Any) -> list:
    """Each sample's ground truth (``ground_truth`` or verl's ``reward_model.ground_truth``), else None."""
    if "ground_truth" in batch:
        return list(batch["ground_truth"])
    if "reward_model" in batch:
        return [(rm or {}).get("ground_truth") for rm in batch["reward_model"]]
    return [None] * len(batch)


class Checkpointer(TrainerCallback):
    """Trainer checkpoints under ``root`` (``megatron_rl.trainer.step_checkpoints`` for the layout), saved
    at the end of a step when due (``on_step_end``), then ``on_checkpoint`` for every callback.

    Args:
        root: ``trainer.default_local_dir``.
        trainer: the ``trainer`` config section (``save_freq``, ``resume_mode``,
            ``resume_from_path``, ``max_actor_ckpt_to_keep``, ``max_critic_ckpt_to_keep``).
        groups: ``{part: worker group}`` saved as parts of each step (``actor``, ``critic``).
    """

    order = -20

    def __init__(self, root: Path, trainer: TrainerConfig, groups: dict[str, Any]):
        self.root, self.cfg, self.groups = Path(root), trainer, groups

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if not self.should_save(step, step >= trainer.last_step):
            return
        # the step's row so far goes into the checkpoint: a kill before the row reaches metrics.jsonl
        # (the metrics log runs after) would otherwise lose it; the trainer's resume() puts it back
        _, metrics["timing_s/save_checkpoint"] = self.save_step(trainer, step, metrics_row(metrics, step))

    def save_step(self, trainer: Any, step: int, row: Optional[dict] = None) -> tuple[Path, float]:
        """Save step ``step`` now -- the trainer's state, with ``row`` (the step's metrics row, when it is
        not logged yet) -- timed as the ``save_checkpoint`` phase the watchdog watches, then
        ``on_checkpoint`` for every callback; the checkpoint's directory and the seconds the save took.
        The end of a due step and the save of ``trainer.save_on_preemption`` both save through it."""
        timing: dict[str, float] = {}
        with phase("save_checkpoint", timing):
            saved = self.save(step, {**trainer.trainer_state(), **({} if row is None else {METRICS_ROW: row})})
        trainer.callbacks.call("on_checkpoint", trainer, step, saved)
        return saved, timing["save_checkpoint"]

    def should_save(self, step: int, last: bool) -> bool:
        """Every ``trainer.save_freq`` steps and at the last one (never with ``save_freq`` <= 0)."""
        freq = self.cfg.save_freq
        return freq > 0 and (step % freq == 0 or last)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Every group's state and the driver ``state``, as one atomic ``global_step_N`` directory;
        old ones pruned by ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``.

        The free space is checked against the checkpoint's estimated size first; a save that fills
        the disk anyway is reported as ``DiskFullError`` (path, bytes needed and free, the last good
        checkpoint, which stays the latest)."""
        needed = estimate_checkpoint_bytes(self.root, self.groups)
        ensure_space_for_checkpoint(self.root, step, needed)
        try:
            with StepCheckpoint(self.root, step) as ckpt:
                for part, group in self.groups.items():
                    group.save_checkpoint(ckpt.part(part))
                final = ckpt.commit(state)
        except Exception as err:
            if is_disk_full(err):
                raise DiskFullError(
                    f"disk full: saving checkpoint global_step_{step} under {self.root} failed "
                    f"({type(err).__name__}); it needs ~{fmt_bytes(needed)}, "
                    f"{fmt_bytes(free_bytes(self.root))} are free now; "
                    f"{last_good_checkpoint(self.root)}",
                    path=self.root,
                    needed=needed,
                    free=free_bytes(self.root),
                ) from err
            raise
        keep = [k for k in (self.cfg.max_actor_ckpt_to_keep, self.cfg.max_critic_ckpt_to_keep) if k is not None]
        prune_checkpoints(self.root, min(keep) if keep else None)
        return final

    def resume(self) -> Optional[tuple[Path, dict[str, Any]]]:
        """Load the checkpoint ``trainer.resume_mode`` selects into every group -- verified against
        its manifest first, past damaged ones with ``trainer.resume_fallback`` (``select_checkpoint``)
        -- and return its directory and driver state (None: a fresh start)."""
        choice = select_checkpoint(
            self.root, self.cfg.resume_mode, self.cfg.resume_from_path, fallback=self.cfg.resume_fallback
        )
        if choice.path is None:
            return None
        if choice.skipped:
            from tqdm import tqdm

            tqdm.write(f"resume: {choice.describe()}")
        path, state = choice.path, choice.state()
        for part, group in self.groups.items():
            if not (path / part).is_dir():
                raise ValueError(f"{path} has no {part} checkpoint, but this run trains a {part}")
            group.load_checkpoint(path / part)
        return path, state


class Validator(TrainerCallback):
    """Greedy (``rollout.val_kwargs``) generation over the validation set, scored by the reward: before
    training (``before_training``) and at the end of a step when due (``on_step_end``, into the step's
    metrics), then ``on_validation_end`` for every callback.

    Args:
        trainer: the ``trainer`` config section (``test_freq``, ``val_before_train``, ``log_val_generations``).
        dataloader: the validation ``PromptDataLoader`` (None: no validation set, never validates).
        generate: ``generate(prompts, validate=True) -> Batch`` (the rollout phase's).
        reward_fn: the rule reward.
        dump: where the samples go (``trainer.validation_data_dir``), or None.
    """

    def __init__(
        self,
        trainer: TrainerConfig,
        dataloader: Any,
        generate: Callable,
        reward_fn: Any,
        dump: Optional[GenerationDump] = None,
    ):
        self.cfg, self.dataloader, self.generate, self.reward_fn, self.dump = (
            trainer,
            dataloader,
            generate,
            reward_fn,
            dump,
        )

    order = -30

    def before_training(self, trainer: Any, step: int, row: dict[str, float]) -> None:
        if self.should_validate_before_training(step) or self.cfg.val_only:
            self._validate_into(trainer, step, row)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if self.should_validate(step, step >= trainer.last_step):
            self._validate_into(trainer, step, metrics)

    def _validate_into(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        trainer.phases.enter("gen")  # the rollout engine awake, the models it displaces offloaded
        validation = self.validate(step)
        metrics.update(validation)
        trainer.callbacks.call("on_validation_end", trainer, step, validation)

    def should_validate_before_training(self, step: int = 0) -> bool:
        """``trainer.val_before_train`` with a validation set, on a fresh start only: a resumed run's
        step was validated (or not) by the run that saved it -- no second row for the same step."""
        return self.dataloader is not None and self.cfg.val_before_train and step == 0

    def should_validate(self, step: int, last: bool) -> bool:
        """Every ``trainer.test_freq`` steps and at the last one (never with ``test_freq`` <= 0)."""
        freq = self.cfg.test_freq
        return self.dataloader is not None and freq > 0 and (step % freq == 0 or last)

    def validate(self, step: int = 0) -> dict[str, float]:
        """Generate for the whole validation set and score it: ``val-core/<data_source>/reward/mean@<n>``
        and ``val-aux/...`` for the reward's other keys (verl's names; non-finite values are counted as
        ``.../num_nonfinite``, not averaged). Prints one line (``validation_line``: step, mean reward, exact
        fraction; through ``tqdm.write``, so that a progress bar stays intact) and dumps every sample as
        ``<step>.jsonl``; without a dump directory the first ``trainer.log_val_generations`` samples are
        printed under that line instead."""
        with phase("testing", {}):  # verl's name of the validation phase
            return self._validate(step)

    def _validate(self, step: int) -> dict[str, float]:
        from tqdm import tqdm

        per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        samples, gts, n = [], [], 1
        start = self.dataloader.state_dict()
        self.dataloader.load_state_dict({**start, "epoch": 0, "batch_in_epoch": 0})
        for prompts in self.dataloader:
            batch = self.generate(prompts, validate=True)
            n = len(batch) // len(prompts["uid"])
            try:
                out = self.reward_fn(batch)
            except RewardError as err:
                return {"val-aux/num_failed_samples": float(len(err.indices))}
            sources = batch["data_source"] if "data_source" in batch else ["unknown"] * len(out.scores)
            for i, src in enumerate(sources):
                per_source[src]["reward"].append(float(out.scores[i]))
                for key, values in out.reward_extra_info.items():
                    if key != "score":
                        per_source[src][key].append(values[i])
            prompts_text = batch["raw_prompt"] if "raw_prompt" in batch else [""] * len(out.scores)
            samples.extend(zip(prompts_text, out.response_texts, out.scores.tolist()))
            gts.extend(ground_truths(batch))
        shown = self.cfg.log_val_generations
        dumped = None
        if self.dump is not None and samples:
            inputs, outputs, scores = (list(col) for col in zip(*samples))
            dumped = self.dump.write(step, inputs, outputs, gts, scores)
        tqdm.write(validation_line(step, per_source, dumped))
        if dumped is None:  # no dump file to keep them in: show the first ``log_val_generations`` here
            for prompt, text, score in samples[:shown]:
                tqdm.write(f"[val]   {_one_line(prompt_text(prompt))} -> {_one_line(text)} (score {score:.3f})")
        metrics = {}
        for src, keys in per_source.items():
            for key, values in keys.items():
                tier = "val-core" if key == "reward" else "val-aux"
                metrics.update(finite_means({key: values}, prefix=f"{tier}/{src}/", suffix=f"/mean@{n}"))
        return metrics


def validation_line(step: int, per_source: dict[str, dict[str, list]], dumped: Optional[Path] = None) -> str:
    """One line per validation: the step, the mean reward over every sample, the exact-answer fraction
    (the mean of the reward's ``acc``, finite values only; the training ``reward/acc/mean``) when the reward
    reports one, and where the samples are."""
    import math

    rewards = [float(v) for keys in per_source.values() for v in keys.get("reward", ()) if math.isfinite(float(v))]
    acc = [
        float(v)
        for keys in per_source.values()
        for v in keys.get("acc", ())
        if isinstance(v, (int, float)) and math.isfinite(float(v))
    ]
    text = (
        f"[val] step {step}: mean reward {sum(rewards) / len(rewards):.3f}"
        if rewards
        else f"[val] step {step}: no finite reward"
    )
    if acc:
        text += f", exact {sum(acc) / len(acc):.1%}"
    text += f" ({len(rewards)} samples)"
    return text + (f"; samples in {dumped}" if dumped is not None else "")


def prompt_text(prompt: Any) -> str:
    """The text of a prompt: a string as it is; of chat messages, the last user turn's content."""
    if isinstance(prompt, str):
        return prompt
    turns = [m.get("content", "") for m in prompt or () if isinstance(m, dict) and m.get("role") == "user"]
    return str(turns[-1] if turns else prompt)


def _one_line(text: str, limit: int = 200) -> str:
    text = str(text).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SkipGuard(TrainerCallback):
    """Counts steps skipped in a row (failed rewards: ``training/step_skipped``);
    ``trainer.max_consecutive_skipped_steps`` of them stop the run (after the step is logged)."""

    order = 20

    def __init__(self, trainer: TrainerConfig):
        self.limit, self.in_a_row = trainer.max_consecutive_skipped_steps, 0

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.record(bool(metrics.get("training/step_skipped")), trainer.batches.last_error)

    def record(self, skipped: bool, last_error: str) -> None:
        """Count this step; ``RuntimeError`` (naming the last error) once the limit is reached."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row and self.in_a_row >= self.limit:
            raise RuntimeError(
                f"{self.in_a_row} steps in a row were skipped because the reward failed "
                f"(trainer.max_consecutive_skipped_steps={self.limit}); last error: {last_error}"
            )


class MetricsLog(TrainerCallback):
    """Each row -- the validation before training, then every step's -- to the run's ``MetricsLogger``
    (``metrics.jsonl``, the console line, TensorBoard / W&B by ``trainer.logger``); for one ``fit`` call."""

    order = 10

    def __init__(self, logger: MetricsLogger):
        self.logger = logger

    def before_training(self, trainer: Any, step: int, row: dict[str, float]) -> None:
        if row:
            self.logger.log(row, step=step)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(metrics, step=step)

    def close(self) -> None:
        self.logger.close()


class StepFunction(TrainerCallback):
    """``fn(metrics)`` after each step is logged (``fit``'s ``on_step``: progress bars, the preemption
    check of ``trainer.save_on_preemption``); for one ``fit`` call."""

    order = 15

    def __init__(self, fn: Callable[[dict], None]):
        self.fn = fn

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.fn(metrics)
