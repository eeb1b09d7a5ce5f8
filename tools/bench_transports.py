"""Benchmark the weight transports alone: one sender process streams buckets to one receiver process.

Each transport of ``parallel.transport`` that can stream (``shm``, ``broadcast``; with CUDA
``cuda_ipc`` on one GPU, and ``nccl`` from GPU 0 to GPU 1 when there are two) moves ``--mib``
MiB of bf16 tensors in ``--bucket-mb`` buckets through ``RemoteWeightSender.send`` /
``receive_stream`` (the same code weight sync streams with), ``--repeats`` times; the receiver
checks the last tensor's sum. The floor is one copy of the same bytes on the sender's device
(``torch.cat`` into a fresh buffer), timed in the same run. Reports the medians::

    python tools/bench_transports.py                 # GPU machine: every transport it can run
    python tools/bench_transports.py --smoke         # tiny, CPU transports (GPU ones: "needs CUDA")

The last line printed is one JSON object: ``rows`` (one per transport: ``transport``,
``gb_per_s``, ``seconds``, ``floor_s``, ``over_floor``, or ``skipped`` with the reason) and the settings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _weights(mib: float, device: str):
    """``mib`` MiB of bf16 tensors of 512 KiB each (256 x 1024)."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    count = max(1, int(mib * 2))
    return [(f"w{i}", torch.randn(256, 1024, device=device, generator=g).bfloat16()) for i in range(count)]


def _sender(transport: str, port_q, out_q, args: dict):
    import torch

    from parallel.transport import RemoteWeightSender

    device = "cpu"
    if transport in ("nccl", "cuda_ipc"):
        torch.cuda.set_device(0)
        device = "cuda:0"
    weights = _weights(args["mib"], device)
    sender = RemoteWeightSender(2, transport=transport, shm_dir=args["shm_dir"])
    port_q.put(sender.listen())
    sender.connect()
    seconds, floors = [], []
    for _ in range(args["repeats"] + 1):  # the first is a warm-up
        start = time.perf_counter()
        torch.cat([t.reshape(-1) for _, t in weights])
        if device != "cpu":
            torch.cuda.synchronize()
        floors.append(time.perf_counter() - start)
        seconds.append(sender.send(weights, int(args["bucket_mb"] * 2**20))["seconds"])
    sender.close()
    out_q.put(
        {
            "seconds": seconds[1:],
            "floors": floors[1:],
            "bytes": sum(t.nbytes for _, t in weights),
            "last_sum": float(weights[-1][1].float().sum()),
        }
    )


def _receiver(transport: str, port_q, out_q, args: dict):
    import torch

    from parallel.transport import SideBand, receive_stream

    if transport == "nccl":
        torch.cuda.set_device(1)
    elif transport == "cuda_ipc":
        torch.cuda.set_device(0)
    band = SideBand("127.0.0.1", port_q.get(timeout=120), 1, 2).connect()
    last = None
    for _ in range(args["repeats"] + 1):
        for bucket in receive_stream(band):
            last = float(bucket[-1][1].float().sum())
            del bucket
    band.close()
    out_q.put({"receiver_last_sum": last})


def _cannot_run(transport: str):
    import torch

    if transport in ("nccl", "cuda_ipc") and not torch.cuda.is_available():
        return "needs CUDA"
    if transport == "nccl" and torch.cuda.device_count() < 2:
        return "needs 2 GPUs (NCCL between processes on one GPU is refused)"
    return None


def _measure(transport: str, args: dict) -> dict:
    ctx = multiprocessing.get_context("spawn")
    port_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=fn, args=(transport, port_q, out_q, args)) for fn in (_sender, _receiver)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        got.update(out_q.get(timeout=600))
    for p in procs:
        p.join(60)
    if got["receiver_last_sum"] != got["last_sum"]:
        raise RuntimeError(
            f"{transport}: the receiver's last tensor sums to {got['receiver_last_sum']}, "
            f"the sender's to {got['last_sum']}"
        )
    seconds, floor = statistics.median(got["seconds"]), statistics.median(got["floors"])
    return {
        "transport": transport,
        "bytes": got["bytes"],
        "seconds": seconds,
        "gb_per_s": got["bytes"] / seconds / 1e9,
        "floor_s": floor,
        "over_floor": seconds / floor,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=1024.0, help="bytes per sync in MiB")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (4 MiB, 1 MiB buckets, 1 repeat)")
    a = p.parse_args(argv)
    if a.smoke:
        a.mib, a.bucket_mb, a.repeats = 4.0, 1.0, 1
    if a.mib <= 0 or a.bucket_mb <= 0 or a.repeats < 1:
        p.error("--mib and --bucket-mb must be > 0, --repeats >= 1")
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm_dir:
        args = {"mib": a.mib, "bucket_mb": a.bucket_mb, "repeats": a.repeats, "shm_dir": shm_dir}
        for transport in ("shm", "broadcast", "cuda_ipc", "nccl"):
            why = _cannot_run(transport)
            rows.append({"transport": transport, "skipped": why} if why else _measure(transport, args))
    for row in rows:
        print(
            f"{row['transport']:<10} "
            + (
                row["skipped"]
                if "skipped" in row
                else f"{row['gb_per_s']:.2f} GB/s, {row['seconds']:.4f} s, floor {row['floor_s']:.4f} s, "
                f"{row['over_floor']:.1f}x"
            )
        )
    result = {"rows": rows, "mib": a.mib, "bucket_mb": a.bucket_mb, "repeats": a.repeats}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
