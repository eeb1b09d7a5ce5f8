"""The finished run every fault case must leave untouched (``finished_run``, once per session).

The toy GRPO recipe shrunk to 2 steps (an SFT warm-up of 2 steps, a checkpoint after every step,
validation before training and at the last step), run by ``megatron-rl train`` as a user runs it,
with its progress bar, on a custom reward whose secondary key ``acc`` is NaN for some samples.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.faults.runs import REWARD, cli, env, fixture_overrides


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, ray_session):
    """``(run directory, reward file, completed process, wall seconds)`` of the finished run; it joins the
    session's Ray (``RAY_ADDRESS``): nothing of it depends on Ray's start or on its workers' environment."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    work = tmp_path_factory.mktemp("finished")
    reward = work / "reward.py"
    reward.write_text(REWARD)
    run = work / "run"
    start = time.perf_counter()
    done = subprocess.run(
        cli("train", "grpo", *fixture_overrides(reward), f"trainer.default_local_dir={run}"),
        env=ray_session.env(env()),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run, reward, done, time.perf_counter() - start


@pytest.fixture
def ray_cluster(ray_session):
    """One test's Ray job on the session's shared cluster (an in-process trainer starts its workers in it)."""
    from tests.ray_session import joined

    with joined(ray_session.address):
        yield
