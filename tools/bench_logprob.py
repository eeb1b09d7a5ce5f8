"""Benchmark log-prob + entropy: naive full-vocabulary float32 vs the chunked vocab-parallel path.

Forward + backward of ``sum(log_probs) + sum(entropy)`` for four variants, each measured in
its own fresh subprocess (so one variant's freed memory cannot hide another's peak):

- ``naive``:        ``logits.float().log_softmax(-1)`` + gather + full entropy (verl's
                    ``logprobs_from_logits`` / ``entropy_from_logits`` formulas)
- ``fused``:        ``parallel.vocab_parallel.vocab_parallel_log_probs_and_entropy`` (one rank, chunked)
- ``linear_naive``: ``hidden @ weight.T`` in the input dtype, then the naive path
- ``linear_fused``: ``fused_linear_log_probs_and_entropy`` (logits never materialised)
- on CUDA also ``ce`` / ``linear_ce``: ``torch.nn.functional.cross_entropy`` (log-prob only) as
  a speed reference.

Peak memory is the growth over a baseline taken after the inputs exist: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) with glibc told to return every block over 64 KiB to the
system at once (``MALLOC_MMAP_THRESHOLD_``), so resident memory follows live tensors.
Gradients produced (logits / hidden / weight grads) count as extra memory for every variant.

Accuracy of the fused variants is checked against a float32 reference computed from the
same inputs (upcast; row chunks, exact per row) and reported as ``*_err`` keys.

CPU default: 2,048 tokens x 32,000 vocab, float32 logits, hidden 1,024. GPU sizes::

    python tools/bench_logprob.py --device cuda --dtype bf16 --tokens 8192 --vocab 151936 --hidden 4096

The last line printed is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("naive", "fused", "linear_naive", "linear_fused")
CUDA_VARIANTS = ("ce", "linear_ce")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of logits / hidden / weight")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk, logits path")
    p.add_argument("--linear-chunk-size", type=int, default=512, help="tokens per chunk, hidden-state path")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=3, help="timed fwd+bwd repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--worker", choices=VARIANTS + CUDA_VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("tokens", "vocab", "hidden", "chunk_size", "linear_chunk_size", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.temperature <= 0:
        p.error(f"--temperature={args.temperature} must be > 0")
    return args


# --------------------------------------------------------------------------- worker side


class _Memory:
    """Peak bytes allocated above a baseline: CUDA allocator stats, or resident set on CPU."""

    def __init__(self, device: str):
        self.device = device

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} missing from /proc/self/status")

    def start(self) -> None:
        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
                f.write("5")
            self.base = self._status("VmRSS")

    def peak(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base


def _naive(logits, labels, temperature):
    import torch

    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    log_probs = x.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(x, -1) - (x.softmax(-1) * x).sum(-1)
    return log_probs, entropy


def _make_step(variant, args, logits, hidden, weight, labels):
    import torch.nn.functional as F

    from parallel.vocab_parallel import fused_linear_log_probs_and_entropy, vocab_parallel_log_probs_and_entropy

    T = args.temperature

    def step():
        if variant == "naive":
            lp, ent = _naive(logits, labels, T)
        elif variant == "fused":
            lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, temperature=T, chunk_size=args.chunk_size)
        elif variant == "linear_naive":
            lp, ent = _naive(hidden @ weight.t(), labels, T)
        elif variant == "linear_fused":
            lp, ent = fused_linear_log_probs_and_entropy(
                hidden, weight, labels, temperature=T, chunk_size=args.linear_chunk_size
            )
        elif variant == "ce":
            lp, ent = -F.cross_entropy(logits / T if T != 1.0 else logits, labels, reduction="none"), None
        else:  # linear_ce
            x = hidden @ weight.t()
            lp, ent = -F.cross_entropy(x / T if T != 1.0 else x, labels, reduction="none"), None
        loss = lp.sum() if ent is None else lp.sum() + ent.sum()
        loss.backward()
        return lp.detach(), None if ent is None else ent.detach()

    return step


def _reference_errors(variant, args, logits, hidden, weight, labels, lp, ent) -> dict:
    """Max errors of this variant's outputs (and grads) against float32 math on the same inputs."""

    T, rows = args.temperature, max(1, min(args.tokens, 1024))
    out = {}
    if variant in ("naive", "fused"):
        lp_err = ent_err = grad_err = grad_max = 0.0
        for lo in range(0, args.tokens, rows):
            x = logits[lo : lo + rows].detach().float().requires_grad_(True)
            rlp, rent = _naive(x, labels[lo : lo + rows], T)
            (rlp.sum() + rent.sum()).backward()
            lp_err = max(lp_err, (lp[lo : lo + rows] - rlp).abs().max().item())
            ent_err = max(ent_err, (ent[lo : lo + rows] - rent).abs().max().item())
            grad_err = max(grad_err, (logits.grad[lo : lo + rows].float() - x.grad).abs().max().item())
            grad_max = max(grad_max, x.grad.abs().max().item())
        out.update(max_abs_logp_err=lp_err, max_abs_entropy_err=ent_err, max_rel_grad_err=grad_err / grad_max)
    elif variant in ("linear_naive", "linear_fused"):
        w32 = weight.detach().float().requires_grad_(True)
        lp_err = ent_err = gh_err = gh_max = 0.0
        for lo in range(0, args.tokens, rows):
            h32 = hidden[lo : lo + rows].detach().float().requires_grad_(True)
            rlp, rent = _naive(h32 @ w32.t(), labels[lo : lo + rows], T)
            (rlp.sum() + rent.sum()).backward()
            lp_err = max(lp_err, (lp[lo : lo + rows] - rlp).abs().max().item())
            ent_err = max(ent_err, (ent[lo : lo + rows] - rent).abs().max().item())
            gh_err = max(gh_err, (hidden.grad[lo : lo + rows].float() - h32.grad).abs().max().item())
            gh_max = max(gh_max, h32.grad.abs().max().item())
        gw_err = (weight.grad.float() - w32.grad).abs().max().item() / w32.grad.abs().max().item()
        out.update(
            max_abs_logp_err=lp_err,
            max_abs_entropy_err=ent_err,
            max_rel_grad_hidden_err=gh_err / gh_max,
            max_rel_grad_weight_err=gw_err,
        )
    return out


def _worker(args) -> dict:
    import torch

    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    torch.manual_seed(0)
    linear = args.worker.startswith("linear")
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device)
    logits = hidden = weight = None
    if linear:
        hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype).requires_grad_(True)
        weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype)
        weight.mul_(2.0 / args.hidden**0.5).requires_grad_(True)  # logits with std ~2
    else:
        logits = torch.randn(args.tokens, args.vocab, device=device, dtype=dtype)
        logits.mul_(2.0).requires_grad_(True)
    leaves = [t for t in (logits, hidden, weight) if t is not None]

    def clear():
        for t in leaves:
            t.grad = None

    step = _make_step(args.worker, args, logits, hidden, weight, labels)
    for _ in range(args.warmup):
        step()
        clear()
    memory = _Memory(args.device)
    times, peak = [], 0
    for i in range(args.iters):
        if i > 0:
            clear()
        if i == 0:  # the first timed run also measures memory; its bookkeeping is not timed
            memory.start()
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lp, ent = step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if i == 0:
            peak = memory.peak()
    result = {"peak_bytes": int(peak), "ms": statistics.median(times)}
    if ent is not None and args.worker != "naive":  # the naive path *is* the float32 reference
        result.update(_reference_errors(args.worker, args, logits, hidden, weight, labels, lp, ent))
    return result


# --------------------------------------------------------------------------- driver side


def _run_variant(variant: str, argv: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv, "--worker", variant], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return {}
    itemsize = {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype]
    logits_bytes = args.tokens * args.vocab * itemsize
    variants = VARIANTS + (CUDA_VARIANTS if args.device == "cuda" else ())
    res = {}
    for v in variants:
        res[v] = _run_variant(v, argv)
        print(
            f"{v:>13}: {res[v]['ms']:9.1f} ms  peak +{res[v]['peak_bytes'] / 2**20:8.1f} MiB "
            f"({res[v]['peak_bytes'] / logits_bytes:.2f} x logits)",
            flush=True,
        )

    out = {
        "device": args.device,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunk_size": args.chunk_size,
        "linear_chunk_size": args.linear_chunk_size,
        "temperature": args.temperature,
        "logits_bytes": logits_bytes,
    }
    for prefix, naive, fused in (("", "naive", "fused"), ("linear_", "linear_naive", "linear_fused")):
        n, f = res[naive], res[fused]
        out.update(
            {
                f"{prefix}naive_peak_bytes": n["peak_bytes"],
                f"{prefix}fused_peak_bytes": f["peak_bytes"],
                f"{prefix}peak_ratio": n["peak_bytes"] / max(f["peak_bytes"], 1),
                f"{prefix}naive_peak_x_logits": n["peak_bytes"] / logits_bytes,
                f"{prefix}fused_peak_x_logits": f["peak_bytes"] / logits_bytes,
                f"{prefix}naive_ms": n["ms"],
                f"{prefix}fused_ms": f["ms"],
                f"{prefix}time_ratio": f["ms"] / n["ms"],
            }
        )
        for key, value in f.items():
            if key.startswith("max_"):
                out[f"{prefix}fused_{key}"] = value
        for key, value in n.items():
            if key.startswith("max_"):
                out[f"{prefix}naive_{key}"] = value
    for v in CUDA_VARIANTS:
        if v in res:
            out[f"{v}_ms"], out[f"{v}_peak_bytes"] = res[v]["ms"], res[v]["peak_bytes"]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
