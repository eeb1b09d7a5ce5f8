"""Nothing of a run outlives its driver: a watcher that kills the driver's processes when it dies.

``ray.init()`` starts Ray's head processes (GCS, raylet, agents) as children of the driver, and
they start the workers (and vLLM's); none of them dies with a driver that is SIGKILLed or
OOM-killed, and they linger for minutes. ``start_reaper()`` starts ``python -m
megatron_rl.job.reaper <driver pid>`` in its own session (a signal to the driver's process group
does not reach it). It records the driver's descendants every ``POLL_S`` seconds; once the driver
is gone it sends SIGTERM to every recorded process still alive (and its own descendants), waits
``GRACE_S``, and SIGKILLs the rest. A process is recognised by pid and start time, so a reused pid
is never touched. The driver stops the reaper (SIGTERM) after a clean shutdown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["start_reaper", "stop_reaper", "POLL_S", "GRACE_S"]

POLL_S = 0.5
GRACE_S = 3.0


def start_reaper(pid: int | None = None) -> subprocess.Popen:
    """Watch ``pid`` (default: this process) from a detached process; returns it (``stop_reaper``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.job.reaper", str(pid or os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def stop_reaper(reaper: subprocess.Popen | None) -> None:
    """Stop a reaper without it killing anything (the run shut down cleanly)."""
    if reaper is not None and reaper.poll() is None:
        reaper.terminate()
        try:
            reaper.wait(timeout=5)
        except subprocess.TimeoutExpired:
            reaper.kill()


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch(pid: int) -> int:
    """The reaper's loop (see the module docstring); returns the number of processes it signalled."""
    import psutil

    try:
        driver = psutil.Process(pid)
    except psutil.Error:
        return 0
    me = os.getpid()
    known: dict[int, float] = {}
    while _alive(driver):
        try:
            for child in driver.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child.create_time())
        except psutil.Error:
            pass
        time.sleep(POLL_S)
    victims = {}
    for child_pid, created in known.items():
        try:
            proc = psutil.Process(child_pid)
            if proc.create_time() != created:
                continue  # the pid was reused by an unrelated process
            for p in [proc, *proc.children(recursive=True)]:
                if p.pid != me:
                    victims[p.pid] = p
        except psutil.Error:
            continue
    for p in victims.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(victims.values()), timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(victims)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # stop_reaper: the run ended cleanly
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the driver, which shuts down itself
    watch(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
