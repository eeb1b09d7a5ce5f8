"""The HF directories a run starts from: the policy (and the distillation teacher).

* ``prepare_policy_model(config, out_dir)``: the recipe's ``model.path``, or for an inline model
  (``model.config`` + ``family``) a freshly materialised checkpoint (``megatron_rl.models.tiny``),
  optionally after ``trainer.sft_warmup_steps`` supervised steps on the built-in task.
* ``prepare_teacher_model(config, out_dir, student_path)``: ``distillation.teacher_model.model_path``,
  or an inline teacher materialised with the student's tokenizer and optionally warmed up.

Each directory is built in a hidden sibling and renamed into place when complete (``replace_dir``):
a failure leaves the previous run's copy as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

from megatron_rl.config import RunConfig

# Also registers the agentic toy task (toy_multiply) in the task and reward registries.
from megatron_rl.rollout.agent.warmup import agent_task_texts, agent_warmup, install_tool_chat_template, is_agent_task
from megatron_rl.trainer.step_checkpoints import hf_num_params as _num_params

__all__ = ["prepare_policy_model", "prepare_teacher_model", "replace_dir", "staging_dir", "atomic_text"]


def staging_dir(final: str | Path, kind: str = "new") -> Path:
    """A hidden sibling of ``final`` to build its replacement in (``.<name>.<kind>-<id>``)."""
    final = Path(final)
    return final.parent / f".{final.name}.{kind}-{uuid.uuid4().hex[:8]}"


def atomic_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a hidden sibling, then renamed over it."""
    tmp = staging_dir(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def replace_dir(new: str | Path, final: str | Path) -> Path:
    """Put the complete directory ``new`` at ``final``: the old one is moved aside, ``new`` renamed
    in, then the old one removed -- at every moment one complete copy exists under some name."""
    new, final = Path(new), Path(final)
    old = None
    if final.exists():
        old = staging_dir(final, "old")
        os.replace(final, old)
    os.replace(new, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def _staged(final: Path) -> Iterator[Path]:
    """A staging directory for ``final``, removed if the block fails."""
    tmp = staging_dir(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _task_rows(config: RunConfig, num: int, seed: int) -> list[dict]:
    from megatron_rl.data.datasets import toy_rows

    kwargs = dict(config.data.task_kwargs)
    kwargs.pop("num_samples", None)
    return toy_rows(config.data.task, num, seed, **kwargs)


def prepare_policy_model(config: RunConfig, out_dir: str | Path, *, log=print) -> str:
    """The HF checkpoint directory the run's policy starts from (see the module docstring).

    Raises ValueError for an inline model without ``data.task`` (its tokenizer is trained on the
    task's texts) or a warm-up without ``data.task`` (it needs the task's answers).
    """
    from megatron_rl.models.tiny import materialize_inline_model, sft_warmup, task_texts

    out_dir = Path(out_dir)
    source = config.actor_rollout_ref.model
    path, task, steps = source.path, config.data.task, config.trainer.sft_warmup_steps
    seed = int(config.data.seed or 1)
    agent = is_agent_task(task)  # agentic toy tasks: tool-call demonstrations, a tool-aware chat template
    if path is None:
        inline = source.config
        if inline is None:
            raise ValueError("actor_rollout_ref.model: set path (an HF checkpoint directory) or config + family")
        if task is None:
            raise ValueError(
                "an inline actor_rollout_ref.model.config needs data.task (its tokenizer is trained "
                "on the built-in task's texts); got data.task=None"
            )
        start = time.perf_counter()
        rows = _task_rows(config, 1024, seed)
        with _staged(out_dir / "base_model") as staged:
            model = materialize_inline_model(
                staged,
                inline,
                source.family,
                task_texts(rows) + (agent_task_texts(config, rows) if agent else []),
                seed=config.actor_rollout_ref.actor.megatron.seed,
            )
            if agent:
                install_tool_chat_template(model["path"])
            model["path"] = str(replace_dir(staged, out_dir / "base_model"))
        n_params = _num_params(model["path"])
        log(
            f"built {model['path']} (qwen3, {n_params / 1e6:.2f}M parameters, vocab {len(model['tokenizer'])}) "
            f"in {time.perf_counter() - start:.1f}s"
        )
        path = model["path"]
    path = str(Path(path).expanduser())
    if steps > 0:
        if task is None:
            raise ValueError(
                f"trainer.sft_warmup_steps={steps} needs data.task (the built-in task's answers); got data.task=None"
            )
        start, losses = time.perf_counter(), []
        # Warm-up prompts are drawn with another seed than the RL prompts.
        rows = _task_rows(config, 2048, seed + 10007)
        with _staged(out_dir / "sft_model") as staged:
            path = str(
                agent_warmup(config, path, staged, rows, log=losses)
                if agent
                else sft_warmup(path, staged, rows, steps=steps, lr=config.trainer.sft_warmup_lr, seed=seed, log=losses)
            )
            path = str(replace_dir(staged, out_dir / "sft_model"))
        log(
            f"SFT warm-up: {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"in {time.perf_counter() - start:.1f}s -> {path}"
        )
    return path


def prepare_teacher_model(
    config: RunConfig, out_dir: str | Path, student_path: str | Path, *, log=print, reuse: bool = False
) -> str:
    """The distillation teacher's HF directory: ``distillation.teacher_model.model_path``, or an
    inline ``config`` materialised with the student's tokenizer (same task texts) and warmed up by
    ``teacher_model.sft_warmup_steps`` supervised steps. ValueError if the vocabularies differ.
    ``reuse`` (a resumed run): an inline teacher the run directory already holds is taken as it is."""
    from megatron_rl.models.tiny import materialize_inline_model, sft_warmup, task_texts

    out_dir = Path(out_dir)
    teacher = config.distillation.teacher_model
    if teacher.model_path:
        return str(Path(teacher.model_path).expanduser())
    existing = out_dir / ("teacher_model" if teacher.sft_warmup_steps > 0 else "teacher_base")
    if reuse and teacher.config is not None and (existing / "config.json").is_file():
        log(f"teacher: {existing} (prepared by the run being resumed; not built again)")
        return str(existing)
    inline = teacher.config
    if inline is None:
        raise ValueError("distillation.teacher_model: set model_path (an HF checkpoint) or config (an inline model)")
    if config.data.task is None:
        raise ValueError("an inline distillation.teacher_model.config needs data.task; got data.task=None")
    seed = int(config.data.seed or 1)
    start = time.perf_counter()
    with _staged(out_dir / "teacher_base") as staged:
        model = materialize_inline_model(
            staged,
            inline,
            config.actor_rollout_ref.model.family,
            task_texts(_task_rows(config, 1024, seed)),
            seed=seed + 1,
        )
        model["path"] = str(replace_dir(staged, out_dir / "teacher_base"))
    student_vocab = json.loads((Path(student_path) / "tokenizer.json").read_text())["model"]["vocab"]
    if student_vocab != json.loads((Path(model["path"]) / "tokenizer.json").read_text())["model"]["vocab"]:
        raise ValueError("the inline teacher's tokenizer differs from the student's; give both the same vocab_size")
    path = str(model["path"])
    steps = teacher.sft_warmup_steps
    if steps > 0:
        losses: list = []
        with _staged(out_dir / "teacher_model") as staged:
            sft_warmup(
                path,
                staged,
                _task_rows(config, 2048, seed + 20011),
                steps=steps,
                lr=config.trainer.sft_warmup_lr,
                seed=seed,
                log=losses,
            )
            path = str(replace_dir(staged, out_dir / "teacher_model"))
        log(
            f"teacher: {_num_params(path) / 1e6:.2f}M parameters, SFT {steps} steps, loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f} in {time.perf_counter() - start:.1f}s -> {path}"
        )
    return path
