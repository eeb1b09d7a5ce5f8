"""One Ray cluster for the whole test session: tests that only need *a* Ray join it instead of starting one.

Starting Ray costs ~18 s on a quiet 2-core machine (11 s of it the raylet waiting for Ray's dashboard
agent); joining a running one costs ~0.4 s. The cluster is started lazily by the first test that asks
for it (``ray_session`` in tests/conftest.py), by a helper process (``python -m tests.ray_session``)
that holds it until the test session closes its stdin, so it also goes away when pytest itself dies.

Isolation, and who may therefore join:

* The workers of a shared raylet inherit the *helper's* environment (the test session's at its start),
  not the joining driver's: a test whose workers must see an environment variable it sets keeps its own
  cluster (``test_every_key_is_read``'s read tracking), as do tests about Ray's own start and stop, the
  reaper, signals to the driver, or the cluster's size.
* Each joining driver is its own Ray job: its actors and placement groups go when it disconnects (or
  dies). ``joined`` waits until the cluster's CPUs are all free again before a test uses it, so a
  previous test's dying actors cannot starve the next one's placement group.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
NUM_CPUS = 2
"""Logical CPUs of the shared cluster: what each test's own 2-CPU cluster offered before."""
_MARK = "session Ray at "
AUTH_MODE = "RAY_AUTH_MODE"
"""Ray 2.60 starts a local cluster with token authentication (the token in ~/.ray/auth_token) but a driver
that joins an explicit address only sends the token when this is ``token``."""
IDLE_TIMEOUT_S = 120.0
"""How long ``joined`` waits for a previous job's actors to be gone (seconds; they go within a few)."""


def _serve(num_cpus: int) -> None:
    """The helper process: start a Ray head as `megatron-rl train` does, print its address, hold it until
    stdin closes."""
    import ray

    from parallel.netbind import ray_on_loopback

    with ray_on_loopback():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",
        )
    print(_MARK + ray.get_runtime_context().gcs_address, flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe from here on
    sys.stdin.read()  # EOF: the test session ended (or died)
    ray.shutdown()


class SessionRay:
    """The session's shared cluster; ``address`` starts it on first use."""

    def __init__(self, env: dict[str, str]):
        self._env = dict(env)
        self._env.pop("RAY_ADDRESS", None)
        self._env[AUTH_MODE] = "token"
        self._proc: Optional[subprocess.Popen] = None
        self._address: Optional[str] = None
        self.start_s: Optional[float] = None

    @property
    def address(self) -> str:
        if self._address is None:
            start = time.perf_counter()
            # Its own session: a Ctrl-C to pytest's process group does not take the cluster down under
            # a test's teardown; pytest's end (or death) closes stdin and the helper shuts Ray down.
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.ray_session", str(NUM_CPUS)],
                cwd=ROOT,
                env=self._env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for line in self._proc.stdout:
                if line.startswith(_MARK):
                    self._address = line[len(_MARK) :].strip()
                    break
            else:
                rc = self._proc.wait(timeout=60)
                raise RuntimeError(f"the session's Ray cluster did not start (helper exit code {rc})")
            self.start_s = time.perf_counter() - start
        return self._address

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with ``RAY_ADDRESS`` set: a ``megatron-rl train`` subprocess joins this cluster.
        Waits until the cluster is idle first (see ``joined``) unless this process is a driver already."""
        import ray

        if not ray.is_initialized():
            with joined(self.address):
                pass
        return dict(base, RAY_ADDRESS=self.address, **{AUTH_MODE: "token"})

    def close(self) -> None:
        if self._proc is None:
            return
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, 9)
            self._proc.wait(timeout=30)
        self._proc = None


def _wait_idle(timeout_s: float = IDLE_TIMEOUT_S) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        total, free = ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0)
        if free >= total > 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the session's Ray cluster still has {total - free:g} of {total:g} CPUs in use "
                f"{timeout_s:g} s after the previous job: a test left actors or placement groups"
            )
        time.sleep(0.2)


@contextlib.contextmanager
def _auth_mode_token() -> Iterator[None]:
    """``RAY_AUTH_MODE=token`` in this process for the block, then as it was. Ray caches its config in
    the C++ core, so it is re-read (as Ray's own ``_enable_token_auth`` does) on the way in and out."""
    from ray._raylet import Config

    previous = os.environ.get(AUTH_MODE)
    os.environ[AUTH_MODE] = "token"
    Config.initialize("")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(AUTH_MODE)
        else:
            os.environ[AUTH_MODE] = previous
        Config.initialize("")


@contextlib.contextmanager
def joined(address: str) -> Iterator[None]:
    """This process is a driver of the cluster at ``address`` (its own job) until the block ends; the
    cluster has all its CPUs free when the block starts."""
    import ray

    from parallel.netbind import joining_ray

    with _auth_mode_token(), joining_ray(address):
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        try:
            _wait_idle()
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def joined_by_run_train(address: str) -> Iterator[None]:
    """An in-process ``run_train`` in the block joins the cluster at ``address`` (``RAY_ADDRESS``, as a
    ``ray job submit`` driver does); it leaves a joined cluster connected, so the block disconnects."""
    import ray

    with joined(address):
        pass  # the cluster is idle
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        with _auth_mode_token():
            try:
                yield
            finally:
                ray.shutdown()
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS")
        else:
            os.environ["RAY_ADDRESS"] = previous


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
