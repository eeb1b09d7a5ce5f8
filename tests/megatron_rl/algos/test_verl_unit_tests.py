"""The registry and helper behaviour verl's own tests rely on (they run, vendored from verl 0.9.1,
through the same-name shim of ``tests/verl_compat/``, which replaced this directory's older copy of
three of them): a registry saved with ``copy()``, emptied and restored keeps its entries' traits, and
``expand_as_nested`` raises with verl's exception type.
"""

from __future__ import annotations

import pytest
import torch


def test_registry_copy_clear_update_restores_traits_and_plugins():
    """verl's tests save a registry with ``copy()``, empty it and restore it with ``update()``: the
    entries' declared needs (GAE needs values) and plugin marks come back too."""
    from megatron_rl.algos import ADV_ESTIMATOR_REGISTRY as registry
    from megatron_rl.algos.algo_registry import estimator_needs, plugins, register_adv_est

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
