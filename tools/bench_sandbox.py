"""Per-call overhead of the code sandbox: ``run_python("print(1)")`` against a plain subprocess.

In one run, alternating call by call so that a change in machine load hits both alike:

- ``plain``: ``subprocess.run([sys.executable, "-I", "-c", "print(1)"], capture_output=True)``;
- ``sandbox``: ``megatron_rl.rollout.tools.sandbox.run_python("print(1)")`` with the default limits
  (namespaces as ``isolation()`` found them on this machine).

Prints the median and p99 wall time of each in milliseconds and the sandbox's overhead
(median minus median). One untimed warm-up call each first (the isolation probe runs then).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from megatron_rl.rollout.tools.sandbox import isolation, run_python


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def main() -> None:
    """Time ``--repeats`` calls of each and print median / p99 in ms."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    def plain():
        subprocess.run([sys.executable, "-I", "-c", "print(1)"], capture_output=True, check=True)

    def sandbox():
        res = run_python("print(1)")
        if res.stdout != "1\n":
            raise RuntimeError(f"sandbox returned {res.status}: {res.stderr[:200]}")

    calls = {"plain": plain, "sandbox": sandbox}
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"isolation: {isolation()}")
    for name, values in times.items():
        print(f"{name:8s} median {statistics.median(values):7.1f} ms   p99 {_p99(values):7.1f} ms   (n={len(values)})")
    print(f"overhead median {statistics.median(times['sandbox']) - statistics.median(times['plain']):7.1f} ms")


if __name__ == "__main__":
    main()
