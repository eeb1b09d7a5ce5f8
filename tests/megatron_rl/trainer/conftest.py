"""Shared fixtures of the trainer tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray with 2 CPUs for one test module (trainers start their workers in it)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
