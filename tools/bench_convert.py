"""Benchmark of ``convert_hf_to_mcore.py`` against the floor: a plain read + write of the same safetensors.

    python tools/bench_convert.py --hf-dir Qwen3-0.6B --tp 2          # a real checkpoint
    python tools/bench_convert.py --smoke                             # a tiny Qwen3, built here

In one run: (1) the floor -- every safetensors file of ``--hf-dir`` read whole and written again
with ``safetensors.torch.save_file`` (page cache warm for both); (2) the conversion without
``--verify``; (3) with ``--verify``. While a conversion runs, the memory of its whole process tree
(the tool and its spawned ranks) is sampled every 0.1 s (PSS where the kernel reports it, else
RSS) and its peak kept. Startup is the time from launch until the first byte of output exists.
Prints one line per stage, then a JSON line (last) with ``mb_per_s``, ``floor_mb_per_s``,
``peak_over_checkpoint``, ``peak_over_checkpoint_verify``, ``startup_s`` and the raw figures.
MB/s is checkpoint bytes (MiB) per second of wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree_memory(pid: int) -> int:
    """PSS (else RSS) of ``pid`` and all its descendants, in bytes."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            info = p.memory_full_info()
            total += getattr(info, "pss", None) or info.rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def _first_byte(parent: Path, name: str) -> bool:
    for p in parent.glob(f".{name}*"):
        for f in p.rglob("*"):
            try:
                if f.is_file() and f.stat().st_size > 0:
                    return True
            except OSError:
                continue
    return (parent / name).exists()


def run_conversion(argv: list[str], out: Path) -> dict:
    """Run the converter with ``argv``; its wall time, peak tree memory, startup and output."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "convert_hf_to_mcore.py"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peak, startup = [0], [None]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_memory(proc.pid))
            if startup[0] is None and _first_byte(out.parent, out.name):
                startup[0] = time.perf_counter() - start
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"conversion failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return {"seconds": seconds, "peak_bytes": peak[0], "startup_s": startup[0], "summary": stdout.strip().splitlines()[-1]}


def floor(hf_dir: Path, work: Path) -> dict:
    """Read every safetensors file of ``hf_dir`` whole and write it again; wall time and bytes."""
    from safetensors.torch import load_file, save_file

    files = sorted(hf_dir.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache, as the conversion that follows will find it
        f.read_bytes()
    start = time.perf_counter()
    for f in files:
        save_file(load_file(f), str(work / f.name))  # no fsync: the conversion does not sync either
    return {"seconds": time.perf_counter() - start, "bytes": nbytes}


def main(argv=None) -> int:
    """Parse arguments, run the floor and both conversions, print the figures and the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", help="HF checkpoint to convert (not needed with --smoke)")
    p.add_argument("--smoke", action="store_true", help="build a tiny Qwen3 checkpoint here and benchmark it")
    p.add_argument("--work-dir", help="where outputs go (default: a temporary directory, removed)")
    args, convert_args = p.parse_known_args(argv)
    if not args.smoke and not args.hf_dir:
        p.error("give --hf-dir or --smoke")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        if args.smoke:
            sys.path.insert(0, str(ROOT))
            from megatron_rl.models.testing import build_tiny_hf_checkpoint

            hf_dir = build_tiny_hf_checkpoint(work / "hf", "qwen3")["path"]
        else:
            hf_dir = Path(args.hf_dir).resolve()
        (work / "floor").mkdir()
        base = floor(hf_dir, work / "floor")
        size = base["bytes"]
        mib = size / 2**20
        floor_rate = mib / base["seconds"]
        print(f"floor: read + write {mib:.1f} MiB of safetensors in {base['seconds']:.2f} s = {floor_rate:.1f} MB/s",
              flush=True)
        plain = run_conversion(["--hf-dir", str(hf_dir), "--out-dir", str(work / "mcore"), *convert_args],
                               work / "mcore")
        print(f"convert: {plain['seconds']:.2f} s = {mib / plain['seconds']:.1f} MB/s, startup {plain['startup_s']} s, "
              f"peak {plain['peak_bytes'] / 2**20:.0f} MiB = {plain['peak_bytes'] / size:.2f} x the checkpoint\n  "
              f"{plain['summary']}", flush=True)
        verify = run_conversion(["--hf-dir", str(hf_dir), "--out-dir", str(work / "mcore_verify"), "--verify",
                                 *convert_args], work / "mcore_verify")
        print(f"convert --verify: {verify['seconds']:.2f} s = {mib / verify['seconds']:.1f} MB/s, peak "
              f"{verify['peak_bytes'] / 2**20:.0f} MiB = {verify['peak_bytes'] / size:.2f} x the checkpoint\n  "
              f"{verify['summary']}", flush=True)
        result = dict(checkpoint_bytes=size, mb_per_s=mib / plain["seconds"], floor_mb_per_s=floor_rate,
                      speed_over_floor=(mib / plain["seconds"]) / floor_rate,
                      peak_over_checkpoint=plain["peak_bytes"] / size,
                      peak_over_checkpoint_verify=verify["peak_bytes"] / size, startup_s=plain["startup_s"],
                      seconds=plain["seconds"], seconds_verify=verify["seconds"], floor_seconds=base["seconds"],
                      peak_bytes=plain["peak_bytes"], peak_bytes_verify=verify["peak_bytes"],
                      mb_per_s_verify=mib / verify["seconds"], convert_args=convert_args, hf_dir=str(hf_dir))
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
