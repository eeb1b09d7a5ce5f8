"""Ranks for the converters: gloo processes forked from a preloaded server, NCCL processes spawned,
or this process under torchrun.

CPU ranks come from a ``multiprocessing`` fork server that imports Megatron once
(``megatron_rl.convert.preload``): ``prestart`` starts it while the driver is still checking its inputs,
so the import overlaps that work, and every rank forked from it starts with the modules loaded
and shares their pages (copy-on-write) instead of holding its own copy.
``launch`` runs a rank function on N ranks and turns a rank's exception into one clean message;
``add_layout_args`` / ``resolve_layout`` are the layout flags both converters take.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import time
import traceback
import warnings
from typing import Any, Callable, Optional

from megatron_rl.convert.support import _EXPECTED_ERRORS, ToolError, is_driver, under_torchrun  # noqa: F401

# torch is imported where it is used: ``prestart`` runs before the driver imports it, so the fork
# server's imports (Megatron's, seconds) start at once instead of after the driver's own.

PRELOAD = "megatron_rl.convert.preload"
"""What the fork server imports once (Megatron, torch.distributed's checkpoint code, the rank functions)."""


def min_world_size(parallel_config) -> int:
    """Fewest ranks a layout needs: pipeline stages x lcm(TP x CP, EP x ETP)."""
    pc = parallel_config
    dense = pc.tensor_model_parallel_size * pc.context_parallel_size
    expert = pc.expert_model_parallel_size * pc.effective_expert_tensor_parallel_size
    return pc.pipeline_model_parallel_size * math.lcm(dense, expert)


def quiet_warnings() -> None:
    """Hide the import-time and deprecation warnings of Megatron and torch's checkpoint code."""
    warnings.filterwarnings("ignore", module=r"(megatron|torch\.distributed\.checkpoint)(\.|$)")


def _child(rank: int, world: int, port: int, backend: str, threads: int, fn: Callable, spec: Any, results) -> None:
    quiet_warnings()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
        results.put((rank, None, pickle.dumps(fn(rank, world, spec))))
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        results.put((rank, (type(exc).__name__, str(exc), traceback.format_exc()), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch where no NVIDIA device can exist
    (no ``/dev/nvidiactl`` / ``/dev/nvidia0`` / WSL's ``/dev/dxg``, or ``CUDA_VISIBLE_DEVICES``
    empty or -1): torch would answer False there too, and its import is what ``prestart`` must not wait for."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


def prestart(device: str) -> None:
    """Start the fork server of the CPU ranks now, in the background (``device``: the ``--device``
    flag; nothing for CUDA ranks or under torchrun). It imports ``PRELOAD`` before it forks its
    first rank, with CUDA hidden (CPU ranks on a GPU machine: Megatron must not see CUDA). Call it
    first thing: nothing here imports torch on a machine without GPUs."""
    from multiprocessing import forkserver

    if under_torchrun() or device == "cuda" or (device == "auto" and cuda_available()):
        return
    forkserver.set_forkserver_preload([PRELOAD])  # read only when the server starts (ensure_running: once)
    hide = "CUDA_VISIBLE_DEVICES" not in os.environ
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        forkserver.ensure_running()
    finally:
        if hide:
            del os.environ["CUDA_VISIBLE_DEVICES"]


def prestart_for(argv: Optional[list[str]], required: tuple[str, ...]) -> None:
    """``prestart`` from a converter's raw command line, before it is parsed (its parser imports
    torch): only when every ``required`` flag is there and no ``--help`` (a usage error or ``--help``
    starts nothing), with the ``--device`` it names."""
    import argparse
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        return
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--device", default="auto")
    for flag in required:
        early.add_argument(flag)
    try:
        known, _ = early.parse_known_args(argv)
    except SystemExit:  # malformed: the real parser says why
        return
    if known.device in ("auto", "cpu") and all(getattr(known, f.lstrip("-").replace("-", "_")) for f in required):
        prestart(known.device)


def launch(fn: Callable[[int, int, Any], Any], world: int, spec: Any, *, device: str = "cpu") -> Any:
    """Run ``fn(rank, world, spec)`` on ``world`` ranks and return global rank 0's result.

    Under torchrun the ranks already exist: ``fn`` runs in this process (every rank returns
    its own result). Otherwise ``world`` processes are started: gloo ranks forked from the fork
    server (``prestart``) on CPU, spawned NCCL ranks on ``device="cuda"``. ``fn`` must be
    importable by name (a module-level function). The first rank to fail ends the run: its
    exception becomes a ``ToolError`` carrying its message (with the traceback for unexpected
    exception types), and the other ranks are stopped.
    """
    if under_torchrun():
        import torch.distributed as dist

        init_torchrun(device)
        return fn(dist.get_rank(), dist.get_world_size(), spec)
    import torch
    import torch.multiprocessing as mp

    from parallel.testing import find_free_port

    if device == "cuda" and torch.cuda.device_count() < world:
        raise ToolError(
            f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible; use --device cpu "
            f"or torchrun across nodes"
        )
    if device == "cpu":
        prestart("cpu")  # a no-op when already started
    ctx = mp.get_context("forkserver" if device == "cpu" else "spawn")
    results = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world)
    port = find_free_port()
    hide_gpus = device == "cpu" and "CUDA_VISIBLE_DEVICES" not in os.environ
    if hide_gpus:  # CPU ranks on a GPU machine: Megatron must not see CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        procs = [
            ctx.Process(
                target=_child, args=(r, world, port, "nccl" if device == "cuda" else "gloo", threads, fn, spec, results)
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        if hide_gpus:
            del os.environ["CUDA_VISIBLE_DEVICES"]
    outputs: dict[int, Any] = {}
    failure: Optional[ToolError] = None
    reported: set[int] = set()
    deadline = None
    try:
        # Collect every rank's report; after the first failure wait briefly for the others (the
        # bridge raises on all ranks alike), then stop whoever is left.
        while len(reported) < world and (deadline is None or time.monotonic() < deadline):
            try:
                rank, error, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None and r not in reported}
                if dead and failure is None:
                    time.sleep(2.0)  # a dying rank may still be delivering its report
                    if results.empty():
                        failure = ToolError(
                            f"ranks {sorted(dead)} of {world} died without a report (exit codes {dead}); out of memory?"
                        )
                        break
                continue
            reported.add(rank)
            if error is not None and failure is None:
                name, message, tb = error
                if name not in {e.__name__ for e in (ToolError, *_EXPECTED_ERRORS)}:
                    message = f"{name}: {message}\n(rank {rank} of {world})\n{tb}"
                failure = ToolError(message)
                deadline = time.monotonic() + 5.0
            elif error is None:
                outputs[rank] = pickle.loads(payload)
        if failure is not None:
            raise failure
        for p in procs:
            p.join()
        return outputs[0]
    finally:
        end = time.monotonic() + 5.0  # ranks that reported are exiting: let them clean up
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()
        results.join_thread()


def add_layout_args(p, *, required: bool) -> None:
    """--tp/--pp/--vpp/--ep/--etp/--nprocs/--device (shared with convert_mcore_to_hf.py)."""
    default = None if not required else 1
    p.add_argument("--tp", type=int, default=default, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=default, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (interleaved schedule)")
    p.add_argument("--ep", type=int, default=default, help="expert-parallel size (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: --tp)")
    p.add_argument(
        "--nprocs",
        default="auto",
        help="ranks to spawn on CPU (auto = the fewest the layout needs); under torchrun the launch decides",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the ranks compute (auto: cuda if visible, else cpu)",
    )


def resolve_layout(args, model_cfg, stored: Optional[dict] = None):
    """(ParallelConfig, world size, device, description) from the command line (over a ``stored``
    layout), checked against the model before any rank starts."""
    from parallel.bridge import check_layout
    from parallel.config import ParallelConfig

    stored = dict(stored or {})
    for flag, key in (
        ("tp", "tensor_model_parallel_size"),
        ("pp", "pipeline_model_parallel_size"),
        ("vpp", "virtual_pipeline_model_parallel_size"),
        ("ep", "expert_model_parallel_size"),
        ("etp", "expert_tensor_parallel_size"),
    ):
        if getattr(args, flag) is not None:
            stored[key] = getattr(args, flag)
    if args.vpp is None and args.pp is not None and stored.get("pipeline_model_parallel_size", 1) < 2:
        stored["virtual_pipeline_model_parallel_size"] = None  # --pp 1 over a stored VPP layout
    stored.pop("context_parallel_size", None)  # CP splits sequences, not weights
    pc = ParallelConfig.from_dict(stored)
    device = args.device
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    nprocs = None
    if args.nprocs != "auto":
        try:
            nprocs = int(args.nprocs)
        except ValueError:
            nprocs = 0
        if nprocs < 1:
            raise ToolError(f"--nprocs={args.nprocs!r} is not allowed; give 'auto' or a number of ranks >= 1")
    if under_torchrun():
        init_torchrun(device)
        world = int(os.environ["WORLD_SIZE"])
        if nprocs is not None and nprocs != world:
            raise ToolError(f"--nprocs={nprocs} but torchrun started {world} ranks")
    else:
        world = nprocs or min_world_size(pc)
    desc = (
        f"tp={pc.tensor_model_parallel_size} pp={pc.pipeline_model_parallel_size}"
        + (f" vpp={pc.virtual_pipeline_model_parallel_size}" if pc.virtual_pipeline_model_parallel_size else "")
        + f" ep={pc.expert_model_parallel_size} etp={pc.effective_expert_tensor_parallel_size}"
    )
    if not model_cfg.is_moe and (pc.expert_model_parallel_size > 1 or pc.expert_tensor_parallel_size is not None):
        raise ToolError(
            f"the layout {desc} sets expert parallelism, but the model is dense (no MoE experts); "
            f"leave --ep at 1 and --etp unset"
        )
    try:
        check_layout(pc, world, model_cfg)
    except ValueError as exc:
        raise ToolError(f"the layout {desc} on {world} ranks does not fit the model: {exc}") from None
    return pc, world, device, desc


def init_torchrun(device: str) -> None:
    """Under torchrun: create the default process group for ``device`` (NCCL or gloo)."""
    import torch
    import torch.distributed as dist

    if device == "cpu" and torch.cuda.is_available():
        raise ToolError("--device cpu under torchrun needs CUDA hidden from the ranks (CUDA_VISIBLE_DEVICES='')")
    quiet_warnings()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")


def broadcast_str(value: str) -> str:
    """Rank 0's ``value`` on every torchrun rank (identity when spawning)."""
    if not under_torchrun():
        return value
    from parallel.bridge.collective import broadcast_str as _broadcast

    return _broadcast(value)
