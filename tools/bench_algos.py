"""Benchmark the advantage estimators: vectorised GRPO vs verl's original per-sample loop.

The batch looks like a GRPO step: ``--num-responses`` responses in groups of ``--group-size``
(consecutive uid strings, as verl's ``repeat(interleave=True)`` lays them out), each with a random
length in ``[1, --response-length]`` and a random outcome reward in {0, .25, .5, .75, 1} on its
last valid token (dyadic values, so group means are exact in float32 for both implementations).

Timed, in one process on the same inputs:

- ``grpo``: ``megatron_rl.algos.ADV_ESTIMATORS["grpo"]`` (bincount / index_add over group ids);
- ``grpo_loop``: the loop verl's ``compute_grpo_outcome_advantage`` used (a dict of score lists
  per uid, ``torch.mean`` / ``torch.std`` per group, then per-sample normalisation), written
  out below as the reference;
- ``rloo``, ``reinforce_plus_plus`` (gamma 1), ``gae`` (gamma .99, lam .95): the registry
  entries, for scale (the last two once: their whitening and time recursion take seconds).

``grpo`` and ``grpo_loop`` are also timed on the scores alone (``token_level_rewards`` of shape
``[bs, 1]``), which isolates the per-group statistics from the ``[bs, T]`` memory traffic (one
read of the rewards, one write of the advantages) that both implementations pay alike.

The run fails (exit 1) unless the loop and vectorised GRPO advantages agree to 1e-5. Progress
goes to stdout as plain lines; the LAST line is one JSON object with every figure. Peak memory
is the process's peak resident set (``ru_maxrss``).

Large CPU tensors are allocated on transparent huge pages (PyTorch's ``THP_MEM_ALLOC_ENABLE=1``,
set before torch allocates; ``--no-thp`` keeps the default). In a VM where a page fault is
expensive, first-touching a fresh 256 MiB output costs ~300 ms with 4 KiB pages, in both
implementations alike; huge pages make that ~5x cheaper, closer to a caching (GPU) allocator.

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


def grpo_loop_reference(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                        epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True) -> torch.Tensor:
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-responses", type=int, default=65536)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--response-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per vectorised estimator (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine a second OpenMP thread "
                        "makes every small op wait for the scheduler)")
    p.add_argument("--no-thp", action="store_true", help="do not allocate on transparent huge pages")
    args = p.parse_args(argv)
    for name in ("num_responses", "group_size", "response_length", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)

    print(f"batch: {args.num_responses} responses, groups of {args.group_size}, {args.response_length} tokens, "
          f"{torch.get_num_threads()} threads", flush=True)
    batch = make_batch(args.num_responses, args.group_size, args.response_length, args.seed)
    common = {"token_level_rewards": batch["token_level_rewards"], "response_mask": batch["response_mask"],
              "index": batch["index"], "config": AlgoConfig(gamma=1.0, lam=1.0)}

    grpo_ms, (grpo_adv, _) = time_ms(lambda: ADV_ESTIMATORS["grpo"](**common), args.repeats, warmup=1)
    print(f"grpo (vectorised): {grpo_ms:.1f} ms", flush=True)
    start = time.perf_counter()
    loop_adv = grpo_loop_reference(batch["token_level_rewards"], batch["response_mask"], batch["index"])
    loop_ms = (time.perf_counter() - start) * 1e3
    print(f"grpo (per-sample loop reference): {loop_ms:.1f} ms", flush=True)
    max_diff = (grpo_adv - loop_adv).abs().max().item()
    if not max_diff <= AGREEMENT_ATOL:
        print(f"FAIL: vectorised and loop GRPO advantages differ by {max_diff:.3e} > {AGREEMENT_ATOL}", flush=True)
        sys.exit(1)
    print(f"grpo agreement: max |vectorised - loop| = {max_diff:.3e}", flush=True)

    scores = batch["token_level_rewards"].sum(dim=-1, keepdim=True)  # [bs, 1]
    scores_only = {"token_level_rewards": scores, "response_mask": torch.ones_like(scores)}
    scores_ms, (scores_adv, _) = time_ms(
        lambda: ADV_ESTIMATORS["grpo"](**scores_only, index=batch["index"]), args.repeats, warmup=1)
    start = time.perf_counter()
    scores_loop_adv = grpo_loop_reference(scores_only["token_level_rewards"], scores_only["response_mask"],
                                          batch["index"])
    scores_loop_ms = (time.perf_counter() - start) * 1e3
    if not (scores_adv - scores_loop_adv).abs().max().item() <= AGREEMENT_ATOL:
        print("FAIL: vectorised and loop GRPO disagree on the scores alone", flush=True)
        sys.exit(1)
    print(f"grpo on scores alone [bs, 1]: vectorised {scores_ms:.1f} ms, loop {scores_loop_ms:.1f} ms", flush=True)

    others = {}
    # The token-level recursions take seconds at full size: timed once.
    for name, extra, repeats, warmup in (("rloo", {}, args.repeats, 1), ("reinforce_plus_plus", {}, 1, 0),
                                         ("gae", {"values": batch["values"], "gamma": 0.99, "lam": 0.95}, 1, 0)):
        others[name], (adv, _) = time_ms(lambda: ADV_ESTIMATORS[name](**common, **extra), repeats, warmup)
        if not bool(torch.isfinite(adv).all()):
            print(f"FAIL: {name} produced non-finite advantages", flush=True)
            sys.exit(1)
        print(f"{name}: {others[name]:.1f} ms", flush=True)

    result = {
        "num_responses": args.num_responses,
        "group_size": args.group_size,
        "response_length": args.response_length,
        "threads": torch.get_num_threads(),
        "grpo_ms": round(grpo_ms, 3),
        "grpo_loop_ms": round(loop_ms, 3),
        "grpo_speedup_vs_loop": round(loop_ms / grpo_ms, 2),
        "grpo_max_abs_diff_vs_loop": max_diff,
        "grpo_scores_only_ms": round(scores_ms, 3),
        "grpo_loop_scores_only_ms": round(scores_loop_ms, 3),
        "grpo_scores_only_speedup_vs_loop": round(scores_loop_ms / scores_ms, 1),
        **{f"{name}_ms": round(ms, 3) for name, ms in others.items()},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
        "torch": torch.__version__,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
