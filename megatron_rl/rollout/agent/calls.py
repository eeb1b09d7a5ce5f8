"""Execute a round's tool calls concurrently, each bounded by its tool's timeout.

``run_calls(jobs, timeouts, max_workers)`` runs at most ``max_workers`` jobs at a time in daemon
threads. A job that outlives its timeout (measured from when it started) is abandoned -- its
slot goes to the next job and its result, should it ever come, is ignored -- so a hanging tool
costs the round its timeout, never the run; daemon threads do not keep the process alive.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Sequence, TypeVar

__all__ = ["TimedOut", "run_calls"]

T = TypeVar("T")


class TimedOut:
    """The result slot of a job abandoned at its timeout."""

    def __init__(self, seconds: float):
        self.seconds = seconds


def run_calls(jobs: Sequence[Callable[[], T]], timeouts: Sequence[float], max_workers: int) -> list[T | TimedOut]:
    """Each job's result (or ``TimedOut``), in order. Jobs must not raise (wrap them)."""
    if len(jobs) != len(timeouts):
        raise ValueError(f"{len(jobs)} jobs but {len(timeouts)} timeouts")
    results: list = [None] * len(jobs)
    finished: set[int] = set()
    abandoned: set[int] = set()
    cond = threading.Condition()

    def work(i: int) -> None:
        value = jobs[i]()
        with cond:
            if i not in abandoned:
                results[i] = value
                finished.add(i)
            cond.notify_all()

    waiting, running = deque(range(len(jobs))), {}  # running: index -> deadline
    with cond:
        while waiting or running:
            while waiting and len(running) < max_workers:
                i = waiting.popleft()
                running[i] = time.monotonic() + timeouts[i]
                threading.Thread(target=work, args=(i,), daemon=True, name=f"tool-call-{i}").start()
            for i in [i for i in running if i in finished]:
                del running[i]
            now = time.monotonic()
            for i in [i for i, deadline in running.items() if deadline <= now]:
                del running[i]
                abandoned.add(i)
                results[i] = TimedOut(timeouts[i])
            if running and not (waiting and len(running) < max_workers):
                cond.wait(timeout=max(0.0, min(running.values()) - now))
    return results
