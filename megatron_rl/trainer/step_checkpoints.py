"""Trainer checkpoints: the on-disk layout, atomic step directories with a manifest, the latest
pointer, the choice of the checkpoint to resume from, pruning and the free-space check.

Layout under ``trainer.default_local_dir`` (verl's names)::

    latest_checkpointed_iteration.txt     the newest complete step, e.g. "20"
    global_step_20/
        actor/                            Megatron dist checkpoint: model + optimizer + LR schedule + RNG
        critic/                           (with a critic)
        trainer_state.json                step, data position, KL controller, starting model
        config.yaml                       the run's configuration (when the run directory has one)
        manifest.json                     written last: size and checksum of every other file

A step is written into a hidden temporary sibling (``.global_step_20.tmp-<id>``) and renamed
into place only after every part is on disk and the manifest is written, then the latest
pointer is replaced atomically. A crash at any moment leaves the previous checkpoint, and the
pointer to it, intact; stale temporaries are removed by the next save.

Checksums: SHA-256 of every file up to ``FULL_HASH_BYTES``; a larger file (a shard of a big
model) is hashed over ``SAMPLED_BLOCKS`` blocks of 1 MiB (its first, its last and evenly spaced
ones) together with its size, so that writing and verifying stay cheap at any model size.
``verify_step`` checks a step against its manifest (a step without one, from an older version,
against its parts' own dist-checkpoint index); ``select_checkpoint`` picks the step to resume
from and, with ``trainer.resume_fallback``, falls back past damaged ones to the newest complete one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from parallel.checkpoint import check_free_space, verify_dist_checkpoint

__all__ = [
    "LATEST_FILE",
    "TRAINER_STATE",
    "MANIFEST",
    "CONFIG_COPY",
    "StepCheckpoint",
    "Selection",
    "find_resume_dir",
    "select_checkpoint",
    "verify_step",
    "prune_checkpoints",
    "step_dir",
    "step_dirs",
    "last_good_checkpoint",
    "hf_num_params",
    "estimate_checkpoint_bytes",
    "ensure_space_for_checkpoint",
]

LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
CONFIG_COPY = "config.yaml"
FULL_HASH_BYTES = 256 * 2**20
SAMPLED_BLOCKS = 16
_BLOCK = 2**20
_STEP_RE = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every ``global_step_N`` directory under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- manifest
def _digest(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: f.read(8 * _BLOCK), b""):
                h.update(chunk)
        else:  # sampled: first, last and evenly spaced blocks, plus the size
            h.update(str(size).encode())
            for i in range(SAMPLED_BLOCKS):
                f.seek((size - _BLOCK) * i // (SAMPLED_BLOCKS - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    """Relative paths of every regular file under ``root`` except the manifest, sorted."""
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _hash_all(root: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    def one(rel: str) -> tuple[str, dict[str, Any]]:
        size = (root / rel).stat().st_size
        return rel, {"size": size, "sha256": _digest(root / rel, size)}

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        return dict(pool.map(one, rels))


def write_manifest(root: Path, step: int) -> dict[str, Any]:
    """Write ``root/manifest.json`` describing every other file under ``root``; returns it."""
    files = _hash_all(root, _files(root))
    manifest = {
        "format": 1,
        "step": int(step),
        "files": files,
        "total_bytes": sum(f["size"] for f in files.values()),
        "full_hash_bytes": FULL_HASH_BYTES,
        "sampled_blocks": SAMPLED_BLOCKS,
    }
    _atomic_write(root / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def verify_step(path: str | Path, *, checksums: bool = True) -> list[str]:
    """What is wrong with the step checkpoint at ``path`` (empty: complete and intact), each entry
    naming the file: its ``trainer_state.json``, then every file of its manifest (present, size,
    checksum); a step without a manifest (an older version) is checked against its parts'
    completion markers and dist-checkpoint indexes instead."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} does not exist"]
    problems = []
    state = path / TRAINER_STATE
    try:
        steps = json.loads(state.read_text()).get("global_steps")
        if not isinstance(steps, int):
            problems.append(f"{state} has no integer global_steps")
    except FileNotFoundError:
        problems.append(f"{state} is missing")
    except (ValueError, AttributeError, UnicodeDecodeError) as exc:
        problems.append(f"{state} is not a valid trainer state ({type(exc).__name__}: {exc})")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        for part in sorted(p for p in path.iterdir() if p.is_dir()):
            problems += verify_dist_checkpoint(part)
        return problems
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return problems + [f"{manifest_path} is not a valid manifest ({type(exc).__name__}: {exc})"]
    present = []
    for rel, entry in sorted(files.items()):
        f = path / rel
        if not f.is_file():
            problems.append(f"{f} is missing (listed in {MANIFEST})")
        elif f.stat().st_size != entry["size"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, the manifest records {entry['size']}")
        else:
            present.append(rel)
    if checksums and present:
        for rel, got in _hash_all(path, present).items():
            if got["sha256"] != files[rel]["sha256"]:
                problems.append(f"{path / rel} does not match its checksum in {MANIFEST} (its contents changed)")
    return problems


# ----------------------------------------------------------------------------- writing
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
        """Write the driver state (and the run's ``config.yaml``), the manifest last, then rename
        the step into place and point ``latest_checkpointed_iteration.txt`` at it."""
        (self.tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        if (self.root / CONFIG_COPY).is_file():  # the configuration that produced this step
            shutil.copyfile(self.root / CONFIG_COPY, self.tmp / CONFIG_COPY)
        write_manifest(self.tmp, self.step)
        if self.final.exists():  # the same step saved again (a re-run, or past a damaged one): replace it
            old = self.root / f".{self.final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.final, old)
            os.replace(self.tmp, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        _atomic_write(self.root / LATEST_FILE, f"{self.step}\n")
        return self.final

    def __enter__(self) -> "StepCheckpoint":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- size and space
def hf_num_params(path: str | Path) -> int:
    """Parameters stored in an HF directory's safetensors files (read from their headers only)."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= int(d)
                total += n
    return total


_DTYPE_BYTES = {None: 4, "float32": 4, "bfloat16": 2, "float16": 2}


def estimate_checkpoint_bytes(root: str | Path, groups: dict[str, Any]) -> int:
    """Bytes the next step checkpoint will take: the newest complete one's size, or before the first
    save an estimate from each part's starting weights -- per parameter its dtype's bytes, plus
    Adam's two fp32 moments, plus an fp32 master copy under bf16/fp16."""
    for _, path in step_dirs(root):
        if (path / MANIFEST).is_file():
            try:
                return int(json.loads((path / MANIFEST).read_text())["total_bytes"])
            except (ValueError, KeyError):
                continue
    total = 0
    for group in groups.values():
        spec = getattr(group, "spec", None)
        if spec is None or getattr(spec, "hf_dir", None) is None:
            continue
        dtype_bytes = _DTYPE_BYTES.get(spec.megatron.dtype, 4)
        total += hf_num_params(spec.hf_dir) * (dtype_bytes + 8 + (4 if dtype_bytes < 4 else 0))
    return total


def ensure_space_for_checkpoint(root: str | Path, step: int, needed: int) -> None:
    """``DiskFullError`` (the path, the bytes needed and free, the last good checkpoint) unless
    ``needed`` bytes are free under ``root``; called before a save starts."""
    check_free_space(
        root,
        needed,
        f"saving checkpoint global_step_{step}",
        hint=f"; {last_good_checkpoint(root)}. Free space there, or keep fewer checkpoints "
        "(trainer.max_actor_ckpt_to_keep)",
    )


def last_good_checkpoint(root: str | Path) -> str:
    """``"the last good checkpoint is <dir>"`` (the latest pointer's step), or that none was saved."""
    latest = Path(root) / LATEST_FILE
    text = latest.read_text().strip() if latest.is_file() else ""
    if text.isdigit() and (step_dir(root, int(text)) / TRAINER_STATE).is_file():
        return f"the last good checkpoint is {step_dir(root, int(text))}"
    return "no checkpoint was saved (trainer.save_freq)"


# ----------------------------------------------------------------------------- resuming
@dataclasses.dataclass
class Selection:
    """The checkpoint a run resumes from (``path`` None: a fresh start) and the damaged ones it
    passed over (``skipped``: ``(directory, problems)``, newest first)."""

    path: Optional[Path]
    skipped: list[tuple[Path, list[str]]] = dataclasses.field(default_factory=list)

    @property
    def step(self) -> int:
        """The step of ``path`` (0 for a fresh start)."""
        return 0 if self.path is None else int(json.loads((self.path / TRAINER_STATE).read_text())["global_steps"])

    def state(self) -> dict[str, Any]:
        """The chosen checkpoint's ``trainer_state.json``."""
        return json.loads((self.path / TRAINER_STATE).read_text())

    def describe(self) -> str:
        """One line on what was passed over and why (empty when nothing was)."""
        if not self.skipped:
            return ""
        bad = "; ".join(
            f"{p.name} is damaged: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
            for p, problems in self.skipped
        )
        target = f"resuming from {self.path}, the newest complete checkpoint" if self.path else "no checkpoint is left"
        return f"{bad}; {target} (the damaged checkpoint is kept; trainer.resume_fallback=false refuses instead)"


def _damaged(path: Path, problems: list[str], key: str) -> ValueError:
    return ValueError(f"{key}: checkpoint {path} is damaged: {'; '.join(problems)}")


def select_checkpoint(
    root: str | Path, mode: str = "auto", resume_from_path: Optional[str] = None, *, fallback: bool = True
) -> Selection:
    """The checkpoint ``trainer.resume_mode`` selects, verified (``verify_step``) before anything is loaded.

    ``disable``: none. ``resume_path``: ``resume_from_path``, which must be complete and intact.
    ``auto``: the step of ``latest_checkpointed_iteration.txt`` (none: a fresh start); when it is
    damaged (or the pointer is), the newest complete older step if ``fallback``
    (``trainer.resume_fallback``), else ``ValueError`` naming the bad file. ``ValueError`` too when
    no complete checkpoint is left: the damaged ones are never deleted or replaced by a fresh start.
    """
    if mode == "disable":
        return Selection(None)
    if mode == "resume_path":
        path = Path(resume_from_path or "").expanduser()
        if not path.is_dir():
            raise ValueError(
                f"trainer.resume_from_path={resume_from_path!r} does not exist; expected a global_step_N directory"
            )
        problems = verify_step(path)
        if problems:
            raise _damaged(path, problems, f"trainer.resume_from_path={resume_from_path!r}")
        return Selection(path.resolve())
    if mode != "auto":
        raise ValueError(f"trainer.resume_mode={mode!r}; allowed: 'auto', 'disable', 'resume_path'")
    root = Path(root)
    latest = root / LATEST_FILE
    candidates = step_dirs(root)
    skipped: list[tuple[Path, list[str]]] = []
    if latest.is_file():
        text = latest.read_text().strip()
        if text.isdigit():
            target = int(text)
            candidates = [(s, p) for s, p in candidates if s <= target]
            if not any(s == target for s, _ in candidates):
                skipped.append((step_dir(root, target), [f"{latest} points at step {text}, which does not exist"]))
        else:
            skipped.append((latest, [f"{latest} holds {text!r}, not a step number"]))
    elif not candidates:
        return Selection(None)
    for _, path in candidates:
        problems = verify_step(path)
        if not problems:
            choice = Selection(path.resolve(), skipped)
            if skipped and not fallback:
                raise _damaged(skipped[0][0], skipped[0][1], "trainer.resume_mode='auto'") from None
            return choice
        skipped.append((path, problems))
        if not fallback:
            raise ValueError(
                f"trainer.resume_mode='auto': checkpoint {path} is damaged: {'; '.join(problems)}; "
                "trainer.resume_fallback=true resumes from the newest complete checkpoint instead, "
                "trainer.resume_mode=disable starts fresh"
            )
    named = "; ".join(f"{p}: {problems[0]}" for p, problems in skipped)
    raise ValueError(
        f"trainer.resume_mode='auto': no complete checkpoint under {root} ({named}); nothing was "
        "deleted. Set trainer.resume_mode=disable to start fresh, or repair/remove the damaged "
        "checkpoints"
    )


def find_resume_dir(
    root: str | Path, mode: str = "auto", resume_from_path: Optional[str] = None, *, fallback: bool = True
) -> Optional[Path]:
    """The step directory to resume from (``select_checkpoint``'s choice), or None to start fresh."""
    return select_checkpoint(root, mode, resume_from_path, fallback=fallback).path


def prune_checkpoints(root: str | Path, keep: Optional[int]) -> list[Path]:
    """Delete all but the newest ``keep`` step directories (None = keep all); returns the deleted."""
    if keep is None:
        return []
    steps = sorted(step_dirs(root))
    doomed = [p for _, p in steps[:-keep]] if keep > 0 else []
    for p in doomed:
        shutil.rmtree(p)
    return doomed
