"""What keeps a run from hanging silently or dying messily: the phase watchdog and signal handling.

* ``phase(name, timing)``: ``metrics.timer`` that also tells the active watchdog which step phase
  runs (the loop's phases all run under it).
* ``PhaseWatchdog``: a driver thread; when no phase has started or ended for
  ``trainer.phase_timeout_s`` seconds it writes the Python stacks of the driver and of every
  worker (``megatron_rl.workers.stacks``) to ``<run dir>/stacks/<time>-step<N>-<phase>/`` and
  interrupts the driver; the run stops with ``PhaseTimeout`` naming the phase, the stack
  directory and the last good checkpoint, after the hung workers are killed.
* ``StopSignals``: SIGTERM / SIGINT handlers. A signal is recorded and raises
  ``KeyboardInterrupt`` (the one exception Ray's blocking calls let through) -- the step is
  abandoned -- unless the loop runs with ``trainer.save_on_preemption``: then the first signal lets
  the step finish, a checkpoint is saved and the loop ends with ``Stopped``; a second signal stops
  at once. ``exit_code`` is 128 + the signal (143 SIGTERM, 130 SIGINT).
* ``guard_fit``: the decorator of ``RayPPOTrainer.fit`` that enters both for the loop.
"""

from __future__ import annotations

import _thread
import contextlib
import faulthandler
import functools
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional

from megatron_rl.trainer.step_checkpoints import last_good_checkpoint
from megatron_rl.trainer.metrics import timer

__all__ = [
    "phase",
    "PhaseWatchdog",
    "PhaseTimeout",
    "StopSignals",
    "Stopped",
    "guard_fit",
    "kill_workers",
    "worker_handles",
    "STACKS_DIR",
]

WAKE_SIGNAL = signal.SIGUSR2
"""Sent by the watchdog to the driver's main thread: a real signal ends a blocking call there (a
``time.sleep``, a socket read); its handler raises ``KeyboardInterrupt``, the one exception Ray's
blocking calls let through."""
STACKS_DIR = "stacks"
"""Stack dumps go to ``<trainer.default_local_dir>/stacks/<time>-step<N>-<phase>/<process>.txt``."""
_WORKER_DUMP_WAIT_S = 10.0


class PhaseTimeout(RuntimeError):
    """A step phase ran longer than ``trainer.phase_timeout_s``: the run stopped (exit 1)."""


class Stopped(BaseException):
    """The run stopped on a signal after finishing its step (``trainer.save_on_preemption``). A
    ``BaseException`` like ``KeyboardInterrupt``, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


# ----------------------------------------------------------------------------- signals
class StopSignals:
    """SIGTERM / SIGINT handling while entered (a no-op outside the main thread); see the module docstring."""

    _active: ClassVar[Optional["StopSignals"]] = None
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], Any] = print):
        self.signum: Optional[int] = None
        self.finish_step = False
        self.stop_after_step = False
        self.log = log
        self._previous: dict[int, Any] = {}

    @classmethod
    def current(cls) -> Optional["StopSignals"]:
        """The entered instance, if any."""
        return cls._active

    @property
    def exit_code(self) -> Optional[int]:
        """128 + the signal received (None: none)."""
        return None if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if first and self.finish_step:
            self.stop_after_step = True
            self.log(
                f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint and stopping "
                "(trainer.save_on_preemption); send it again to stop at once"
            )
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Within: a signal stops at once (``KeyboardInterrupt``) even where ``finish_step`` is on -- work
        after the last step (the final export) has no step to finish -- and so does one received before."""
        previous, self.finish_step = self.finish_step, False
        try:
            if self.signum is not None:
                raise KeyboardInterrupt
            yield
        finally:
            self.finish_step = previous

    def claim(self) -> None:
        """Install the handlers again (a library -- Ray's core -- replaced them); the saved ones stay."""
        if self._previous:
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            StopSignals._active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if StopSignals._active is self:
            StopSignals._active = None


# ----------------------------------------------------------------------------- workers
def worker_handles(placement: Any) -> dict[str, Any]:
    """``{name: actor}`` of every worker of ``placement`` (``actor-rank0`` ..., ``rollout`` for replica 0,
    ``rollout-replica1`` ... for the others)."""
    if placement is None:
        return {}
    out = {f"{role}-rank{rank}": w for role, group in placement.groups.items() for rank, w in enumerate(group.workers)}
    replicas = getattr(placement, "replicas", None) or []
    for replica in replicas:
        out["rollout" if replica.index == 0 else f"rollout-replica{replica.index}"] = replica.actor
    if not replicas and getattr(placement, "rollout", None) is not None:
        out["rollout"] = placement.rollout
    return out


def kill_workers(placement: Any, wait_s: float = 15.0) -> None:
    """Kill every worker of ``placement`` at once (a hung or abandoned call never returns by itself)
    and wait, bounded, until Ray reports them dead: ``placement.shutdown()``'s calls then fail at
    once instead of waiting out their timeout on a dying actor."""
    import ray

    actors = list(worker_handles(placement).values())
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    pending = []
    for actor in actors:
        try:
            pending.append(actor.__ray_ready__.remote())  # fails once the actor's death is known
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + wait_s
    for ref in pending:
        try:
            ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - ActorDiedError is the expected answer
            pass


# ----------------------------------------------------------------------------- the watchdog
class PhaseWatchdog:
    """Stops a run whose current phase makes no progress for ``timeout_s`` (see the module docstring).

    Args:
        timeout_s: ``trainer.phase_timeout_s``.
        log_dir: the run directory (stack dumps under ``stacks/``, the last good checkpoint).
        workers: ``{name: actor}`` whose stacks are dumped (``worker_handles``).
        step: returns the current step (for the message and the dump's name).
    """

    def __init__(
        self, timeout_s: float, log_dir: str | Path, workers: dict[str, Any], step: Callable[[], int] = lambda: 0
    ):
        self.timeout_s, self.log_dir, self.step = float(timeout_s), Path(log_dir), step
        self.stacks = self.log_dir / STACKS_DIR
        self.workers = dict(workers)
        self.tripped: Optional[str] = None
        self.dump_dir: Optional[Path] = None
        self._phases: list[str] = []
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._previous_handler: Any = None

    def start(self) -> "PhaseWatchdog":
        """Let every worker answer stack-dump requests, then start watching."""
        import ray

        self.stacks.mkdir(parents=True, exist_ok=True)
        if self.workers:
            ray.get([actor.enable_stack_dumps.remote(str(self.stacks), name) for name, actor in self.workers.items()])
        return self.watch()

    def watch(self) -> "PhaseWatchdog":
        """Start the watching thread (``start`` without the workers' listeners)."""
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(WAKE_SIGNAL, _raise_interrupt)
        self._thread = threading.Thread(target=self._run, name="phase-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self._previous_handler is not None:
            signal.signal(WAKE_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def enter(self, name: str) -> None:
        with self._lock:
            self._phases.append(name)
            self._since = time.monotonic()

    def exit(self, name: str) -> None:
        with self._lock:
            if self._phases and self._phases[-1] == name:
                self._phases.pop()
            self._since = time.monotonic()

    def _run(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                current = self._phases[-1] if self._phases else None
                idle = time.monotonic() - self._since
            if current is not None and idle > self.timeout_s:
                self._trip(current, idle)
                return

    def _trip(self, name: str, idle: float) -> None:
        step = self.step()
        self.dump_dir = self.dump_stacks(f"{time.strftime('%Y%m%d-%H%M%S')}-step{step}-{name}")
        missing = sorted(n for n in self.workers if not (self.dump_dir / f"{n}.txt").is_file())
        self.tripped = (
            f"step {step}: phase '{name}' made no progress for {idle:.0f}s, longer than "
            f"trainer.phase_timeout_s={self.timeout_s:g} (a hang); the Python stacks of the driver and "
            f"every worker are in {self.dump_dir}"
            + (f" (none came from {', '.join(missing)})" if missing else "")
            + f"; the run stops; {last_good_checkpoint(self.log_dir)}"
        )
        print(f"hang watchdog: {self.tripped}", file=sys.stderr, flush=True)
        if self._previous_handler is not None:  # KeyboardInterrupt in the main thread, even in a blocking call
            signal.pthread_kill(threading.main_thread().ident, WAKE_SIGNAL)
        else:
            _thread.interrupt_main()

    def dump_stacks(self, name: str) -> Path:
        """The driver's and every worker's stacks into ``stacks/<name>/``; waits (bounded) for the workers."""
        directory = self.stacks / name
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "driver.txt", "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        (self.stacks / ".request").write_text(name + "\n")
        deadline = time.monotonic() + _WORKER_DUMP_WAIT_S
        while time.monotonic() < deadline and not all((directory / f"{n}.txt").is_file() for n in self.workers):
            time.sleep(0.1)
        return directory


_ACTIVE: Optional[PhaseWatchdog] = None  # the watchdog of the loop that runs now (one loop per driver)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def phase(name: str, timing: dict[str, float]) -> Iterator[None]:
    """``timer(name, timing)``, and the phase the active watchdog watches."""
    watchdog = _ACTIVE
    if watchdog is not None:
        watchdog.enter(name)
    try:
        with timer(name, timing):
            yield
    finally:
        if watchdog is not None:
            watchdog.exit(name)


# ----------------------------------------------------------------------------- the loop's guard
def guard_fit(fit: Callable) -> Callable:
    """Decorate ``RayPPOTrainer.fit``: the watchdog (``trainer.phase_timeout_s``) and the signal
    behaviour (``trainer.save_on_preemption``) of the loop; see the module docstring."""

    @functools.wraps(fit)
    def guarded(trainer: Any, total_steps: Optional[int] = None, on_step: Optional[Callable] = None):
        global _ACTIVE
        tcfg = trainer.config.trainer
        with contextlib.ExitStack() as stack:
            signals = StopSignals.current() or stack.enter_context(StopSignals())
            previous, signals.finish_step = signals.finish_step, bool(tcfg.save_on_preemption)
            stack.callback(setattr, signals, "finish_step", previous)
            watchdog = None
            if tcfg.phase_timeout_s is not None:
                watchdog = PhaseWatchdog(
                    tcfg.phase_timeout_s,
                    trainer.log_dir,
                    worker_handles(trainer.placement),
                    step=lambda: trainer.global_steps,
                ).start()
                _ACTIVE = watchdog
                stack.callback(watchdog.stop)

            def step_done(metrics: dict) -> None:
                if on_step is not None:
                    on_step(metrics)
                if signals.stop_after_step:
                    step = int(metrics["training/global_step"])
                    if "timing_s/save_checkpoint" in metrics:  # the loop saved this step already
                        saved = trainer.checkpointer.root / f"global_step_{step}"
                    else:
                        saved, _ = trainer.checkpointer.save_step(trainer, step)
                    raise Stopped(
                        signals.signum,
                        f"stopped by {signals.name} after step {step}; checkpoint "
                        f"{saved} saved (trainer.save_on_preemption)",
                    )

            try:
                return fit(trainer, total_steps, step_done)
            except KeyboardInterrupt:
                if watchdog is not None and watchdog.tripped:
                    kill_workers(trainer.placement)
                    raise PhaseTimeout(watchdog.tripped) from None
                raise
            finally:
                _ACTIVE = None

    return guarded
