"""The HF directories a run starts from: the policy (and the distillation teacher).

* ``prepare_policy_model(config, out_dir)``: the recipe's ``model.path``, or for an inline model
  (``model.config`` + ``family``) a freshly materialised checkpoint (``megatron_rl.models.tiny``),
  optionally after ``trainer.sft_warmup_steps`` supervised steps on the built-in task.
* ``prepare_teacher_model(config, out_dir, student_path)``: ``distillation.teacher_model.model_path``,
  or an inline teacher materialised with the student's tokenizer and optionally warmed up.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from megatron_rl.config import TrainerRunConfig

__all__ = ["prepare_policy_model", "prepare_teacher_model"]


def _task_rows(config: TrainerRunConfig, num: int, seed: int) -> list[dict]:
    from megatron_rl.data.datasets import toy_rows

    kwargs = dict(config.data.task_kwargs)
    kwargs.pop("num_samples", None)
    return toy_rows(config.data.task, num, seed, **kwargs)


def prepare_policy_model(config: TrainerRunConfig, out_dir: str | Path, *, log=print) -> str:
    """The HF checkpoint directory the run's policy starts from (see the module docstring).

    Raises ValueError for an inline model without ``data.task`` (its tokenizer is trained on the
    task's texts) or a warm-up without ``data.task`` (it needs the task's answers).
    """
    from megatron_rl.models.tiny import materialize_inline_model, sft_warmup, task_texts

    out_dir = Path(out_dir)
    source = config.actor_rollout_ref.model
    path, task, steps = source.path, config.data.task, config.trainer.sft_warmup_steps
    seed = int(config.data.seed or 1)
    if path is None:
        inline = source.config
        if inline is None:
            raise ValueError("actor_rollout_ref.model: set path (an HF checkpoint directory) or config + family")
        if task is None:
            raise ValueError("an inline actor_rollout_ref.model.config needs data.task (its tokenizer is trained "
                             "on the built-in task's texts); got data.task=None")
        start = time.perf_counter()
        model = materialize_inline_model(out_dir / "base_model", inline, source.family,
                                         task_texts(_task_rows(config, 1024, seed)),
                                         seed=config.actor_rollout_ref.actor.megatron.seed)
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
                              lr=config.trainer.sft_warmup_lr, seed=seed, log=losses))
        log(f"SFT warm-up: {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"in {time.perf_counter() - start:.1f}s -> {path}")
    return path


def prepare_teacher_model(config: TrainerRunConfig, out_dir: str | Path, student_path: str | Path, *, log=print) -> str:
    """The distillation teacher's HF directory: ``distillation.teacher_model.model_path``, or an
    inline ``config`` materialised with the student's tokenizer (same task texts) and warmed up by
    ``teacher_model.sft_warmup_steps`` supervised steps. ValueError if the vocabularies differ."""
    from megatron_rl.models.tiny import materialize_inline_model, sft_warmup, task_texts

    out_dir = Path(out_dir)
    teacher = config.distillation.teacher_model
    if teacher.model_path:
        return str(Path(teacher.model_path).expanduser())
    inline = teacher.config
    if inline is None:
        raise ValueError("distillation.teacher_model: set model_path (an HF checkpoint) or config (an inline model)")
    if config.data.task is None:
        raise ValueError("an inline distillation.teacher_model.config needs data.task; got data.task=None")
    seed = int(config.data.seed or 1)
    start = time.perf_counter()
    model = materialize_inline_model(out_dir / "teacher_base", inline, config.actor_rollout_ref.model.family,
                                     task_texts(_task_rows(config, 1024, seed)), seed=seed + 1)
    student_vocab = json.loads((Path(student_path) / "tokenizer.json").read_text())["model"]["vocab"]
    if student_vocab != json.loads((Path(model["path"]) / "tokenizer.json").read_text())["model"]["vocab"]:
        raise ValueError("the inline teacher's tokenizer differs from the student's; give both the same vocab_size")
    path = str(model["path"])
    steps = teacher.sft_warmup_steps
    if steps > 0:
        losses: list = []
        path = str(sft_warmup(path, out_dir / "teacher_model", _task_rows(config, 2048, seed + 20011), steps=steps,
                              lr=config.trainer.sft_warmup_lr, seed=seed, log=losses))
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
