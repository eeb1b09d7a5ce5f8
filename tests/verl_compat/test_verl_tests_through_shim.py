"""verl 0.9.1's own algorithm-layer unit tests, run against this project through a same-name import shim.

``verl_tests/`` holds ten of verl's test files, unchanged but for a provenance note under their Apache-2.0
header: nine from the verl 0.9.1 wheel (``tests/trainer/ppo/``: core_algos, dynamic_policy_losses,
loss_aggregation, reinforce_pp_multiturn, rollout_corr, rollout_corr_integration, value_loss_normalization,
metric_utils; ``tests/trainer/``: multi_trajectories_advantage) and ``tests/utils/test_torch_functional.py``
from the verl repository (the wheel lacks it). ``verl_shim/verl`` gives verl's module paths, each
name being the project's own object or a thin adapter over it (a ``DataProto`` in, tensors to the
project's function); ``test_every_name_verl_imports_is_the_projects`` checks that. The files run in a
pytest subprocess (they empty the registries; the shim must not be importable by the rest of the suite).

Expected: 100 pass, 39 skipped (verl-only helpers, listed with reasons in ``verl_tests/conftest.py``:
verl's ``Metric`` container and its list reduction, best@n / maj@n validation statistics, NCCL-spawning
distributed reductions, and one test that patches a private verl helper), and one failure:

``test_get_adv_estimator_fn_invalid_name`` asserts verl's exact wording ("Unknown advantage estimator
simply: invalid_name"); the project's registries name the unknown name and list the valid ones ("unknown
advantage estimator 'invalid_name'; valid names: gae, vtrace"), the house rule for every registry. The
exception type (``ValueError``) is verl's, so code that catches it is unaffected.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
VERL_TESTS = HERE / "verl_tests"
SHIM = HERE / "verl_shim"
EXPECTED_FAILURE = "test_core_algos_on_cpu.TestRegisterAdvEst.test_get_adv_estimator_fn_invalid_name"
NUM_PASSED, NUM_SKIPPED = 100, 39


def _run_vendored_tests(tmp_path: Path) -> tuple[dict[str, tuple[str, str]], str]:
    """``{classname.name: (outcome, message)}`` of every vendored test, and pytest's output."""
    report = tmp_path / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--rootdir={VERL_TESTS}",
            f"--confcutdir={VERL_TESTS}",
            "-o",
            "addopts=",
            f"--junitxml={report}",
            str(VERL_TESTS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=VERL_TESTS,
    )
    outcome = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        outcome[f"{case.get('classname')}.{case.get('name')}"] = (
            (bad[0].tag, bad[0].get("message", "")) if bad else ("passed", "")
        )
    return outcome, proc.stdout[-4000:]


def test_verls_algorithm_tests_pass_through_the_shim(tmp_path):
    outcome, output = _run_vendored_tests(tmp_path)
    by_kind: dict[str, list[str]] = {}
    for name, (kind, _) in outcome.items():
        by_kind.setdefault(kind, []).append(name)
    assert by_kind.get("failure", []) == [EXPECTED_FAILURE], (by_kind.get("failure"), output)
    assert "error" not in by_kind, (by_kind["error"], output)
    assert len(by_kind["passed"]) == NUM_PASSED, output
    assert len(by_kind["skipped"]) == NUM_SKIPPED, by_kind["skipped"]
    assert all(outcome[name][1].startswith("verl-only: ") for name in by_kind["skipped"])
    message = outcome[EXPECTED_FAILURE][1]
    assert "unknown advantage estimator 'invalid_name'; valid names: gae, vtrace" in message, message


# Names the shim wraps (verl's signature over the project's function) rather than re-exports.
ADAPTERS = {
    ("verl.workers.config.actor", "ActorConfig"): "megatron_rl.config.ActorConfig",
    ("verl.trainer.ppo.v1.utils", "compute_advantage"): "megatron_rl.algos.get_adv_estimator_fn",
    (
        "verl.trainer.ppo.v1.utils",
        "compute_advantage_for_multi_trajectories",
    ): "megatron_rl.algos.compute_advantage_for_multi_trajectories",
    ("verl.trainer.ppo.metric_utils", "compute_data_metrics"): "megatron_rl.trainer.metrics.compute_data_metrics",
    ("verl.trainer.ppo.metric_utils", "compute_timing_metrics"): "megatron_rl.trainer.metrics.compute_timing_metrics",
    (
        "verl.trainer.ppo.metric_utils",
        "compute_throughout_metrics",
    ): "megatron_rl.trainer.metrics.compute_throughput_metrics",
}
PROJECT_MODULES = ("megatron_rl.algos", "megatron_rl.config", "megatron_rl.data.batch")


def _imported_verl_names() -> set[tuple[str, str]]:
    names = set()
    for path in VERL_TESTS.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl"):
                names.update((node.module, alias.name) for alias in node.names)
    return names


@pytest.fixture
def shim_on_path():
    sys.path.insert(0, str(SHIM))
    try:
        yield
    finally:
        sys.path.remove(str(SHIM))
        for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[name]


def test_every_name_verl_imports_is_the_projects(shim_on_path):
    """Each name the vendored tests import is the project's own object, a listed adapter over a project
    function, or a verl-only stand-in (which raises, and whose tests are skipped): nothing re-implemented."""
    from verl._verl_only import VERL_ONLY

    names = _imported_verl_names()
    assert len(names) > 30, names
    projects = [importlib.import_module(m) for m in PROJECT_MODULES]
    for module, name in sorted(names):
        obj = getattr(importlib.import_module(module), name)
        if (module, name) in ADAPTERS:
            target_module, target = ADAPTERS[(module, name)].rsplit(".", 1)
            assert getattr(importlib.import_module(target_module), target) is not obj
            continue
        if name in VERL_ONLY:
            with pytest.raises(NotImplementedError, match="is verl-only"):
                obj()
            continue
        assert any(getattr(p, name, None) is obj for p in projects), f"{module}.{name} is not the project's"


def test_timing_metrics_with_no_tokens_are_zero():
    """The case verl's skipped ``test_compute_timing_metrics_zero_tokens`` means, with masks that hold no
    token: per-token timings are 0.0 (not a division by zero), the raw timings are kept."""
    from megatron_rl.trainer.metrics import compute_timing_metrics

    batch = {"responses": torch.zeros(2, 3), "attention_mask": torch.zeros(2, 6), "response_mask": torch.zeros(2, 3)}
    metrics = compute_timing_metrics(batch, {"gen": 0.5, "ref": 0.3, "values": 0.2})
    assert [metrics[f"timing_per_token_ms/{k}"] for k in ("gen", "ref", "values")] == [0.0, 0.0, 0.0]
    assert metrics["timing_s/gen"] == 0.5


def test_a_boolean_threshold_is_refused_in_verls_words():
    """verl refuses ``rollout_is_threshold=True`` (bool is an int) with "not a boolean"; so does the project."""
    from megatron_rl.algos.rollout_correction_core import parse_rollout_is_threshold

    with pytest.raises(TypeError, match=r"rollout_is_threshold=True must be a number .*, not a boolean"):
        parse_rollout_is_threshold(True)
    with pytest.raises(TypeError, match=r"not list"):
        parse_rollout_is_threshold([2.0])
