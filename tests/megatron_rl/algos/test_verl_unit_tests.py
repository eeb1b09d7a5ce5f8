"""verl's own algorithm-layer unit tests, run against this project through a same-name import shim.

``verl_tests/`` holds verl's test files copied unchanged (Apache-2.0, attribution in each):
``tests/trainer/ppo/test_core_algos_on_cpu.py`` (registries used as dicts, GAE, GRPO / RLOO and their
vectorised forms), ``tests/trainer/ppo/test_rollout_corr_integration.py`` (rollout correction, an
``ActorConfig(strategy="fsdp", ...)`` handed to the policy loss) and ``test_expand_as_nested`` of
``tests/utils/test_torch_functional.py``. ``verl_shim/verl`` maps verl's module paths to the project's
objects. They run in a subprocess (they empty the registries), named so that this suite does not
collect them itself.

One failure is expected and explained: ``test_get_adv_estimator_fn_invalid_name`` matches verl's exact
wording ("Unknown advantage estimator simply: invalid_name"); the project's message names the unknown
name and lists the valid ones ("unknown advantage estimator 'invalid_name'; valid names: gae, vtrace"),
the house rule for every registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
VERL_TESTS = sorted(str(p) for p in (HERE / "verl_tests").glob("*.py"))
EXPECTED_FAILURE = "test_get_adv_estimator_fn_invalid_name"


def test_verls_algorithm_tests_pass_through_the_shim(tmp_path):
    report = tmp_path / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE / "verl_shim"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                           *VERL_TESTS], capture_output=True, text=True, timeout=300, env=env,
                          cwd=HERE.parents[2])
    cases = ET.parse(report).getroot().iter("testcase")
    outcome = {}
    for case in cases:
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        outcome[f"{case.get('classname')}.{case.get('name')}"] = (bad[0].tag, bad[0].get("message", "")) if bad else ("passed", "")
    failed = {name: o for name, o in outcome.items() if o[0] != "passed"}
    # core_algos: 9 registry tests + GAE + 2 x 3 parametrised; rollout_corr_integration: 9; expand_as_nested: 1
    assert len(outcome) == 26, (len(outcome), proc.stdout[-3000:])
    assert [name.rsplit(".", 1)[-1] for name in failed] == [EXPECTED_FAILURE], (failed, proc.stdout[-3000:])
    (message,) = [o[1] for o in failed.values()]
    assert "unknown advantage estimator 'invalid_name'; valid names: gae, vtrace" in message


def test_registry_copy_clear_update_restores_traits_and_plugins():
    """verl's tests save a registry with ``copy()``, empty it and restore it with ``update()``: the
    entries' declared needs (GAE needs values) and plugin marks come back too."""
    from megatron_rl.algos import ADV_ESTIMATOR_REGISTRY as registry
    from megatron_rl.algos.registry import estimator_needs, plugins, register_adv_est

    @register_adv_est("shim_test_plugin", needs_ref=True)
    def plugin(**kwargs):
        return None

    try:
        saved = registry.copy()
        assert isinstance(saved, dict) and saved["gae"] is registry["gae"]
        registry.clear()
        assert len(registry) == 0
        registry["gae"] = lambda **kw: "replaced"  # verl's item assignment
        assert registry["gae"]() == "replaced"
        with pytest.raises(ValueError, match="refusing to replace it"):  # a different function: refused
            registry.update(saved)
        assert registry.pop("gae")() == "replaced" and registry.pop("gae", None) is None
        registry.update(saved)
        assert dict(registry) == dict(saved)
        assert estimator_needs("gae").values and estimator_needs("shim_test_plugin").ref
        assert "shim_test_plugin" in plugins().estimators
    finally:
        registry.pop("shim_test_plugin", None)
    assert "shim_test_plugin" not in registry and "grpo" in registry


def test_expand_as_nested():
    from megatron_rl.algos import expand_as_nested
    from megatron_rl.algos.utils import NestedShapeError

    nested = torch.nested.as_nested_tensor([torch.zeros(1), torch.zeros(3)], layout=torch.jagged)
    out = expand_as_nested(torch.tensor([0.5, 2.0]), nested)
    assert out.values().tolist() == [0.5, 2.0, 2.0, 2.0] and torch.equal(out.offsets(), nested.offsets())
    with pytest.raises(ValueError, match=r"the batch sizes differ: tensor has 3 rows, nested_tensor 2"):
        expand_as_nested(torch.ones(3), nested)
    assert issubclass(NestedShapeError, AssertionError)  # verl's tests expect its assert's type
