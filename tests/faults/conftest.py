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
def finished_run(tmp_path_factory):
    """``(run directory, reward file, completed process, wall seconds)`` of the finished run."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    work = tmp_path_factory.mktemp("finished")
    reward = work / "reward.py"
    reward.write_text(REWARD)
    run = work / "run"
    start = time.perf_counter()
    done = subprocess.run(cli("train", "grpo", *fixture_overrides(reward), f"trainer.default_local_dir={run}"),
                          env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run, reward, done, time.perf_counter() - start


@pytest.fixture
def ray_cluster():
    """A local Ray with 2 CPUs for one test (an in-process trainer starts its workers in it)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
