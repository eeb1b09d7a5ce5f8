"""The CPU row's host-work measurements run the real stack: ``megatron_host_overheads`` times an actor's
passes of one-row micro-batches in a process group of one, ``call_overhead`` a log-prob through the
trainer's own ``MegatronWorkerGroup`` on Ray. (Their figures are the machine's: ``tools/bench_phase_share.py``
reports them; here only what holds on any host.)"""

from __future__ import annotations

import math

from parallel.testing import run_distributed
from tests.megatron_rl.planner.test_activation_traffic import toy_model


def _overheads(rank: int, world: int) -> dict:
    from megatron_rl.planner.cpu_row import megatron_host_overheads

    return megatron_host_overheads(toy_model(), repeats=3)


def test_megatron_host_overheads_time_real_passes():
    out = run_distributed(_overheads, 1, timeout_s=300)[0]
    passes = out["passes_s"]
    assert set(passes) == {"one_f", "four_f", "one_t", "four_one_step", "four_steps"}
    # four micro-batches cost more than one, forward and update alike: each micro-batch has host work
    assert passes["four_f"] > passes["one_f"] > 0 and passes["four_one_step"] > passes["one_t"] > 0
    assert out["forward_micro_overhead_s"] > 0 and out["train_micro_overhead_s"] > 0
    assert all(math.isfinite(v) and 0 <= v < 1.0 for k, v in out.items() if k.endswith("_overhead_s"))


def test_call_overhead_times_a_log_prob_through_the_worker_group(ray_cluster):
    from megatron_rl.planner.cpu_row import call_overhead

    assert 0 < call_overhead(toy_model(), repeats=3) < 5.0
