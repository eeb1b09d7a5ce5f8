"""Benchmark of ``convert_hf_to_mcore.py`` against the floor: a plain read + write of the same safetensors.

    python tools/bench_convert.py --hf-dir Qwen3-0.6B --tp 2          # a real checkpoint
    python tools/bench_convert.py --smoke                             # a tiny Qwen3, built here
    python tools/bench_convert.py --synth qwen3-30b-a3b --layers 2 --tp 2 --work-dir /tmp/17   # real shapes

``--synth NAME`` writes a checkpoint with the real shapes of ``NAME`` (``SYNTH_CONFIGS``; fewer
layers with ``--layers``) and random bf16 weights, straight into safetensors shards (no HF model is
built: names and shapes come from a meta-device one), with a small byte-level tokenizer.

In one run: (1) the floor -- every safetensors file of ``--hf-dir`` read whole and written again
with ``safetensors.torch.save_file`` (page cache warm for both); (2) the conversion without
``--verify``; (3) with ``--verify`` (``--skip-verify`` leaves it out); (4) ``convert_mcore_to_hf.py``
of (2)'s output back to HF at the same layout (``--skip-back`` leaves it out). While a conversion runs, the memory of its whole process tree
(the tool and its spawned ranks) is sampled every 0.1 s (PSS where the kernel reports it, else
RSS) and its peak kept. Startup is the time from launch until the first byte of output exists.
Prints one line per stage, then a JSON line (last) with ``mb_per_s``, ``floor_mb_per_s``,
``peak_over_checkpoint``, ``peak_over_checkpoint_verify``, ``startup_s``, ``streaming_mb_per_s`` (the bytes over
the time from the first byte written to the end: the rate once the ranks stream), ``mcore_to_hf_mb_per_s``,
``mcore_to_hf_peak_over_checkpoint``, ``mcore_to_hf_startup_s`` and the raw figures (null for a skipped stage).
MB/s is checkpoint bytes (MiB) per second of wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_QWEN3 = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    dtype="bfloat16",
)
SYNTH_CONFIGS = {
    "qwen3-0.6b": _QWEN3,
    "qwen3-30b-a3b": dict(
        _QWEN3,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}
"""config.json of the models ``--synth`` imitates (the hub configs' shapes)."""


def synth_checkpoint(path: Path, name: str, layers: int | None, shard_bytes: int = 2**30) -> Path:
    """Write an HF checkpoint with ``name``'s shapes (``layers`` decoder layers) and random bf16
    weights (matrices ~ N(0, 0.02^2), norms ~ N(1, 0.02^2)) into ``path``; returns ``path``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    sys.path.insert(0, str(ROOT))
    from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer
    from megatron_rl.models.families import load_hf_config

    path.mkdir(parents=True)
    tokenizer = train_byte_bpe_tokenizer(None, 300, path)
    data = dict(SYNTH_CONFIGS[name], eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if layers:
        data["num_hidden_layers"] = layers
    config = load_hf_config(data)
    config.save_pretrained(str(path))
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        str(path)
    )
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    for n in [n for n in shapes if n.endswith("mlp.experts.gate_up_proj") or n.endswith("mlp.experts.down_proj")]:
        # transformers fuses the experts in memory; hub files (what save_pretrained writes) hold one per expert
        prefix, experts = n.rsplit(".", 1)[0], shapes.pop(n)[0]
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        for e in range(experts):
            if n.endswith("gate_up_proj"):
                shapes[f"{prefix}.{e}.gate_proj.weight"] = shapes[f"{prefix}.{e}.up_proj.weight"] = (inter, hidden)
            else:
                shapes[f"{prefix}.{e}.down_proj.weight"] = (hidden, inter)
    gen = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for n, shape in shapes.items():
        mean = 1.0 if len(shape) == 1 and "norm" in n else 0.0
        current[n] = (torch.randn(shape, generator=gen) * 0.02 + mean).to(torch.bfloat16)
        size += current[n].numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    total = sum(t.numel() * 2 for s in shards for t in s.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return path


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
    """True once a file with bytes exists in a hidden sibling of ``parent / name`` (the converters'
    temporary output directories: ``.NAME...``, and ``..NAME...`` for a temporary made inside it)."""
    for p in parent.glob(f".*{name}*"):
        for f in p.rglob("*"):
            try:
                if f.is_file() and f.stat().st_size > 0:
                    return True
            except OSError:
                continue
    return (parent / name).exists()


def run_conversion(argv: list[str], out: Path, tool: str = "convert_hf_to_mcore.py") -> dict:
    """Run the converter ``tool`` with ``argv``; its wall time, peak tree memory, startup and output."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / tool), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
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
    return {
        "seconds": seconds,
        "peak_bytes": peak[0],
        "startup_s": startup[0],
        "summary": stdout.strip().splitlines()[-1],
    }


def floor(hf_dir: Path, work: Path) -> dict:
    """Read every safetensors file of ``hf_dir`` whole and write it again; wall time and bytes."""
    from safetensors.torch import load_file, save_file

    files = sorted(hf_dir.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache, as the conversion that follows will find it
        f.read_bytes()
    start = time.perf_counter()
    for f in files:
        save_file(load_file(f), str(work / f.name))  # no fsync (Megatron's writer fsyncs each file it writes)
    seconds = time.perf_counter() - start
    # Untimed: the floor's dirty pages go to disk now, not during the conversion that follows
    # (whose own fsyncs would otherwise wait behind them).
    os.sync()
    return {"seconds": seconds, "bytes": nbytes}


def main(argv=None) -> int:
    """Parse arguments, run the floor and both conversions, print the figures and the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", help="HF checkpoint to convert (not needed with --smoke)")
    p.add_argument("--smoke", action="store_true", help="build a tiny Qwen3 checkpoint here and benchmark it")
    p.add_argument("--synth", choices=sorted(SYNTH_CONFIGS), help="write a checkpoint with these real shapes here")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the --synth checkpoint")
    p.add_argument("--work-dir", help="where outputs go (default: a temporary directory, removed)")
    p.add_argument("--skip-verify", action="store_true", help="leave out stage (3): its figures are null")
    p.add_argument("--skip-back", action="store_true", help="leave out stage (4), mcore -> HF: its figures are null")
    args, convert_args = p.parse_known_args(argv)
    if sum(map(bool, (args.smoke, args.hf_dir, args.synth))) != 1:
        p.error("give one of --hf-dir, --smoke or --synth")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        if args.smoke:
            sys.path.insert(0, str(ROOT))
            from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

            hf_dir = build_tiny_hf_checkpoint(work / "hf", "qwen3")["path"]
        elif args.synth:
            hf_dir = synth_checkpoint(work / "hf", args.synth, args.layers)
        else:
            hf_dir = Path(args.hf_dir).resolve()
        (work / "floor").mkdir()
        base = floor(hf_dir, work / "floor")
        size = base["bytes"]
        mib = size / 2**20
        floor_rate = mib / base["seconds"]
        print(
            f"floor: read + write {mib:.1f} MiB of safetensors in {base['seconds']:.2f} s = {floor_rate:.1f} MB/s",
            flush=True,
        )
        plain = run_conversion(
            ["--hf-dir", str(hf_dir), "--out-dir", str(work / "mcore"), *convert_args], work / "mcore"
        )
        streaming = (
            ""
            if plain["startup_s"] is None
            else f" ({mib / (plain['seconds'] - plain['startup_s']):.1f} MB/s from the first byte)"
        )
        print(
            f"convert: {plain['seconds']:.2f} s = {mib / plain['seconds']:.1f} MB/s{streaming}, startup {plain['startup_s']} s, "
            f"peak {plain['peak_bytes'] / 2**20:.0f} MiB = {plain['peak_bytes'] / size:.2f} x the checkpoint\n  "
            f"{plain['summary']}",
            flush=True,
        )
        verify = None
        if not args.skip_verify:
            verify = run_conversion(
                ["--hf-dir", str(hf_dir), "--out-dir", str(work / "mcore_verify"), "--verify", *convert_args],
                work / "mcore_verify",
            )
            print(
                f"convert --verify: {verify['seconds']:.2f} s = {mib / verify['seconds']:.1f} MB/s, peak "
                f"{verify['peak_bytes'] / 2**20:.0f} MiB = {verify['peak_bytes'] / size:.2f} x the checkpoint\n  "
                f"{verify['summary']}",
                flush=True,
            )
        back = None
        if not args.skip_back:  # (4) the way back, from (2)'s output at the same layout
            back = run_conversion(
                ["--mcore-dir", str(work / "mcore"), "--out-dir", str(work / "hf_back")],
                work / "hf_back",
                tool="convert_mcore_to_hf.py",
            )
            print(
                f"mcore-to-hf: {back['seconds']:.2f} s = {mib / back['seconds']:.1f} MB/s, startup "
                f"{back['startup_s']} s, peak {back['peak_bytes'] / 2**20:.0f} MiB = "
                f"{back['peak_bytes'] / size:.2f} x the checkpoint\n  {back['summary']}",
                flush=True,
            )

        def figure(stage, value):
            return None if stage is None else value(stage)

        result = dict(
            checkpoint_bytes=size,
            mb_per_s=mib / plain["seconds"],
            floor_mb_per_s=floor_rate,
            speed_over_floor=(mib / plain["seconds"]) / floor_rate,
            streaming_mb_per_s=(
                mib / (plain["seconds"] - plain["startup_s"]) if plain["startup_s"] is not None else None
            ),
            peak_over_checkpoint=plain["peak_bytes"] / size,
            peak_over_checkpoint_verify=figure(verify, lambda v: v["peak_bytes"] / size),
            startup_s=plain["startup_s"],
            seconds=plain["seconds"],
            seconds_verify=figure(verify, lambda v: v["seconds"]),
            floor_seconds=base["seconds"],
            peak_bytes=plain["peak_bytes"],
            peak_bytes_verify=figure(verify, lambda v: v["peak_bytes"]),
            mb_per_s_verify=figure(verify, lambda v: mib / v["seconds"]),
            mcore_to_hf_mb_per_s=figure(back, lambda b: mib / b["seconds"]),
            mcore_to_hf_peak_over_checkpoint=figure(back, lambda b: b["peak_bytes"] / size),
            mcore_to_hf_startup_s=figure(back, lambda b: b["startup_s"]),
            mcore_to_hf_seconds=figure(back, lambda b: b["seconds"]),
            convert_args=convert_args,
            hf_dir=str(hf_dir),
        )
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
