"""What tools/convert_hf_to_mcore.py and tools/convert_mcore_to_hf.py share.

* ``launch``: run a rank function on N ranks -- spawned gloo (or NCCL) processes, or in this
  process when started by torchrun -- and turn a rank's exception into one clean message.
* ``AtomicDir``: the output is built in a hidden sibling directory and renamed into place only
  when everything (including ``--verify``) succeeded; on any error nothing is left behind.
* side files (tokenizer, generation config, config.json), the tokenizer-vs-vocabulary check,
  the metadata file of a converted Megatron checkpoint, and the logits used by ``--verify``.

A ``ToolError`` is a user-facing failure: printed as ``error: <message>``, exit code 1. A full
disk is named as one (``ensure_space`` before the writing starts; ``run_main`` for a write that
fails with ENOSPC anyway): the output path, the bytes needed and free.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

METADATA_FILE = "megatron_rl_conversion.json"
"""Written next to the Megatron checkpoint: family, HF config, layout, dtype."""
METADATA_VERSION = 1
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
)
"""Files copied next to the weights in both directions (those that exist)."""
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TOLERANCES = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
"""Fixed ``--verify`` bounds on the max |logit difference| (fp32; the floor of a derived bf16/fp16 bound)."""
GAP_FACTOR = 3.0
"""A bf16/fp16 forward passes when it is within GAP_FACTOR x HF's own low-precision-vs-fp32 gap of the
fp32 reference (two correct implementations round differently: Megatron measured 1.0-1.4x the gap)."""
FAULT_ENV = "MEGATRON_RL_CONVERT_FAULT"
"""Test-only: a deliberately wrong mapping applied in the ranks (``FAULTS``), to prove --verify catches it."""
FAULTS = ("qkv_heads", "gate_up", "expert_off_by_one")
VERIFY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Question: what is 12 times 7? Answer:",
)


def skip_init(tensor: torch.Tensor) -> None:
    """An ``init_method`` that draws nothing (the converters overwrite every value)."""


NO_INIT = {"init_method": skip_init, "output_layer_init_method": skip_init}
"""``build_transformer_config`` overrides for a model whose weights are all loaded: Megatron still
sets its TP attributes (``perform_initialization=False`` would drop them) but draws no random numbers."""
_EXPECTED_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)


class ToolError(Exception):
    """A failure to report as one message (no traceback), exit code 1."""


def ensure_space(out_dir: str | os.PathLike, needed: int, what: str) -> None:
    """``ToolError`` (a full disk: path, bytes needed and free) unless ``needed`` bytes fit where ``out_dir`` goes."""
    from parallel.checkpoint import DiskFullError, check_free_space

    try:
        check_free_space(out_dir, needed, what)
    except DiskFullError as exc:
        raise ToolError(str(exc)) from None


def _disk_full_message(exc: BaseException, output: Optional[str]) -> Optional[str]:
    """The full-disk message for ``exc`` when it is one (ENOSPC in any rank, or torch's ``unexpected
    pos`` with the output's file system nearly full), else None."""
    from parallel.checkpoint import free_bytes, fmt_bytes as fmt, is_disk_full

    if output is None or str(exc).startswith("disk full:"):
        return None
    free = free_bytes(output)
    if is_disk_full(exc) or ("unexpected pos" in str(exc) and free < 64 * 2**20):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"disk full: writing {Path(output).resolve()} failed ({first}); {fmt(free)} are free on that file "
                "system; nothing was written (free space, or choose another --out-dir)")
    return None


def run_main(body: Callable[[], int], output: Optional[str] = None) -> int:
    """Run a tool's body; print a ``ToolError`` (or a bad-input error) as ``error: ...`` and return 1.
    ``output`` (the ``--out-dir``) lets a write that ran out of space be reported as a full disk."""
    # torchrun (when another rank fails) and schedulers stop ranks with SIGTERM: unwind, so the
    # temporary output is removed.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return body()
    except (ToolError, OSError, RuntimeError, *_EXPECTED_ERRORS) as exc:
        full = _disk_full_message(exc, output)
        if full is None and not isinstance(exc, (ToolError, *_EXPECTED_ERRORS)):
            raise
        prefix = f"[rank {os.environ['RANK']}] " if under_torchrun() and os.environ["RANK"] != "0" else ""
        print(f"{prefix}error: {full or exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if under_torchrun():
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Ranks: spawned processes, or this process under torchrun.
# ------------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    """True when this process is one rank of a torchrun (or similar) launch."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
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


def launch(fn: Callable[[int, int, Any], Any], world: int, spec: Any, *, device: str = "cpu") -> Any:
    """Run ``fn(rank, world, spec)`` on ``world`` ranks and return global rank 0's result.

    Under torchrun the ranks already exist: ``fn`` runs in this process (every rank returns
    its own result). Otherwise ``world`` processes are spawned (gloo on CPU, NCCL on
    ``device="cuda"``). ``fn`` must be importable by name (a module-level function). The first
    rank to fail ends the run: its exception becomes a ``ToolError`` carrying its message
    (with the traceback for unexpected exception types), and the other ranks are stopped.
    """
    if under_torchrun():
        import torch.distributed as dist

        init_torchrun(device)
        return fn(dist.get_rank(), dist.get_world_size(), spec)
    import torch.multiprocessing as mp

    from parallel.testing import find_free_port

    if device == "cuda" and torch.cuda.device_count() < world:
        raise ToolError(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible; use --device cpu "
                        f"or torchrun across nodes")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world)
    port = find_free_port()
    hide_gpus = device == "cpu" and "CUDA_VISIBLE_DEVICES" not in os.environ
    if hide_gpus:  # CPU ranks on a GPU machine: Megatron must not see CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        procs = [ctx.Process(target=_child, args=(r, world, port, "nccl" if device == "cuda" else "gloo", threads,
                                                  fn, spec, results)) for r in range(world)]
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
                        failure = ToolError(f"ranks {sorted(dead)} of {world} died without a report (exit codes "
                                            f"{dead}); out of memory?")
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
    p.add_argument("--nprocs", default="auto",
                   help="ranks to spawn on CPU (auto = the fewest the layout needs); under torchrun the launch decides")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the ranks compute (auto: cuda if visible, else cpu)")


def resolve_layout(args, model_cfg, stored: Optional[dict] = None):
    """(ParallelConfig, world size, device, description) from the command line (over a ``stored``
    layout), checked against the model before any rank starts."""
    from parallel.bridge import check_layout
    from parallel.config import ParallelConfig

    stored = dict(stored or {})
    for flag, key in (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
                      ("vpp", "virtual_pipeline_model_parallel_size"), ("ep", "expert_model_parallel_size"),
                      ("etp", "expert_tensor_parallel_size")):
        if getattr(args, flag) is not None:
            stored[key] = getattr(args, flag)
    if args.vpp is None and args.pp is not None and stored.get("pipeline_model_parallel_size", 1) < 2:
        stored["virtual_pipeline_model_parallel_size"] = None  # --pp 1 over a stored VPP layout
    stored.pop("context_parallel_size", None)  # CP splits sequences, not weights
    pc = ParallelConfig.from_dict(stored)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
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
    desc = (f"tp={pc.tensor_model_parallel_size} pp={pc.pipeline_model_parallel_size}"
            + (f" vpp={pc.virtual_pipeline_model_parallel_size}" if pc.virtual_pipeline_model_parallel_size else "")
            + f" ep={pc.expert_model_parallel_size} etp={pc.effective_expert_tensor_parallel_size}")
    if not model_cfg.is_moe and (pc.expert_model_parallel_size > 1 or pc.expert_tensor_parallel_size is not None):
        raise ToolError(f"the layout {desc} sets expert parallelism, but the model is dense (no MoE experts); "
                        f"leave --ep at 1 and --etp unset")
    try:
        check_layout(pc, world, model_cfg)
    except ValueError as exc:
        raise ToolError(f"the layout {desc} on {world} ranks does not fit the model: {exc}") from None
    return pc, world, device, desc


def is_driver() -> bool:
    """The process that owns the output directory: the launcher, or rank 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0" if under_torchrun() else True


def init_torchrun(device: str) -> None:
    """Under torchrun: create the default process group for ``device`` (NCCL or gloo)."""
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


# ------------------------------------------------------------------------------------------
# Output directory: built aside, renamed into place.
# ------------------------------------------------------------------------------------------
class AtomicDir:
    """``with AtomicDir(final, overwrite) as tmp: ...; commit()`` -- the output appears whole or not at all.

    ``tmp`` is a hidden sibling of ``final`` that does not exist yet (writers that rename their
    own temporary directory into it, like ``save_model``/``save_hf_checkpoint``, create it).
    ``commit()`` renames it to ``final`` (replacing an old ``final`` only with ``overwrite``).
    Leaving the block without ``commit()``, or with an exception, removes ``tmp`` and any
    ``.<tmp>.tmp-*`` directory a crashed writer left. Only the driver process touches disk.
    A conversion killed outright (SIGKILL, the OOM killer) cannot clean up: its temporary
    directory carries the host and pid of its driver, and the next conversion to the same
    output removes those whose driver no longer runs on this host (``sweep_stale``).
    """

    def __init__(self, final: str | os.PathLike, overwrite: bool):
        self.final = Path(final).resolve()
        self.overwrite = overwrite
        tag = f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp = Path(broadcast_str(str(self.final.parent / f".{self.final.name}.convert-{tag}")))
        self.committed = False
        if is_driver():
            self.sweep_stale()
        self.new_parents = []  # ancestors the writers will create: removed again on failure
        parent = self.final.parent
        while not parent.exists():
            self.new_parents.append(parent)
            parent = parent.parent

    def __enter__(self) -> Path:
        return self.tmp

    def sweep_stale(self) -> list[Path]:
        """Remove the temporary directories of earlier conversions to ``final`` whose driver process
        (same host) is gone; returns them."""
        removed = []
        prefix = f".{self.final.name}.convert-{_host()}-"
        if not self.final.parent.is_dir():
            return removed
        for leftover in self.final.parent.glob(f"{glob_escape(prefix)}*"):
            pid = leftover.name[len(prefix):].split("-")[0].split(".")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(leftover)
        return removed

    def commit(self) -> None:
        if not is_driver():
            return
        if self.final.exists():
            if not self.overwrite:  # appeared while we were converting
                raise ToolError(f"output directory {self.final} exists; pass --overwrite to replace it")
            trash = self.final.parent / f".{self.final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.final, trash)
            os.replace(self.tmp, self.final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        self.committed = True

    def __exit__(self, *exc) -> None:
        if self.committed or not is_driver():
            return
        for leftover in [self.tmp, *self.tmp.parent.glob(f".{self.tmp.name}.tmp-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        for parent in self.new_parents:  # deepest first; only if nothing else was put there
            try:
                parent.rmdir()
            except OSError:
                break


def _host() -> str:
    import socket

    return socket.gethostname().replace("-", "_").replace(".", "_")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def glob_escape(text: str) -> str:
    """``text`` with glob metacharacters escaped."""
    import glob

    return glob.escape(text)


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool, *sources: str | os.PathLike) -> Path:
    """``out_dir`` resolved; an error if it exists (without ``overwrite``) or overlaps a source."""
    out = Path(out_dir).resolve()
    for src in sources:
        src = Path(src).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise ToolError(f"output directory {out} overlaps the input {src}; choose another --out-dir")
    if out.exists() and not overwrite:
        raise ToolError(f"output directory {out} exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise ToolError(f"output path {out} exists and is not a directory")
    return out


def side_files(directory: str | os.PathLike) -> list[Path]:
    """The tokenizer / generation-config / config.json files present in ``directory``."""
    return [Path(directory) / n for n in SIDE_FILES if (Path(directory) / n).is_file()]


def copy_files(files: list[Path], dest: Path) -> None:
    """Copy ``files`` into ``dest`` (created), keeping their names."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, dest / f.name)


def dir_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


# ------------------------------------------------------------------------------------------
# Tokenizer.
# ------------------------------------------------------------------------------------------
def load_tokenizer(directory: str | os.PathLike):
    """The HF tokenizer saved in ``directory`` (no hub access), or None if it holds none or it
    cannot be loaded here (then a warning says its size goes unchecked)."""
    if not any((Path(directory) / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that needs remote code
        if is_driver():
            print(f"warning: cannot load the tokenizer in {directory} ({type(exc).__name__}: {exc}); its size is "
                  f"not checked against the model's vocabulary", file=sys.stderr, flush=True)
        return None


def check_tokenizer(tokenizer, vocab_size: int, where: str | os.PathLike) -> Optional[int]:
    """``len(tokenizer)``; a ``ToolError`` if it produces ids the embedding has no rows for."""
    if tokenizer is None:
        return None
    size = len(tokenizer)
    if size > vocab_size:
        raise ToolError(f"the tokenizer in {where} has {size} tokens (ids up to {size - 1}) but the model's "
                        f"vocab_size is {vocab_size} (config.json): ids >= {vocab_size} have no embedding row; "
                        f"use the tokenizer the model was trained with")
    return size


def verify_inputs(tokenizer, vocab_size: int, multiple: int) -> tuple[torch.Tensor, list[int]]:
    """Fixed prompts as right-padded ids ``[prompts, seq]`` (seq a multiple of ``multiple``,
    for sequence parallelism) and their lengths. Without a tokenizer: fixed random ids."""
    if tokenizer is not None:
        prompts = [tokenizer.encode(p, add_special_tokens=False)[:64] for p in VERIFY_PROMPTS]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (16, 11, 7)]
    lengths = [len(p) for p in prompts]
    seq = -(-max(lengths) // multiple) * multiple
    ids = torch.zeros(len(prompts), seq, dtype=torch.long)  # pad id 0: causal attention never looks right
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids, lengths


# ------------------------------------------------------------------------------------------
# Logits for --verify.
# ------------------------------------------------------------------------------------------
def megatron_logits(chunks, mesh, input_ids: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """Full-vocabulary float32 logits ``[b, s, vocab_size]`` of a sharded model, on global rank 0
    (None elsewhere); collective. Runs the chunks stage by stage (virtual stages in order) with
    explicit send/recv over the pipeline group, then gathers the vocab-parallel logits over TP."""
    import torch.distributed as dist

    device = next(chunks[0].parameters()).device
    config = chunks[0].config
    pp, stage, pp_ranks = mesh.size("pp"), mesh.pp_rank, mesh.ranks("pp")
    b, s = input_ids.shape
    input_ids = input_ids.to(device)
    position_ids = torch.arange(s, device=device).expand(b, s)
    local_s = s // mesh.size("tp") if config.sequence_parallel else s
    logits = None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            chunk.eval()
            first, last = v == 0 and stage == 0, v == len(chunks) - 1 and stage == pp - 1
            if not first:
                hidden = torch.empty(local_s, b, config.hidden_size, dtype=config.params_dtype, device=device)
                dist.recv(hidden, src=pp_ranks[stage - 1] if stage > 0 else pp_ranks[-1])
                chunk.set_input_tensor(hidden)
            out = chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
            if last:
                logits = out
            else:
                dist.send(out.contiguous(), dst=pp_ranks[stage + 1] if stage < pp - 1 else pp_ranks[0])
    if logits is not None:
        parts = [torch.empty_like(logits) for _ in range(mesh.size("tp"))]
        dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
        logits = torch.cat(parts, dim=-1)[..., :vocab_size].float().contiguous()
    # One holder of the full logits sends them to rank 0.
    holder = logits is not None and mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0
    holders = [None] * dist.get_world_size()
    dist.all_gather_object(holders, holder)
    src = holders.index(True)
    if src == dist.get_rank() == 0:
        return logits.cpu()
    if dist.get_rank() == src:
        dist.send(logits, dst=0)
    elif dist.get_rank() == 0:
        logits = torch.empty(b, s, vocab_size, dtype=torch.float32, device=device)
        dist.recv(logits, src=src)
        return logits.cpu()
    return None


def hf_logits(hf_dir: str | os.PathLike, input_ids: torch.Tensor, weight_dtype: torch.dtype,
              compute_dtypes) -> Any:
    """Float32 logits of the HF checkpoint in ``hf_dir`` (transformers, eager attention, CPU):
    weights rounded to ``weight_dtype`` (the Megatron model's), forward in each of ``compute_dtypes``
    (one dtype: one tensor; a tuple: a tuple of tensors, the model loaded once)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    single = isinstance(compute_dtypes, torch.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=weight_dtype, attn_implementation="eager",
                                                 local_files_only=True).eval()
    outs = []
    with torch.no_grad():
        for dtype in ((compute_dtypes,) if single else compute_dtypes):
            model = model.to(dtype)  # an upcast of the rounded weights is exact; downcasts follow upcasts only
            outs.append(model(input_ids=input_ids).logits.float())
    del model
    return outs[0] if single else tuple(outs)


def max_logit_diff(a: torch.Tensor, b: torch.Tensor, lengths: list[int]) -> float:
    """Max |a - b| over the real (unpadded) positions of each prompt."""
    return max(float((a[i, :n] - b[i, :n]).abs().max()) for i, n in enumerate(lengths))


def mean_logit_diff(a: torch.Tensor, b: torch.Tensor, lengths: list[int]) -> float:
    """Mean over the real positions of the per-token max |a - b| (a few tokens whose MoE routing a
    rounding flipped move the max, not this; a wrong mapping moves every token)."""
    per_token = torch.cat([(a[i, :n] - b[i, :n]).abs().amax(dim=-1) for i, n in enumerate(lengths)])
    return float(per_token.mean())


def add_verify_args(p) -> None:
    """--verify / --verify-dtype / --tolerance (both converters)."""
    p.add_argument("--verify", action="store_true", help="compare logits with the other side on fixed prompts")
    p.add_argument("--verify-dtype", choices=("fp32", "model", "both"), default="fp32",
                   help="compute dtype of the Megatron forward: fp32 (default; the converted weights' values, "
                        "upcast, so the check measures the mapping and not bf16 rounding), the model's own dtype "
                        "(bf16/fp16: its per-token mean |logit diff| from HF's fp32 forward of the same weights must be "
                        f"within {GAP_FACTOR:g} x that of HF's own bf16 forward on the same prompts, printed), or both")
    p.add_argument("--tolerance", type=float, default=None,
                   help="bound on max |logit diff| in every dtype (default: 1e-4 for fp32 compute; for bf16/fp16 "
                        f"compute a bound on the per-token mean, {GAP_FACTOR:g} x HF's own gap, at least 2e-2)")


def verify_settings(args, model_dtype: str) -> list[str]:
    """Compute dtypes of the Megatron forwards ``--verify`` runs (fp32 first)."""
    dtypes = {"fp32": ["float32"], "model": [model_dtype], "both": ["float32", model_dtype]}[args.verify_dtype]
    return list(dict.fromkeys(dtypes))


def check_logits(logits: dict, hf_dir: str | os.PathLike, input_ids: torch.Tensor, weight_dtype: torch.dtype,
                 lengths: list[int], tolerance: Optional[float]) -> dict:
    """Compare the Megatron ``logits`` (compute dtype name -> tensor) with the HF model in ``hf_dir``;
    print one verify line per dtype; a ``ToolError`` if one fails. Returns {dtype: diff}.

    The reference is HF's float32 forward of the same (rounded) weights. A float32 forward must
    match it within ``tolerance`` (default 1e-4). A bf16/fp16 forward is compared like with like:
    its per-token mean |logit diff| (``mean_logit_diff``: robust to the few tokens whose MoE routing
    a rounding flips, which dominate the max) must stay within ``GAP_FACTOR`` x the same figure of
    HF's own forward in that dtype on the same prompts (at least ``TOLERANCES[dtype]``); the max
    is printed beside it. A given ``tolerance`` bounds the max instead, in every dtype."""
    low = [d for d in logits if d != "float32"]
    refs = hf_logits(hf_dir, input_ids, weight_dtype,
                     (torch.float32, *(getattr(torch, d) for d in low)))
    reference, diffs, failed = refs[0], {}, []
    for dtype, mine in logits.items():
        diff = max_logit_diff(mine, reference, lengths)
        diffs[dtype] = diff
        if dtype == "float32" or tolerance is not None:
            bound = tolerance if tolerance is not None else TOLERANCES["float32"]
            ok, how = diff <= bound, (" (--tolerance)" if tolerance is not None else "")
            line = f"max |logit diff| = {diff:.3e}"
        else:
            own = refs[1 + low.index(dtype)]
            gap, mean_gap = max_logit_diff(own, reference, lengths), mean_logit_diff(own, reference, lengths)
            mean = mean_logit_diff(mine, reference, lengths)
            bound = max(GAP_FACTOR * mean_gap, TOLERANCES[dtype])
            ok = mean <= bound
            line = f"per-token mean |logit diff| = {mean:.3e} (max {diff:.3e})"
            how = (f" = max({GAP_FACTOR:g} x HF's own {dtype}-vs-float32 gap on these prompts, {TOLERANCES[dtype]:.0e}) "
                   f"(that gap: per-token mean {mean_gap:.3e}, max {gap:.3e})")
        print(f"verify ({dtype} forward): {line} over {len(lengths)} prompts ({sum(lengths)} tokens), tolerance "
              f"{bound:.3e}{how}: {'OK' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(f"{line.split(' = ')[0]} {line.split(' = ')[1].split(' ')[0]} of the {dtype} forward "
                          f"exceeds the tolerance {bound:.3e}")
    if failed:
        raise ToolError(f"--verify: {'; '.join(failed)}; the output was not written (raise --tolerance to accept "
                        f"it)")
    return diffs


def model_in_dtype(chunks, model_cfg, parallel_config, dtype: str):
    """``chunks`` with parameters in ``dtype``: the chunks themselves, or a fresh build at the same
    layout holding their values (exactly representable: an upcast)."""
    import dataclasses

    from megatron_rl.models.gpt import build_model, build_transformer_config

    if model_cfg.params_dtype == dtype:
        return chunks
    cfg = dataclasses.replace(model_cfg, params_dtype=dtype)
    copies = build_model(cfg, build_transformer_config(cfg, parallel_config, **NO_INIT))
    with torch.no_grad():
        for copy, chunk in zip(copies, chunks):
            source = dict(chunk.named_parameters())
            for name, param in copy.named_parameters():
                param.copy_(source[name])
    return copies


def verify_forwards(chunks, model_cfg, parallel_config, mesh, input_ids: torch.Tensor, dtypes: list[str]) -> dict:
    """{compute dtype: full float32 logits on rank 0 (None elsewhere)} of the model in each dtype; collective."""
    out = {}
    for dtype in dtypes:
        verify_chunks = model_in_dtype(chunks, model_cfg, parallel_config, dtype)
        out[dtype] = megatron_logits(verify_chunks, mesh, input_ids, model_cfg.vocab_size)
        del verify_chunks
    return out


def apply_fault(weight_map, model_cfg):
    """Test-only (``FAULT_ENV``): ``weight_map`` made deliberately wrong, so tests can show that
    ``--verify`` refuses a wrong mapping. Unset: ``weight_map`` itself. ``qkv_heads`` swaps query
    heads 0 and 1 as they are read, ``gate_up`` swaps the two halves of every gated MLP,
    ``expert_off_by_one`` loads expert e+1's weights into expert e."""
    import dataclasses

    fault = os.environ.get(FAULT_ENV)
    if not fault:
        return weight_map
    if fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r} is not allowed; choose one of {list(FAULTS)}")
    if fault == "qkv_heads":
        from parallel.bridge.hf_files import HFCheckpointReader

        head_dim, plain = weight_map.head_dim, HFCheckpointReader.read

        def read(self, name, dim=None, start=0, stop=None):
            if not name.endswith("self_attn.q_proj.weight") or dim not in (None, 0):
                return plain(self, name, dim, start, stop)
            full = plain(self, name).clone()
            full[:head_dim], full[head_dim: 2 * head_dim] = full[head_dim: 2 * head_dim].clone(), full[:head_dim].clone()
            return full if dim is None else full[start:stop]

        HFCheckpointReader.read = read
        return weight_map
    if fault == "gate_up":
        rules = tuple(dataclasses.replace(r, hf=r.hf[::-1]) if r.transform == "gate_up" else r
                      for r in weight_map.rules)
        return dataclasses.replace(weight_map, rules=rules)
    experts = model_cfg.num_moe_experts
    if not experts:
        raise ValueError(f"{FAULT_ENV}=expert_off_by_one needs an MoE model")

    class Shifted(type(weight_map.rules[0])):
        def match(self, global_name):
            m = self._regex.match(global_name)
            if m is None:
                return None
            fields = {k: int(v) for k, v in m.groupdict().items()}
            fields["expert"] = (fields["expert"] + 1) % experts
            return tuple(n.format(**fields) for n in self.hf)

    rules = tuple(Shifted(r.megatron, r.hf, r.transform, r.export) if r.is_expert else r for r in weight_map.rules)
    return dataclasses.replace(weight_map, rules=rules)


# ------------------------------------------------------------------------------------------
# Progress and the summary line.
# ------------------------------------------------------------------------------------------
def max_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_peaks() -> list[int]:
    """Every rank's peak resident memory (collective; one entry without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [max_rss()]
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, max_rss())
    return peaks


def peak_summary(peaks: list[int]) -> str:
    """``peak memory 1.2 GiB (2 ranks' max RSS, summed, + this process 0.3 GiB)`` for the done line."""
    own = max_rss() if not under_torchrun() else 0
    text = f"peak memory {fmt_bytes(sum(peaks) + own)} ({len(peaks)} ranks' max RSS summed"
    return text + (f" + this process {fmt_bytes(own)})" if own else ")")
class Progress:
    """A tqdm bar (stderr, one process only) over a conversion's stages; ``watch`` adds a
    byte counter for a stage that writes files, by polling the sizes under a directory."""

    def __init__(self, stages: list[str], enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=len(stages), desc=stages[0], unit="stage", disable=not enabled, file=sys.stderr,
                        bar_format="{desc:<34} {n_fmt}/{total_fmt} [{elapsed}] {postfix}")
        self.started = False

    def stage(self, name: str) -> None:
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_description_str(name)
        self.bar.set_postfix_str("")

    def close(self) -> None:
        """Complete the last stage and end the bar."""
        if self.started:
            self.bar.update(1)
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # end the line, so the error message starts on its own
            self.bar.close()

    def watch(self, parent: Path, prefix: str, total: int) -> "threading.Event":
        """Show bytes written under ``parent/<prefix>*`` against ``total`` until the event is set."""
        done = threading.Event()
        if self.bar.disable:
            return done

        began = time.monotonic()

        def poll() -> None:
            while not done.wait(0.5):
                try:
                    written = sum(dir_bytes(p) for p in parent.glob(prefix + "*") if p.is_dir())
                except OSError:  # a file renamed or removed while we looked
                    continue
                rate = written / 2**20 / max(time.monotonic() - began, 1e-3)
                self.bar.set_postfix_str(f"{fmt_bytes(written)} / ~{fmt_bytes(total)}, {rate:.1f} MB/s")

        threading.Thread(target=poll, daemon=True).start()
        return done
