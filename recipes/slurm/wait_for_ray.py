#!/usr/bin/env python3
"""Wait until every SLURM node of a job has joined its Ray cluster, or fail naming the missing ones.

Used by ``recipes/slurm/ray_cluster.sh``; runs on the head node with the job's Python (the one
Ray is installed in)::

    python wait_for_ray.py --address 10.0.0.1:6379 --timeout 300 --nodes node01 node02 \
        [--launcher node02=12345 ...] [--log-dir logs/<jobid>]

Each node's ``ray start`` is given the custom resource ``slurm_node:<name>`` (1 unit), so a
joined node is recognised by its SLURM name, whatever its hostname or IP looks like. It polls
``ray.nodes()`` (``ray status`` is not used: it fails under Ray's token authentication unless the
token is configured for the CLI as well). ``--launcher NODE=PID`` names the local process that
started a node's ``ray start`` (an ``srun``); when it has exited before its node joined, the node
can no longer join and the wait fails at once instead of at the deadline.

Exit status: 0 all joined; 3 a node is missing (deadline passed or its launcher exited);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import Counter

RESOURCE_PREFIX = "slurm_node:"
EXIT_MISSING = 3


def _log(msg: str) -> None:
    print(f"[wait_for_ray {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie -- exited, not yet reaped by its parent -- counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _gcs_reachable(address: str) -> bool:
    """A cheap TCP check of ``host:port`` before the (slow to fail) ``ray.init``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except OSError:
        return False


def joined_nodes(nodes: list[dict]) -> Counter:
    """How many alive Ray nodes carry each SLURM name in ``ray.nodes()`` output (their
    ``slurm_node:<name>`` resource). Counted, not a set: a name listed twice (two Ray nodes on one
    SLURM node, as in the single-machine test) needs two nodes."""
    names: Counter = Counter()
    for node in nodes:
        if not node.get("Alive"):
            continue
        for key in node.get("Resources", {}):
            if key.startswith(RESOURCE_PREFIX):
                names[key[len(RESOURCE_PREFIX) :]] += 1
    return names


def missing_nodes(expected: list[str], joined: Counter) -> list[str]:
    """The entries of ``expected`` (in order) not yet covered by ``joined``."""
    left = Counter(joined)
    missing = []
    for name in expected:
        if left[name] > 0:
            left[name] -= 1
        else:
            missing.append(name)
    return missing


def _log_hint(log_dir: str | None, node: str, head: str) -> str:
    if not log_dir:
        return ""
    role = "head" if node == head else "worker"
    return f" (log: {os.path.join(log_dir, f'ray-{role}-{node}.log')})"


def _print_log_tail(log_dir: str | None, node: str, head: str, lines: int = 5) -> None:
    if not log_dir:
        return
    path = os.path.join(log_dir, f"ray-{'head' if node == head else 'worker'}-{node}.log")
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError:
        return
    for line in tail:
        _log(f"  {node}: {line}")


def wait_for_nodes(
    address: str,
    expected: list[str],
    timeout_s: float,
    launchers: dict[str, list[int]],
    log_dir: str | None = None,
    poll_s: float = 1.0,
) -> int:
    """Poll the cluster at ``address`` until all ``expected`` SLURM nodes are alive; return the exit status."""
    import ray

    start = time.monotonic()
    deadline = start + timeout_s
    head = expected[0]
    connected = False
    missing = list(expected)
    last_report = -1.0
    while True:
        now = time.monotonic()
        if not connected and _gcs_reachable(address):
            try:
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
                connected = True
            except Exception as err:  # GCS listening but not ready yet: retry until the deadline
                _log(f"connecting to {address}: {type(err).__name__}: {err}")
        if connected:
            missing = missing_nodes(expected, joined_nodes(ray.nodes()))
            if not missing:
                _log(
                    f"all {len(expected)} node(s) joined the Ray cluster at {address} in "
                    f"{time.monotonic() - start:.1f}s: "
                    f"{' '.join(expected)}"
                )
                ray.shutdown()
                return 0
        dead = sorted({n for n in missing if any(not _pid_alive(pid) for pid in launchers.get(n, ()))})
        if dead:
            _log(
                f"ERROR: the Ray start step for node(s) {', '.join(dead)} exited before joining the cluster at "
                f"{address}; missing {len(missing)} of {len(expected)} node(s): "
                + ", ".join(n + _log_hint(log_dir, n, head) for n in missing)
            )
            for n in dead:
                _print_log_tail(log_dir, n, head)
            break
        if now >= deadline:
            what = (
                f"the Ray head at {address} did not answer"
                if not connected
                else f"{len(missing)} of {len(expected)} node(s) did not join the Ray cluster at {address}"
            )
            _log(
                f"ERROR: {what} within {timeout_s:g}s (RAY_JOIN_TIMEOUT_S); missing "
                + ", ".join(n + _log_hint(log_dir, n, head) for n in missing)
            )
            break
        if now - last_report >= 10.0:
            _log(f"waiting for {len(missing)} of {len(expected)} node(s): {' '.join(missing)}")
            last_report = now
        time.sleep(poll_s)
    if connected:
        ray.shutdown()
    return EXIT_MISSING


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="host:port of the Ray head (GCS)")
    p.add_argument("--nodes", nargs="+", required=True, help="SLURM node names expected (first = head)")
    p.add_argument("--timeout", type=float, required=True, help="seconds to wait for all nodes")
    p.add_argument(
        "--launcher",
        action="append",
        default=[],
        metavar="NODE=PID",
        help="local PID of the process that starts NODE's Ray (fail fast when it exits)",
    )
    p.add_argument("--log-dir", default=None, help="directory of the per-node Ray logs (named in errors)")
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    launchers: dict[str, list[int]] = {}
    for item in args.launcher:
        node, sep, pid = item.partition("=")
        if not sep or not pid.isdigit():
            p.error(f"--launcher must be NODE=PID, got {item!r}")
        launchers.setdefault(node, []).append(int(pid))
    return wait_for_nodes(args.address, args.nodes, args.timeout, launchers, args.log_dir)


if __name__ == "__main__":
    sys.exit(main())
