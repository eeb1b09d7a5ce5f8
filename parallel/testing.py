"""Run a function on N real ``torch.distributed`` ranks (spawned processes) for tests and tools.

``run_distributed(fn, world_size=2)`` starts ``world_size`` processes, initialises a process
group (gloo on CPU, NCCL where asked) on a fresh free port, calls ``fn(rank, world_size,
*args)`` on each, and returns the per-rank return values in rank order. The first failing
rank's exception is re-raised in the caller with that rank's traceback; a run that exceeds
``timeout_s`` is killed and reported instead of hanging.

CPU (gloo) ranks are forked from a fork server of this module's own that imported torch and
Megatron once (``parallel._rank_preload``): a rank starts in a fraction of a second instead of
the seconds a spawned interpreter spends importing them, and every rank of the session shares
those pages. A rank still gets the caller's ``sys.path``, working directory and environment as
they are at the call (a spawned rank would inherit them the same way). NCCL ranks, and every rank on a machine with CUDA, are spawned (``spawn_ranks``).

No rank outlives the call: each rank leads its own process group, which is killed (the rank
and anything it started) on every way out of ``run_distributed``, and each rank is set to die
with its parent (``PR_SET_PDEATHSIG``), so a parent killed with SIGKILL leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp
from multiprocessing import forkserver, popen_forkserver, util

PRELOAD = "parallel._rank_preload"
"""What the rank fork server imports once, before it forks its first rank."""


class _RankForkServer(forkserver.ForkServer):
    """A fork server of run_distributed's own, so that a tool's fork server in the same process
    (``multiprocessing``'s global one, e.g. the converters') keeps its own preload and vice versa."""

    def __init__(self) -> None:
        super().__init__()
        self.set_forkserver_preload([PRELOAD])


_SERVER = _RankForkServer()


class _RankPopen(popen_forkserver.Popen):
    """``popen_forkserver.Popen`` launching through ``_SERVER`` instead of the global server (the
    forked child's side is the same: the server's ``_serve_one`` hands it the inherited fds)."""

    def _launch(self, process_obj):
        import io

        from multiprocessing import spawn
        from multiprocessing.context import reduction, set_spawning_popen

        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        _SERVER.ensure_running()
        self.sentinel, w = _SERVER.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child's sentinel of this process, as in popen_forkserver
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _RankProcess(mp.get_context("forkserver").Process):
    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)


__all__ = ["run_distributed", "spawn_ranks", "find_free_port", "DistributedTestError", "exit_server_at_once"]


class DistributedTestError(RuntimeError):
    """A rank raised, died, or the run timed out."""


def exit_server_at_once() -> None:
    """End a fork server (this module's, the converters') without the interpreter's teardown.

    A server exits when its caller does (its ``alive`` pipe closes); freeing torch's and Megatron's
    modules one by one takes seconds, during which it still holds the caller's stdout / stderr open
    (a pipe reader waits for it), and nanobind reports the frozen objects as leaks. Nothing of the
    server's outlives its ranks, which have exited. Register it with ``atexit`` in the preload."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tie_to_parent(caller_pid: int) -> None:
    """Lead a process group of our own and die with our parent (Linux), even if it is SIGKILLed.

    The parent is the caller (spawned ranks) or the fork server, which exits when the caller does
    (its ``alive`` pipe closes), so a forked rank dies with the caller too."""
    os.setpgid(0, 0)
    # A forked rank holds the write end of the server's ``alive`` pipe (multiprocessing hands it
    # to every child, for children that start processes of their own through the server): with
    # it open the server would outlive a killed caller, and so would this rank.
    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        os.kill(caller_pid, 0)  # the caller died before the death signal was armed
    except ProcessLookupError:
        os._exit(1)
    if os.getppid() == 1:  # so did our parent
        os._exit(1)


def _kill_rank(proc: Any) -> None:
    """SIGKILL a rank's process group (the rank and whatever it started), then reap the rank."""
    # Started and not yet reaped: its pid is still its group's id (a pid is not reused before that).
    if proc.pid is not None and proc.exitcode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not yet its own group leader
            proc.kill()
        proc.join(timeout=5)


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    fn: Callable,
    args: tuple,
    env: dict[str, str],
    results: Any,
    caller_pid: int,
) -> None:
    _tie_to_parent(caller_pid)
    os.environ.clear()  # the caller's environment at the call (a forked rank has the server's)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(out)
        except Exception as exc:  # report unpicklable results clearly
            raise TypeError(f"rank {rank}: return value of {fn.__name__} cannot be pickled: {exc}") from exc
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def spawn_ranks(backend: str, cuda: bool | None = None) -> bool:
    """Whether ``run_distributed`` spawns its ranks (a fresh interpreter each) rather than forking them
    from the preloaded fork server: NCCL ranks, and any rank on a machine with CUDA (``cuda``; default
    ``torch.cuda.is_available()``, which does not initialise CUDA). A CUDA context does not survive a fork,
    and the fork server's imports may initialise one: forked gloo ranks on the first H200 failed with
    "Cannot re-initialize CUDA in forked subprocess" at ``torch.cuda.set_device``."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return backend == "nccl" or bool(cuda)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable (module level) because ranks are started with ``spawn``.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not allowed; choose 'gloo' or 'nccl'")
    spawned = spawn_ranks(backend)
    ctx = mp.get_context("spawn" if spawned else "forkserver")
    process = ctx.Process if spawned else _RankProcess
    results = ctx.Queue()
    port = find_free_port()
    rank_env = {**os.environ, **(env or {})}
    procs = [
        process(
            target=_worker, daemon=False, args=(r, world_size, backend, port, fn, args, rank_env, results, os.getpid())
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    outputs: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    try:
        for p in procs:
            p.start()
        while len(outputs) < world_size and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedTestError(
                    f"{fn.__name__} timed out after {timeout_s:g} s on {world_size} ranks; "
                    f"ranks that finished: {sorted(outputs)}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank that exited without reporting is dead, even with exit code 0 (os._exit(0),
                # a library calling exit): waiting for it would only end at the timeout.
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outputs]
                if dead:
                    # Give a dying rank a moment to deliver its traceback.
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise DistributedTestError(f"{fn.__name__}: ranks died without a report, exit codes {codes}")
                else:
                    continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failure = (rank, payload)
        if failure is not None:
            rank, tb = failure
            raise DistributedTestError(f"{fn.__name__} failed on rank {rank} of {world_size}:\n{tb}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            _kill_rank(p)
