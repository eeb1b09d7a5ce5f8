"""Which config fields the running code reads: the evidence behind "no key is silently ignored".

When tracking is on, every read of a config dataclass field by code *outside* the config
layer is recorded as the field's dotted path in the run's tree (``trainer.save_freq``,
``actor_rollout_ref.ref.megatron.seed``); reads by the config's own validation, by
``dataclasses`` (``replace``, ``asdict``), ``copy`` or OmegaConf do not count -- they do not act
on the value. Each process appends its first read of a path to ``<dir>/reads-<pid>.txt``, so
Ray workers (which inherit ``MEGATRON_RL_TRACK_CONFIG_READS`` from the driver) report too.

Paths come from ``tag_paths`` (``RunConfig.from_dict`` tags every section it builds); a
read on an untagged copy (``dataclasses.replace`` makes those) is recorded as
``?ClassName.field``. Off by default; ``tests/megatron_rl/config/test_every_key_is_read.py``
turns it on. The config classes carry nothing of it: ``start`` puts a recording ``__getattribute__``
on ``BaseConfig`` and ``stop`` takes it off again (a process started with ``MEGATRON_RL_TRACK_CONFIG_READS``
set starts when ``megatron_rl.config.base_config`` is imported).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = ["TRACK_ENV", "start", "stop", "tag_paths", "copy_tag", "read_paths", "leaf_paths", "observe", "tracking"]

TRACK_ENV = "MEGATRON_RL_TRACK_CONFIG_READS"
"""Directory to record reads in; set, tracking starts when ``megatron_rl.config`` is imported."""
PATH_ATTR = "_config_path"

_CONFIG_DIR = str(Path(__file__).resolve().parent) + os.sep
_UTILS_ACCESS = str(Path(__file__).resolve().parent.parent / "utils" / "config_access.py")
_PASS_THROUGH = {str(Path(__file__).resolve().parent / "base_config.py"), _UTILS_ACCESS, "<string>"}
"""Frames a read passes through to its real reader: ``BaseConfig.get``/``[]``, ``cfg_get``, the
dataclass-generated ``__eq__``/``__repr__``."""
_NOT_ACTING = ("dataclasses.py", "copy.py", "copyreg.py", "reprlib.py", "pprint.py", f"{os.sep}omegaconf{os.sep}")


class _Tracker:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seen: set[str] = set()
        self.fields: dict[type, frozenset] = {}

    def record(self, key: str) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        with open(self.dir / f"reads-{os.getpid()}.txt", "a") as f:
            f.write(key + "\n")


_tracker: Optional[_Tracker] = None
_base: Optional[type] = None  # the class ``start`` put the recording ``__getattribute__`` on


def tracking() -> bool:
    """True while reads are recorded."""
    return _tracker is not None


def _recording_getattribute(self: Any, name: str) -> Any:
    """``BaseConfig.__getattribute__`` while tracking: every public read is ``observe``d."""
    if name[:1] != "_" and _tracker is not None:
        observe(self, name)
    return object.__getattribute__(self, name)


def start(directory: str | os.PathLike, base: type) -> None:
    """Record reads of this process (and, through the environment, of processes started later) in ``directory``:
    ``base`` (``BaseConfig``; this module imports nothing of the config) reads through ``_recording_getattribute``
    until ``stop``."""
    global _tracker, _base
    os.environ[TRACK_ENV] = str(directory)
    _tracker = _Tracker(directory)
    _base = base
    base.__getattribute__ = _recording_getattribute


def stop() -> None:
    """Stop recording (this process; later children no longer inherit it); ``BaseConfig`` reads plainly again."""
    global _tracker, _base
    os.environ.pop(TRACK_ENV, None)
    _tracker = None
    if _base is not None and "__getattribute__" in vars(_base):
        del _base.__getattribute__
    _base = None


def observe(obj: Any, name: str) -> None:
    """Called by ``_recording_getattribute`` for every public attribute read while tracking."""
    tracker = _tracker
    cls = type(obj)
    names = tracker.fields.get(cls)
    if names is None:
        names = tracker.fields[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    if name not in names:
        return
    frame = sys._getframe(2)  # 0: observe, 1: __getattribute__, 2: the reader
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in _PASS_THROUGH:
            frame = frame.f_back
            continue
        if not filename.startswith(_CONFIG_DIR):
            break
        # Inside the config layer: validation does not act on a value; a section's own accessor
        # (``MegatronConfig.parallel()``, ``TrainerConfig.world_size``) reads for whoever called it.
        name_of = frame.f_code.co_name
        if name_of == "__post_init__" or name_of.lstrip("_").startswith(("check", "validate")):
            return
        owner = frame.f_locals.get("self")
        # A config section's method (every section shares the recording __getattribute__, which calls us).
        if getattr(type(owner), "__getattribute__", None) is not type(obj).__getattribute__:
            return  # schema, loader, compat, tagging: the config's own machinery
        frame = frame.f_back
    if frame is None or any(part in frame.f_code.co_filename for part in _NOT_ACTING):
        return
    path = object.__getattribute__(obj, "__dict__").get(PATH_ATTR)
    tracker.record(f"{path}.{name}" if path else f"?{cls.__name__}.{name}")


def copy_tag(source: Any, copy: Any) -> Any:
    """``copy`` (a ``dataclasses.replace`` of ``source``) tagged with ``source``'s path; returns it."""
    path = object.__getattribute__(source, "__dict__").get(PATH_ATTR)
    if path is not None:
        object.__setattr__(copy, PATH_ATTR, path)
    return copy


def tag_paths(config: Any, path: str = "") -> None:
    """Tag every config section of the tree under ``config`` with its dotted path."""
    if path:
        object.__setattr__(config, PATH_ATTR, path)
    for f in dataclasses.fields(config):
        value = object.__getattribute__(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            tag_paths(value, f"{path}.{f.name}" if path else f.name)


def read_paths(directory: str | os.PathLike) -> set[str]:
    """Every path any process recorded in ``directory``."""
    out: set[str] = set()
    for f in Path(directory).glob("reads-*.txt"):
        out.update(line.strip() for line in f.read_text().splitlines() if line.strip())
    return out


def leaf_paths(root: type, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """``(dotted path, owning class, field name)`` of every leaf of the schema under ``root``
    (a nested config section is walked, an open mapping is one leaf)."""
    import typing

    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        if f.metadata.get("internal"):
            continue  # set by the running code, not a key
        sub = _config_class(hints[f.name])
        if sub is not None:
            yield from leaf_paths(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", root, f.name


def _config_class(hint: Any) -> Optional[type]:
    """The config dataclass inside ``X`` or ``Optional[X]`` (every section is a dataclass), else None."""
    import typing

    for cand in typing.get_args(hint) or (hint,):
        if isinstance(cand, type) and dataclasses.is_dataclass(cand):
            return cand
    return None
