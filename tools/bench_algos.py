"""Benchmark the advantage estimators: vectorised GRPO vs verl's original per-sample loop.

The batch looks like a GRPO step: ``--num-responses`` responses in groups of ``--group-size``
(consecutive uid strings, as verl's ``repeat(interleave=True)`` lays them out), each with a random
length in ``[1, --response-length]`` and a random outcome reward in {0, .25, .5, .75, 1} on its
last valid token (dyadic values, so group means are exact in float32 for both implementations).

Timed, in one process on the same inputs, with ``--threads`` torch threads (default 1) for all:

- ``grpo``: ``megatron_rl.algos.ADV_ESTIMATORS["grpo"]`` (bincount / index_add over group ids);
- ``grpo_loop``: the loop verl's ``compute_grpo_outcome_advantage`` used (a dict of score lists
  per uid, ``torch.mean`` / ``torch.std`` per group, then per-sample normalisation), written
  out below as the reference;
- ``rloo``, ``reinforce_plus_plus`` (gamma 1), ``gae`` (gamma .99, lam .95): the registry
  entries, for scale (the last two once: their whitening and time recursion take seconds).

``grpo`` and ``grpo_loop`` take turns: one untimed warm-up call each, then ``--repeats`` rounds
of one timed call each; the figures are the medians, so a change in machine load during the
run hits both alike. ``*_cpu_ms`` / ``*_cpu_time`` are the same medians in process CPU time
(user + system), which leaves out time spent waiting for a core another process holds. They are also timed on the scores alone (``token_level_rewards`` of shape
``[bs, 1]``), which isolates the per-group statistics from the ``[bs, T]`` memory traffic (one
read of the rewards, one read of the mask, one write of the advantages) that both pay alike.

Memory. Both implementations return a fresh ``[bs, T]`` float32 advantages tensor (256 MiB at
the default size). glibc serves a block that large with a new ``mmap`` and unmaps it on free,
so every call first-touches 256 MiB of new pages, which the kernel zeroes: ~16 ms per call
with huge pages (~100 ms with 4 KiB pages) on the 2-core VM this was tuned on, the same in
both implementations and more than the vectorised statistics themselves. The comparison is
therefore made twice:

- ``grpo_ms`` / ``grpo_loop_ms`` / ``grpo_speedup_vs_loop`` (the headline): glibc keeps freed
  blocks for reuse (``mallopt``: no ``mmap`` for large blocks, no heap trimming), i.e. a caching
  allocator, which is how PyTorch's CUDA allocator hands out memory on a GPU;
- ``grpo_fresh_pages_ms`` / ``grpo_loop_fresh_pages_ms`` / ``grpo_speedup_vs_loop_fresh_pages``:
  glibc's defaults, measured first (the setting cannot be undone inside a process).

``--fresh-pages`` makes the headline use glibc's defaults too (no ``mallopt`` at all). Large CPU
tensors are allocated on transparent huge pages (PyTorch's ``THP_MEM_ALLOC_ENABLE=1``, set before
torch allocates; ``--no-thp`` keeps the default).

The run fails (exit 1) unless the loop and vectorised GRPO advantages agree to 1e-5. Progress
goes to stdout as plain lines; the LAST line is one JSON object with every figure. Peak memory
is the process's peak resident set (``ru_maxrss``).

    python tools/bench_algos.py                        # 65,536 x 1,024, groups of 16
    python tools/bench_algos.py --num-responses 4096 --response-length 256
"""

from __future__ import annotations

import os
import sys

# Must precede the first tensor allocation: PyTorch reads it once (see module docstring).
if __name__ == "__main__" and "--no-thp" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_rl.algos import ADV_ESTIMATORS
from megatron_rl.config import AlgoConfig

AGREEMENT_ATOL = 1e-5


def grpo_loop_reference(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> torch.Tensor:
    """GRPO the way verl's original implementation computes it: Python loops over samples."""
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict = defaultdict(list)
    id2mean, id2std = {}, {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            id2score[index[i]].append(scores[i])
        for uid, group in id2score.items():
            if len(group) == 1:
                id2mean[uid], id2std[uid] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                stacked = torch.stack(group)
                id2mean[uid], id2std[uid] = torch.mean(stacked), torch.std(stacked)
        for i in range(scores.shape[0]):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def make_batch(num_responses: int, group_size: int, response_length: int, seed: int) -> dict:
    """Random GRPO-like batch: outcome rewards on the last valid token, random lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response_length + 1, (num_responses,), generator=gen)
    mask = (torch.arange(response_length)[None, :] < lengths[:, None]).to(torch.float32)
    rewards = torch.zeros(num_responses, response_length)
    outcome = torch.randint(0, 5, (num_responses,), generator=gen).to(torch.float32) / 4
    rewards[torch.arange(num_responses), lengths - 1] = outcome
    num_groups = -(-num_responses // group_size)
    uids = np.array([f"uid-{k:08d}" for k in range(num_groups)], dtype=object)
    index = np.repeat(uids, group_size)[:num_responses]
    values = torch.randn(num_responses, response_length, generator=gen) * mask
    return {"token_level_rewards": rewards, "response_mask": mask, "index": index, "values": values}


def time_ms(fn, repeats: int, warmup: int = 0) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls (ms) after ``warmup`` untimed ones, and the last result."""
    for _ in range(warmup):
        fn()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def time_interleaved(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Time several functions taking turns: one untimed warm-up round, then ``repeats`` rounds
    of one timed call each.

    Returns ``(timings, last results)`` by name; a timing is ``{"ms": median wall time,
    "cpu_ms": median process CPU time (user + system, so page zeroing counts; time spent
    waiting for a busy core does not), "runs": every wall time}``, all in ms.
    """
    results = {name: fn() for name, fn in fns.items()}
    wall: dict = {name: [] for name in fns}
    cpu: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            results[name] = None  # free the previous output first, as a caller that moved on would
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            cpu[name].append((time.process_time() - start_cpu) * 1e3)
            wall[name].append((time.perf_counter() - start) * 1e3)
    timings = {
        name: {"ms": statistics.median(wall[name]), "cpu_ms": statistics.median(cpu[name]), "runs": wall[name]}
        for name in fns
    }
    return timings, results


def retain_freed_memory() -> bool:
    """Make glibc keep freed large blocks for reuse (a caching allocator): serve every block from
    the heap instead of a fresh ``mmap`` and never trim the heap. False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def compare_grpo(batch: dict, common: dict, repeats: int, label: str) -> dict:
    """Vectorised vs loop GRPO on the full batch, taking turns; exits 1 if they disagree."""
    timings, results = time_interleaved(
        {
            "grpo": lambda: ADV_ESTIMATORS["grpo"](**common)[0],
            "loop": lambda: grpo_loop_reference(batch["token_level_rewards"], batch["response_mask"], batch["index"]),
        },
        repeats,
    )
    max_diff = (results["grpo"] - results["loop"]).abs().max().item()
    if not max_diff <= AGREEMENT_ATOL:
        print(f"FAIL: vectorised and loop GRPO advantages differ by {max_diff:.3e} > {AGREEMENT_ATOL}", flush=True)
        sys.exit(1)
    vec, loop = timings["grpo"], timings["loop"]
    print(
        f"grpo, {label}: vectorised {vec['ms']:.1f} ms (runs {_fmt(vec['runs'])}), per-sample loop "
        f"{loop['ms']:.1f} ms (runs {_fmt(loop['runs'])}), speedup {loop['ms'] / vec['ms']:.1f}x "
        f"(CPU time: {vec['cpu_ms']:.1f} vs {loop['cpu_ms']:.1f} ms, {loop['cpu_ms'] / vec['cpu_ms']:.1f}x), "
        f"max |vectorised - loop| = {max_diff:.3e}",
        flush=True,
    )
    return {"vec": vec, "loop": loop, "max_diff": max_diff}


def _fmt(times: list) -> str:
    return "/".join(f"{t:.0f}" for t in times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-responses", type=int, default=65536)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--response-length", type=int, default=1024)
    p.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="timed rounds (median) of each GRPO implementation, after one warm-up round",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for every implementation (default 1: on a shared 2-core machine "
        "a second OpenMP thread makes every op wait for the busier core)",
    )
    p.add_argument("--no-thp", action="store_true", help="do not allocate on transparent huge pages")
    p.add_argument(
        "--fresh-pages",
        action="store_true",
        help="keep glibc's allocator defaults for the headline figures too (see the module docstring)",
    )
    args = p.parse_args(argv)
    for name in ("num_responses", "group_size", "response_length", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)

    print(
        f"batch: {args.num_responses} responses, groups of {args.group_size}, {args.response_length} tokens, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    batch = make_batch(args.num_responses, args.group_size, args.response_length, args.seed)
    common = {
        "token_level_rewards": batch["token_level_rewards"],
        "response_mask": batch["response_mask"],
        "index": batch["index"],
        "config": AlgoConfig(gamma=1.0, lam=1.0),
    }

    # glibc's defaults first: retaining freed memory cannot be switched off again (freed heap blocks stay).
    fresh = compare_grpo(batch, common, args.repeats, "fresh pages (glibc defaults)")

    scores = batch["token_level_rewards"].sum(dim=-1, keepdim=True)  # [bs, 1]
    scores_only = {"token_level_rewards": scores, "response_mask": torch.ones_like(scores), "index": batch["index"]}
    scores_timings, scores_results = time_interleaved(
        {
            "grpo": lambda: ADV_ESTIMATORS["grpo"](**scores_only)[0],
            "loop": lambda: grpo_loop_reference(scores, scores_only["response_mask"], batch["index"]),
        },
        args.repeats,
    )
    if not (scores_results["grpo"] - scores_results["loop"]).abs().max().item() <= AGREEMENT_ATOL:
        print("FAIL: vectorised and loop GRPO disagree on the scores alone", flush=True)
        sys.exit(1)
    print(
        f"grpo on scores alone [bs, 1]: vectorised {scores_timings['grpo']['ms']:.1f} ms, loop "
        f"{scores_timings['loop']['ms']:.1f} ms",
        flush=True,
    )

    others = {}
    # The token-level recursions take seconds at full size: timed once.
    for name, extra, repeats, warmup in (
        ("rloo", {}, args.repeats, 1),
        ("reinforce_plus_plus", {}, 1, 0),
        ("gae", {"values": batch["values"], "gamma": 0.99, "lam": 0.95}, 1, 0),
    ):
        others[name], (adv, _) = time_ms(lambda: ADV_ESTIMATORS[name](**common, **extra), repeats, warmup)
        if not bool(torch.isfinite(adv).all()):
            print(f"FAIL: {name} produced non-finite advantages", flush=True)
            sys.exit(1)
        print(f"{name}: {others[name]:.1f} ms", flush=True)

    retained = False if args.fresh_pages else retain_freed_memory()
    headline = (
        compare_grpo(batch, common, args.repeats, "freed memory reused (caching allocator)") if retained else fresh
    )

    result = {
        "num_responses": args.num_responses,
        "group_size": args.group_size,
        "response_length": args.response_length,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "allocator": "glibc, freed memory reused" if retained else "glibc defaults (fresh pages)",
        "grpo_ms": round(headline["vec"]["ms"], 3),
        "grpo_loop_ms": round(headline["loop"]["ms"], 3),
        "grpo_speedup_vs_loop": round(headline["loop"]["ms"] / headline["vec"]["ms"], 2),
        "grpo_max_abs_diff_vs_loop": max(headline["max_diff"], fresh["max_diff"]),
        "grpo_cpu_ms": round(headline["vec"]["cpu_ms"], 3),
        "grpo_loop_cpu_ms": round(headline["loop"]["cpu_ms"], 3),
        "grpo_speedup_vs_loop_cpu_time": round(headline["loop"]["cpu_ms"] / headline["vec"]["cpu_ms"], 2),
        "grpo_fresh_pages_ms": round(fresh["vec"]["ms"], 3),
        "grpo_loop_fresh_pages_ms": round(fresh["loop"]["ms"], 3),
        "grpo_speedup_vs_loop_fresh_pages": round(fresh["loop"]["ms"] / fresh["vec"]["ms"], 2),
        "grpo_speedup_vs_loop_fresh_pages_cpu_time": round(fresh["loop"]["cpu_ms"] / fresh["vec"]["cpu_ms"], 2),
        "grpo_scores_only_ms": round(scores_timings["grpo"]["ms"], 3),
        "grpo_loop_scores_only_ms": round(scores_timings["loop"]["ms"], 3),
        "grpo_scores_only_speedup_vs_loop": round(scores_timings["loop"]["ms"] / scores_timings["grpo"]["ms"], 1),
        **{f"{name}_ms": round(ms, 3) for name, ms in others.items()},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
        "torch": torch.__version__,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
