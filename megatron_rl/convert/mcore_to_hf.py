"""Convert a Megatron-Core checkpoint written by convert_hf_to_mcore.py back into a Hugging Face checkpoint.

    python tools/convert_mcore_to_hf.py --mcore-dir qwen3-8b-mcore --out-dir qwen3-8b-hf --verify
    megatron-rl convert mcore-to-hf --mcore-dir ... --out-dir ...

Everything needed (family, HF config, layout, dtype) is read from the checkpoint's
``megatron_rl_conversion.json``. The model is loaded at the stored layout (``--tp``/``--pp``/...
choose another: distributed checkpoints load at any layout) and exported through
``parallel.bridge``'s bucketed generator into safetensors shards + index; config.json (the
original file), generation_config.json and the tokenizer files are copied next to them. The
output appears only once complete (temporary sibling + rename). ``--verify`` compares the
logits of the written HF checkpoint (transformers) with the Megatron model's on fixed prompts.
Multi-token-prediction layers carried from the HF source (``mtp/mtp.safetensors``) are written back
unchanged as ``model-mtp.safetensors``, listed in the index.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

# Nothing imported here loads torch or transformers: ``main`` starts the ranks' fork server first.
from megatron_rl.convert.support import (
    METADATA_FILE,
    METADATA_VERSION,
    FastEncoder,
    ToolError,
    check_tokenizer,
    copy_files,
    dir_bytes,
    ensure_space,
    exit_now,
    fast_hf_config,
    fast_tokenizer_size,
    fmt_bytes,
    load_tokenizer,
    run_main,
    side_files,
)
from megatron_rl.convert.launch import (
    add_layout_args,
    is_driver,
    launch,
    prestart,
    prestart_for,
    resolve_layout,
    under_torchrun,
)
from megatron_rl.convert.output import (
    AtomicDir,
    Progress,
    TreeMemory,
    check_output_dir,
    peak_summary,
    rank_peaks,
)


def _parse(argv=None, prog: str = "convert_mcore_to_hf.py") -> argparse.Namespace:
    from megatron_rl.convert.verify import add_verify_args

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--mcore-dir", required=True, help="Megatron checkpoint written by convert_hf_to_mcore.py")
    p.add_argument("--out-dir", required=True, help="HF checkpoint directory to create")
    add_layout_args(p, required=False)
    p.add_argument("--max-shard-mb", type=float, default=5000.0, help="largest safetensors file, in MiB")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out-dir")
    add_verify_args(p)
    p.add_argument(
        "--export-fp8",
        action="store_true",
        help="write DeepSeek-V3's FP8 block format (float8_e4m3fn + weight_scale_inv per block) instead of "
        "plain tensors (parallel.bridge.fp8.write_fp8_export; --verify checks the plain tensors first)",
    )
    args = p.parse_args(argv)
    for name in ("tp", "pp", "ep"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.max_shard_mb <= 0:
        p.error(f"--max-shard-mb={args.max_shard_mb} must be > 0")
    return args


def read_metadata(mcore_dir: Path) -> dict:
    """The conversion metadata of ``mcore_dir``; a ``ToolError`` naming what is wrong."""
    from parallel.checkpoint import COMPLETE_MARKER, is_complete_checkpoint, verify_dist_checkpoint

    if not mcore_dir.is_dir():
        raise ToolError(f"--mcore-dir {mcore_dir} is not a directory")
    path = mcore_dir / METADATA_FILE
    if not path.is_file():
        raise ToolError(
            f"{mcore_dir} has no {METADATA_FILE}: not a checkpoint written by `megatron-rl convert hf-to-mcore`"
        )
    if not is_complete_checkpoint(mcore_dir):
        raise ToolError(f"{mcore_dir} is not a complete checkpoint (no {COMPLETE_MARKER}); was its save interrupted?")
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise ToolError(f"{path}: not valid JSON: {exc}") from None
    missing = [
        k
        for k in ("format_version", "architecture", "hf_config", "layout", "dtype", "make_vocab_size_divisible_by")
        if k not in meta
    ]
    if missing:
        raise ToolError(f"{path}: missing keys {missing}")
    if meta["format_version"] > METADATA_VERSION:
        raise ToolError(
            f"{path}: format_version {meta['format_version']} is newer than this tool reads "
            f"({METADATA_VERSION}); update megatron_rl"
        )
    damage = verify_dist_checkpoint(mcore_dir)  # truncated or missing .distcp files, named before any rank starts
    if damage:
        raise ToolError(f"{mcore_dir} is damaged: {'; '.join(damage)}")
    return meta


def export_ranks(rank: int, world: int, spec: dict) -> dict:
    """One rank: build the model at the layout (empty storage), stream the HF safetensors into
    ``spec["tmp"]`` (rank 0 writes) loading each bucket's parameters from the dist checkpoint just
    before it is sent and releasing them after, then (verify) reload and compute logits on rank 0."""
    from megatron_rl.models.families import get_family
    from parallel.bridge import ExportStats, save_hf_checkpoint
    from parallel.checkpoint import PartialLoad, load_model
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh
    from megatron_rl.convert.streamed_model import build_empty_model, restore_storage
    from megatron_rl.convert.verify import verify_forwards

    pc = ParallelConfig.from_dict(spec["layout"])
    model_cfg, tmp = spec["model_cfg"], Path(spec["tmp"])
    mesh = init_mesh(pc)
    stages = ["build model", "load + export HF safetensors, bucket by bucket"]
    progress = Progress(
        stages + (["verify: reload + forward"] if spec["verify_ids"] is not None else []), enabled=rank == 0
    )
    try:
        with progress:
            progress.stage(stages[0])
            # On the meta device, then empty CPU storage that the checkpoint fills (no init, no copy).
            chunks = build_empty_model(model_cfg, pc)
            progress.stage(stages[1])
            stats = ExportStats()
            done = progress.watch(tmp, spec["expected_bytes"])
            try:
                # A rank holds the parameters of one export bucket at a time, never its shard.
                save_hf_checkpoint(
                    chunks,
                    get_family(spec["architecture"]).weight_map(model_cfg),
                    tmp,
                    spec["hf_config"],
                    mesh=mesh,
                    max_shard_bytes=spec["max_shard_bytes"],
                    stats=stats,
                    staging=PartialLoad(chunks, spec["mcore_dir"]),
                )
            finally:
                done.set()
            logits = None
            if spec["verify_ids"] is not None:
                progress.stage("verify: reload + forward")
                restore_storage(chunks)
                load_model(chunks, spec["mcore_dir"], in_place_merges=True)
                logits = verify_forwards(
                    chunks, model_cfg, pc, mesh, spec["verify_ids"], spec["verify_dtypes"], release=True
                )
        peaks = rank_peaks()  # before the groups go
    finally:
        destroy_mesh(mesh)
    return {
        "logits": logits,
        "num_tensors": stats.num_tensors,
        "bytes": stats.total_bytes,
        "num_buckets": stats.num_buckets,
        "peaks": peaks,
    }


def _config_text(meta: dict, mcore_dir: Path) -> str:
    """config.json: the original file, with its dtype field updated if the weights changed dtype,
    and without a ``quantization_config`` (an FP8 source was dequantised on load; the export
    writes plain tensors, which a loader told they are block-quantised would misread)."""
    original = mcore_dir / "config.json"
    text = original.read_text() if original.is_file() else json.dumps(meta["hf_config"], indent=2) + "\n"
    config = json.loads(text)
    keys = [k for k in ("dtype", "torch_dtype") if k in config]
    if any(config[k] != meta["dtype"] for k in keys) or "quantization_config" in config:
        config.update({k: meta["dtype"] for k in keys})
        config.pop("quantization_config", None)
        text = json.dumps(config, indent=2) + "\n"
    return text


def _mtp_file(meta: dict, mcore_dir: Path):
    """The file of multi-token-prediction tensors ``convert_hf_to_mcore`` carried beside the dist
    checkpoint (``meta["mtp_file"]``, holding exactly ``meta["mtp_tensors"]``); None when there are none."""
    if not meta.get("mtp_tensors"):
        return None
    from safetensors import safe_open

    path = mcore_dir / meta["mtp_file"]
    if not path.is_file():
        raise ToolError(
            f"{mcore_dir}: {meta['mtp_file']} (the source's {len(meta['mtp_tensors'])} MTP tensors) is missing"
        )
    try:
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file, named
        raise ToolError(f"{path}: not a readable safetensors file: {exc}") from None
    if sorted(names) != sorted(meta["mtp_tensors"]):
        raise ToolError(f"{path}: holds {sorted(set(names) ^ set(meta['mtp_tensors']))[:5]} unlike its metadata")
    return path


def _convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    prestart(args.device)  # a no-op when main started it: the fork server imports Megatron while we check
    import torch

    from megatron_rl.models.families import get_family
    from megatron_rl.convert.verify import check_logits, verify_inputs, verify_settings

    mcore_dir = Path(args.mcore_dir).resolve()
    meta = read_metadata(mcore_dir)
    out = check_output_dir(args.out_dir, args.overwrite, mcore_dir)
    family = get_family(meta["architecture"])
    # transformers' config class, without its docstring imports
    model_cfg = family.model_config(
        fast_hf_config(meta["hf_config"]),
        make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
        params_dtype=meta["dtype"],
    )
    pc, world, device, layout = resolve_layout(args, model_cfg, stored=meta["layout"])
    # The tokenizer's size, and --verify's prompt ids, from tokenizer.json where that is exact.
    tokenizer = fast_tokenizer_size(mcore_dir)
    encoder = FastEncoder(mcore_dir) if args.verify and tokenizer is not None else None
    if tokenizer is None:
        tokenizer = encoder = load_tokenizer(mcore_dir)
    check_tokenizer(tokenizer, model_cfg.vocab_size, mcore_dir)
    verify_ids, lengths = (
        verify_inputs(encoder, model_cfg.vocab_size, pc.tensor_model_parallel_size) if args.verify else (None, None)
    )
    verify_dtypes = verify_settings(args, meta["dtype"])
    extra = [f for f in side_files(mcore_dir) if f.name != "config.json"]
    mtp = _mtp_file(meta, mcore_dir)  # the MTP layers carried from the HF source, checked before any rank starts
    itemsize = torch.empty((), dtype=model_cfg.dtype).element_size()
    ensure_space(out, int(meta.get("hf_numel", 0)) * itemsize, "the HF checkpoint")  # before any rank starts
    if is_driver():
        print(
            f"converting {family.name} Megatron checkpoint {mcore_dir} ({fmt_bytes(dir_bytes(mcore_dir))}, "
            f"{meta['dtype']}) to HF safetensors at {layout} on {world} {device} ranks",
            flush=True,
        )

    diff, result = None, None
    atomic = AtomicDir(out, args.overwrite)
    memory = TreeMemory()  # the ranks are this process's descendants (not under torchrun)
    with atomic as tmp, memory if not under_torchrun() else contextlib.nullcontext():
        spec = dict(
            layout=pc.to_dict(),
            model_cfg=model_cfg,
            architecture=meta["architecture"],
            hf_config=meta["hf_config"],
            mcore_dir=str(mcore_dir),
            tmp=str(tmp),
            verify_ids=verify_ids,
            verify_dtypes=verify_dtypes,
            max_shard_bytes=int(args.max_shard_mb * 2**20),
            expected_bytes=int(meta.get("hf_numel", 0)) * itemsize,
        )
        result = launch(export_ranks, world, spec, device=device)
        if is_driver():
            copy_files(extra, tmp)
            if mtp:
                from parallel.bridge.mtp import add_mtp_shard

                add_mtp_shard(tmp, mtp)
            (tmp / "config.json").write_text(_config_text(meta, mcore_dir))
            if args.verify:
                diff = max(
                    check_logits(result["logits"], tmp, verify_ids, model_cfg.dtype, lengths, args.tolerance).values()
                )
            if args.export_fp8:  # the source's FP8 scales are kept where its weights are unchanged
                from parallel.bridge.fp8 import fp8_block_size, write_fp8_export

                write_fp8_export(tmp, block=fp8_block_size(meta["hf_config"]), source_dir=meta.get("source"))
            atomic.commit()
    if is_driver():
        carried = f" + {len(meta['mtp_tensors'])} MTP tensors carried" if mtp else ""
        line = (
            f"done: {family.name} {mcore_dir} -> {out} ({result['num_tensors']} tensors{carried}, "
            f"{fmt_bytes(result['bytes'])} of weights, {fmt_bytes(dir_bytes(out))} on disk) from {layout} on "
            f"{world} {device} ranks, {meta['dtype']}, in {time.perf_counter() - start:.1f} s, "
            f"{peak_summary(result['peaks'], memory.peak)}"
        )
        print(line + (f", max |logit diff| {diff:.3e}" if diff is not None else ""), flush=True)
    return 0


def main(argv=None, prog: str = "convert_mcore_to_hf.py") -> int:
    """Parse ``argv`` and convert; returns the exit code (0 ok, 1 error, 2 bad usage)."""
    prestart_for(argv, ("--mcore-dir", "--out-dir"))  # before torch is imported (the verify flags import it)
    try:
        args = _parse(argv, prog)
    except SystemExit as exc:  # argparse: --help (0) or bad usage (2)
        return int(exc.code or 0)
    return run_main(lambda: _convert(args), output=args.out_dir)


if __name__ == "__main__":
    # Spawned ranks find ``export_ranks`` by its module name, so run the importable copy.
    from megatron_rl.convert import mcore_to_hf

    exit_now(mcore_to_hf.main())
