"""Names verl's tests import that the project has no counterpart for (verl-only helpers).

Each is importable, so that a vendored test file imports unchanged, and raises if called: the tests that
use one are skipped by name, with the reason, in ``tests/verl_compat/verl_tests/conftest.py``.
"""

VERL_ONLY: dict[str, str] = {
    "Metric": "verl's metric container (verl.utils.metric); the project reduces typed LossMetrics "
    "(megatron_rl.engine.step_info) over micro-batches and DP ranks instead",
    "AggregationType": "verl's metric container (verl.utils.metric)",
    "reduce_metrics": "verl's list-of-values metric reduction (verl.utils.metric); the project's "
    "megatron_rl.engine.step_info.reduce_metrics reduces LossMetrics collectively",
    "append_to_dict": "verl's dict-of-lists helper (verl.utils.py_functional)",
    "bootstrap_metric": "verl's bootstrapped best@n / worst@n validation statistics; the project's Validator "
    "reports mean@n only",
    "calc_maj_val": "verl's majority-vote validation metric (maj@n); not built here",
    "process_validation_metrics": "verl's best@n / maj@n / std@n validation table; the project's Validator "
    "reports val-core/<source>/reward/mean@n only",
    "distributed_masked_mean": "verl's NCCL masked mean across ranks; the project's losses take the global "
    "token counts (megatron_rl.algos.global_batch_info) instead",
    "distributed_mean_max_min_std": "verl's NCCL mean / max / min / std across ranks; not built here",
    "get_device_name": "verl's device abstraction (verl.utils.device)",
    "get_nccl_backend": "verl's device abstraction (verl.utils.device)",
    "get_torch_device": "verl's device abstraction (verl.utils.device)",
    "_compute_response_info": "verl's private length helper; the project reads the lengths from the masks",
}


def verl_only(name: str):
    """A stand-in for verl's ``name`` that raises ``NotImplementedError`` with the reason."""

    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"{name} is verl-only: {VERL_ONLY[name]}")

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in
