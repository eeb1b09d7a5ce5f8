"""The vendored verl tests that need a verl-only helper are skipped here, by node id, with the reason.

The ``test_*.py`` files here are verl's (Copyright Bytedance Ltd. and/or its affiliates), taken from the
PyPI wheel verl 0.9.1 (``pip install --no-deps verl==0.9.1``; the wheel ships ``tests/trainer/``) and, for
``test_torch_functional.py``, which the wheel lacks, from the verl repository at commit b178a3cd; each is
unchanged but for a provenance note under its licence header. verl's Apache License 2.0 is ``LICENSE``.

Loaded only by the subprocess of ``../test_verl_tests_through_shim.py`` (which passes ``--confcutdir`` here);
the project's own suite ignores this directory (``../conftest.py``). A prefix ending in ``::`` covers a
whole test class; a test's id covers its parametrised cases.

verl's ``TestRegisterAdvEst`` empties the advantage registry in ``tearDown`` and never refills it. In verl
that goes unnoticed by later files because verl's ``compute_advantage`` calls GAE and GRPO directly, not
through the registry; here every estimator goes through the registry, so each vendored file gets the
registries back as they were before it ran.
"""

import pytest

from megatron_rl.algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

SKIPS: dict[str, str] = {
    "test_torch_functional.py::test_distributed_mean_max_min_std":
        "spawns NCCL ranks, one GPU each, through verl's device helpers and verl's distributed_mean_max_min_std; "
        "the project has no cross-rank metric reduction of that kind",
    "test_torch_functional.py::test_distributed_masked_mean":
        "spawns NCCL ranks, one GPU each, through verl's device helpers and verl's distributed_masked_mean; "
        "the project's losses take the global token counts instead (megatron_rl.algos.global_batch_info)",
    "test_metric_utils_on_cpu.py::TestReduceMetrics::":
        "verl's reduce_metrics over lists of values (verl.utils.metric); the project reduces typed "
        "LossMetrics collectively (megatron_rl.engine.step_info.reduce_metrics)",
    "test_metric_utils_on_cpu.py::TestMetric::":
        "verl's Metric / AggregationType container (verl.utils.metric); the project has LossMetrics "
        "(sums / weighted / minima / maxima) instead",
    "test_metric_utils_on_cpu.py::TestBootstrapMetric::":
        "verl's bootstrapped best@n / worst@n validation statistics; the project's Validator reports mean@n only",
    "test_metric_utils_on_cpu.py::TestCalcMajVal::":
        "verl's majority-vote (maj@n) validation metric; not built here",
    "test_metric_utils_on_cpu.py::TestProcessValidationMetrics::":
        "verl's best@n / maj@n / std@n validation table; the project's Validator reports "
        "val-core/<source>/reward/mean@n only",
    "test_metric_utils_on_cpu.py::TestComputeTimingMetrics::test_compute_timing_metrics_zero_tokens":
        "patches verl's private _compute_response_info to claim 0 tokens for a batch whose masks hold 12; "
        "the project reads the lengths from the masks (its zero-token case: "
        "tests/verl_compat/test_verl_tests_through_shim.py::test_timing_metrics_with_no_tokens_are_zero)",
    "test_value_loss_normalization_on_cpu.py::test_vf_loss_metric_sum_aggregation_reports_global_mean":
        "reduces critic/vf_loss through verl's Metric(aggregation=SUM) / append_to_dict / reduce_metrics; "
        "the project's critic reports the loss as a LossMetrics 'sums' entry (the same global mean)",
}


def skip_reason(nodeid: str):
    """The reason ``nodeid`` is skipped, or None."""
    for prefix, reason in SKIPS.items():
        if nodeid == prefix or nodeid.startswith(prefix + "[") or (prefix.endswith("::") and nodeid.startswith(prefix)):
            return reason
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = skip_reason(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"verl-only: {reason}"))


@pytest.fixture(autouse=True, scope="module")
def _registries_restored_after_each_file():
    saved = [(registry, registry.copy()) for registry in (ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY)]
    yield
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)
