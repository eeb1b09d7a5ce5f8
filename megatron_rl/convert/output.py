"""The converters' output directory (built aside, renamed into place), progress bars and peak memory."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

from megatron_rl.convert.support import ToolError, dir_bytes, fmt_bytes
from megatron_rl.convert.launch import broadcast_str, is_driver, under_torchrun


# ------------------------------------------------------------------------------------------
# Output directory: built aside, renamed into place.
# ------------------------------------------------------------------------------------------
class AtomicDir:
    """``with AtomicDir(final, overwrite) as tmp: ...; commit()`` -- the output appears whole or not at all.

    ``tmp`` is a hidden sibling of ``final`` that does not exist yet (writers that rename their
    own temporary directory into it, like ``save_model``/``save_hf_checkpoint``, create it).
    ``commit()`` renames it to ``final`` (replacing an old ``final`` only with ``overwrite``).
    Leaving the block without ``commit()``, or with an exception, removes ``tmp`` and any
    ``.<tmp>.tmp-*`` directory a crashed writer left. Only the driver process touches disk.
    A conversion killed outright (SIGKILL, the OOM killer) cannot clean up: its temporary
    directory carries the host and pid of its driver, and the next conversion to the same
    output removes those whose driver no longer runs on this host (``sweep_stale``).
    """

    def __init__(self, final: str | os.PathLike, overwrite: bool):
        self.final = Path(final).resolve()
        self.overwrite = overwrite
        tag = f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp = Path(broadcast_str(str(self.final.parent / f".{self.final.name}.convert-{tag}")))
        self.committed = False
        if is_driver():
            self.sweep_stale()
        self.new_parents = []  # ancestors the writers will create: removed again on failure
        parent = self.final.parent
        while not parent.exists():
            self.new_parents.append(parent)
            parent = parent.parent

    def __enter__(self) -> Path:
        return self.tmp

    def sweep_stale(self) -> list[Path]:
        """Remove the temporary directories of earlier conversions to ``final`` whose driver process
        (same host) is gone; returns them."""
        removed = []
        prefix = f".{self.final.name}.convert-{_host()}-"
        if not self.final.parent.is_dir():
            return removed
        for leftover in self.final.parent.glob(f"{glob_escape(prefix)}*"):
            pid = leftover.name[len(prefix) :].split("-")[0].split(".")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(leftover)
        return removed

    def commit(self) -> None:
        if not is_driver():
            return
        if self.final.exists():
            if not self.overwrite:  # appeared while we were converting
                raise ToolError(f"output directory {self.final} exists; pass --overwrite to replace it")
            trash = self.final.parent / f".{self.final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.final, trash)
            os.replace(self.tmp, self.final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        self.committed = True

    def __exit__(self, *exc) -> None:
        if self.committed or not is_driver():
            return
        for leftover in [self.tmp, *self.tmp.parent.glob(f".{self.tmp.name}.tmp-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        for parent in self.new_parents:  # deepest first; only if nothing else was put there
            try:
                parent.rmdir()
            except OSError:
                break


def _host() -> str:
    import socket

    return socket.gethostname().replace("-", "_").replace(".", "_")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def glob_escape(text: str) -> str:
    """``text`` with glob metacharacters escaped."""
    import glob

    return glob.escape(text)


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool, *sources: str | os.PathLike) -> Path:
    """``out_dir`` resolved; an error if it exists (without ``overwrite``) or overlaps a source."""
    out = Path(out_dir).resolve()
    for src in sources:
        src = Path(src).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise ToolError(f"output directory {out} overlaps the input {src}; choose another --out-dir")
    if out.exists() and not overwrite:
        raise ToolError(f"output directory {out} exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise ToolError(f"output path {out} exists and is not a directory")
    return out


# ------------------------------------------------------------------------------------------
# Progress and the summary line.
# ------------------------------------------------------------------------------------------
def max_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_peaks() -> list[int]:
    """Every rank's peak resident memory (collective; one entry without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [max_rss()]
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, max_rss())
    return peaks


class TreeMemory:
    """The peak of the summed PSS (proportional set size: a page shared by n processes counts 1/n
    in each, so pages the forked ranks share with their server are counted once) of this process
    and all its descendants -- the fork server, the ranks, their writer processes -- sampled every
    ``interval`` seconds in a thread while the ``with`` block runs. ``peak`` is None where the
    kernel reports no PSS (``/proc/<pid>/smaps_rollup``), or psutil is missing."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def sample() -> int | None:
        """Summed PSS of this process tree now, in bytes (None where unavailable)."""
        try:
            import psutil
        except ImportError:
            return None
        me = psutil.Process()
        total, seen = 0, False
        for proc in [me, *me.children(recursive=True)]:
            try:
                pss = getattr(proc.memory_full_info(), "pss", None)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if pss is None:
                return None
            total, seen = total + pss, True
        return total if seen else None

    def _run(self) -> None:
        while True:
            value = self.sample()
            if value is None:
                return
            self.peak = max(self.peak or 0, value)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "TreeMemory":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def peak_summary(peaks: list[int], tree_pss: int | None = None) -> str:
    """The done line's memory: with ``tree_pss`` (``TreeMemory.peak``) ``peak memory 1.2 GiB (PSS of
    this process and its ranks, summed, sampled every 0.2 s)``; else (torchrun, no PSS) ``peak memory
    1.5 GiB (2 ranks' max RSS summed + this process 0.3 GiB; RSS counts shared pages in every process)``."""
    if tree_pss is not None:
        return (
            f"peak memory {fmt_bytes(tree_pss)} (PSS of this process, its fork server, ranks and writers, "
            f"summed; shared pages counted once)"
        )
    own = max_rss() if not under_torchrun() else 0
    text = f"peak memory {fmt_bytes(sum(peaks) + own)} ({len(peaks)} ranks' max RSS summed"
    text += f" + this process {fmt_bytes(own)}" if own else ""
    return text + "; RSS counts shared pages in every process, an overcount)"


class Progress:
    """A tqdm bar (stderr, one process only) over a conversion's stages; ``watch`` adds a
    byte counter for a stage that writes files, by polling the sizes under a directory."""

    def __init__(self, stages: list[str], enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(
            total=len(stages),
            desc=stages[0],
            unit="stage",
            disable=not enabled,
            file=sys.stderr,
            bar_format="{desc:<34} {n_fmt}/{total_fmt} [{elapsed}] {postfix}",
        )
        self.started = False

    def stage(self, name: str) -> None:
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_description_str(name)
        self.bar.set_postfix_str("")

    def close(self) -> None:
        """Complete the last stage and end the bar."""
        if self.started:
            self.bar.update(1)
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # end the line, so the error message starts on its own
            self.bar.close()

    def watch(self, out: Path, total: int) -> "threading.Event":
        """Show bytes written under ``out`` and its writers' temporary siblings (``.<out>.tmp-*``)
        against ``total`` until the event is set."""
        done = threading.Event()
        if self.bar.disable:
            return done

        began = time.monotonic()

        def poll() -> None:
            while not done.wait(0.5):
                try:
                    dirs = [out, *out.parent.glob(f".{glob_escape(out.name)}.tmp-*")]
                    written = sum(dir_bytes(p) for p in dirs if p.is_dir())
                except OSError:  # a file renamed or removed while we looked
                    continue
                rate = written / 2**20 / max(time.monotonic() - began, 1e-3)
                self.bar.set_postfix_str(f"{fmt_bytes(written)} / ~{fmt_bytes(total)}, {rate:.1f} MB/s")

        threading.Thread(target=poll, daemon=True).start()
        return done
