"""Trainer checkpoints: the on-disk layout, atomic step directories, the latest pointer, pruning.

Layout under ``trainer.default_local_dir`` (verl's names)::

    latest_checkpointed_iteration.txt     the newest complete step, e.g. "20"
    global_step_20/
        actor/                            Megatron dist checkpoint: model + optimizer + LR schedule + RNG
        critic/                           (with a critic)
        trainer_state.json                step, data position, KL controller, driver RNG

A step is written into a hidden temporary sibling (``.global_step_20.tmp-<id>``) and renamed
into place only after every part is on disk, then the latest pointer is replaced atomically.
A crash at any moment leaves the previous checkpoint, and the pointer to it, intact; stale
temporaries are removed by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

__all__ = ["LATEST_FILE", "TRAINER_STATE", "StepCheckpoint", "find_resume_dir", "prune_checkpoints", "step_dir"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


class StepCheckpoint:
    """One step's checkpoint being written: ``parts`` go into ``self.tmp``; ``commit()`` publishes.

    Use as a context manager: on an exception the temporary directory is removed and the
    previous checkpoint stays the latest.
    """

    def __init__(self, root: str | Path, step: int):
        self.root, self.step = Path(root).resolve(), int(step)
        self.final = step_dir(self.root, self.step)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".global_step_*.tmp-*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = self.root / f".{self.final.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()

    def part(self, name: str) -> Path:
        """Path of a part inside the step (written by whoever saves that part)."""
        return self.tmp / name

    def commit(self, trainer_state: dict[str, Any]) -> Path:
        (self.tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        if self.final.exists():  # the same step saved again (e.g. a re-run): replace it
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
        _atomic_write(self.root / LATEST_FILE, f"{self.step}\n")
        return self.final

    def __enter__(self) -> "StepCheckpoint":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


def find_resume_dir(root: str | Path, mode: str = "auto", resume_from_path: Optional[str] = None) -> Optional[Path]:
    """The step directory to resume from, or None to start fresh.

    ``auto``: the step named by ``latest_checkpointed_iteration.txt`` under ``root`` (None if
    there is none); ``resume_path``: ``resume_from_path`` (must be a complete step directory);
    ``disable``: None. Raises ValueError for a pointer or path that is not a complete checkpoint.
    """
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = Path(resume_from_path or "").expanduser()
        if not (path / TRAINER_STATE).is_file():
            raise ValueError(f"trainer.resume_from_path={resume_from_path!r} is not a complete checkpoint "
                             f"(no {TRAINER_STATE}); expected a global_step_N directory")
        return path.resolve()
    if mode != "auto":
        raise ValueError(f"trainer.resume_mode={mode!r}; allowed: 'auto', 'disable', 'resume_path'")
    latest = Path(root) / LATEST_FILE
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{latest} holds {text!r}, not a step number")
    path = step_dir(root, int(text))
    if not (path / TRAINER_STATE).is_file():
        raise ValueError(f"{latest} points at step {text}, but {path} is not a complete checkpoint")
    return path.resolve()


def prune_checkpoints(root: str | Path, keep: Optional[int]) -> list[Path]:
    """Delete all but the newest ``keep`` step directories (None = keep all); returns the deleted."""
    if keep is None:
        return []
    steps = sorted((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir())
    doomed = [p for _, p in steps[:-keep]] if keep > 0 else []
    for p in doomed:
        shutil.rmtree(p)
    return doomed
