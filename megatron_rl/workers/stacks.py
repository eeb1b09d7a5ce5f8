"""Python stacks of a worker process on request, even while its main thread hangs.

A Ray actor runs one call at a time, so a worker stuck in a call cannot answer another one. The
hang watchdog (``megatron_rl.trainer.watchdog``) therefore asks through the file system: each
worker's ``StackDumpListener`` thread watches ``<stack dir>/.request``; when the driver writes a new
dump name there, every listener writes the stacks of all its threads (``faulthandler``) to
``<stack dir>/<dump name>/<worker name>.txt``. The stack directory lives in the run directory,
which multi-node runs keep on a shared file system anyway (checkpoints go there).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import threading
import time
from pathlib import Path

__all__ = ["REQUEST_FILE", "StackDumpListener"]

REQUEST_FILE = ".request"


class StackDumpListener:
    """A daemon thread that dumps this process's stacks as ``name`` whenever ``root/.request`` changes.

    Args:
        root: the run's stack directory (``<trainer.default_local_dir>/stacks``).
        name: this worker's file name (``actor-rank0``, ``rollout`` ...).
        poll_s: how often the request file is looked at.
    """

    def __init__(self, root: str | os.PathLike, name: str, poll_s: float = 0.5):
        self.root, self.name, self.poll_s = Path(root), name, poll_s
        self._seen = self._request()  # a request written before this worker started is not for it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stack-dumps-{name}", daemon=True)
        self._thread.start()

    def _request(self) -> str:
        try:
            return (self.root / REQUEST_FILE).read_text().strip()
        except OSError:
            return ""

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            request = self._request()
            if request and request != self._seen:
                self._seen = request
                self.dump(self.root / request)

    def dump(self, directory: Path) -> Path:
        """Write the stacks of every thread of this process to ``directory/<name>.txt``."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.txt"
        tmp = directory / f".{self.name}.txt.tmp"
        with open(tmp, "w") as f:
            f.write(f"# {self.name}: pid {os.getpid()} on {socket.gethostname()} at {time.strftime('%H:%M:%S')}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        os.replace(tmp, path)  # the driver waits for the complete file
        return path

    def stop(self) -> None:
        """End the thread."""
        self._stop.set()
