"""Convert a Hugging Face checkpoint into a Megatron-Core distributed checkpoint at a given layout.

    python tools/convert_hf_to_mcore.py --hf-dir Qwen3-8B --out-dir qwen3-8b-mcore --tp 2 --pp 2 --verify
    torchrun --nproc-per-node 8 tools/convert_hf_to_mcore.py --hf-dir ... --out-dir ... --tp 8   # GPUs
    megatron-rl convert hf-to-mcore --hf-dir ... --out-dir ... --tp 2

On CPU the ranks are spawned here (gloo); under torchrun the launched processes are the ranks.
Each rank reads only the slices of the safetensors it owns (``parallel.bridge``) and the model
is saved with ``megatron.core.dist_checkpointing`` (loadable at any other layout). Next to it go
config.json, generation_config.json, the tokenizer files and ``megatron_rl_conversion.json``
(family, HF config, layout, dtype), so ``convert_mcore_to_hf.py`` needs no other arguments.
DeepSeek-V3 / GLM-4.5 multi-token-prediction layers (not built by the model) are checked, then
carried bit for bit in ``mtp/mtp.safetensors`` (their names in the metadata's ``mtp_tensors``).
By default the directory is a Megatron-LM ``--load`` directory (``megatron_rl.convert.megatron_lm``):
``latest_checkpointed_iteration.txt`` = ``release``, the dist checkpoint in ``release/``, and
``megatron_args.json`` (the ``pretrain_gpt.py`` arguments); ``--ckpt-layout flat`` puts the dist
checkpoint files directly in ``--out-dir``.
The output is built in a hidden sibling directory and renamed into place at the end: an error
(or a failed ``--verify``) leaves no output directory. ``--verify`` reloads the written
checkpoint and compares its logits with the HF model's (transformers) on a few fixed prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

# Nothing imported here loads torch or transformers: ``main`` starts the ranks' fork server first.
from megatron_rl.convert.support import (
    DTYPES,
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
from megatron_rl.convert.fault import apply_fault
from megatron_rl.convert.launch import (
    add_layout_args,
    is_driver,
    launch,
    prestart,
    prestart_for,
    resolve_layout,
    under_torchrun,
)
from megatron_rl.convert.output import AtomicDir, Progress, TreeMemory, check_output_dir, peak_summary, rank_peaks


def _parse(argv=None, prog: str = "convert_hf_to_mcore.py") -> argparse.Namespace:
    from megatron_rl.convert.verify import add_verify_args

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--out-dir", required=True, help="Megatron checkpoint directory to create")
    add_layout_args(p, required=True)
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="parameter dtype of the Megatron checkpoint (auto: config.json's dtype, else fp32)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the embedding to a multiple of this x TP (Megatron-LM's default 128)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out-dir")
    p.add_argument(
        "--ckpt-layout",
        choices=("megatron-lm", "flat"),
        default="megatron-lm",
        help="megatron-lm (default): Megatron-LM's --load layout (latest_checkpointed_iteration.txt = "
        "release, the dist checkpoint in release/, megatron_args.json beside it); flat: the dist "
        "checkpoint files directly in --out-dir (older conversions; both are read back)",
    )
    add_verify_args(p)
    args = p.parse_args(argv)
    for name in ("tp", "pp", "ep", "make_vocab_size_divisible_by"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def _model_dtype(arg: str, hf_config) -> str:
    if arg != "auto":
        return DTYPES[arg]
    name = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32")
    name = name.replace("torch.", "")
    return name if name in DTYPES.values() else "float32"


def convert_ranks(rank: int, world: int, spec: dict) -> dict:
    """One rank: build the model at the layout, load the HF weights it owns, save the dist
    checkpoint into ``spec["tmp"]``; with verify, reload it and compute logits (rank 0 gets them)."""
    import torch

    from megatron_rl.models.families import get_family
    from parallel.bridge import load_hf_checkpoint
    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh
    from megatron_rl.convert.streamed_model import StreamedSave, build_empty_model, fork_write_queue, restore_storage
    from megatron_rl.convert.verify import verify_forwards
    from megatron_rl.convert.verify_hf import _unmap_freed_blocks

    marks = {"started": time.time()}  # wall clock: the driver's start is spec["t0"]
    # Each tensor the streamed save releases, and each module's float32 copy the verify drops, goes
    # back to the system at once (glibc would keep blocks under 32 MiB in its heap).
    _unmap_freed_blocks()
    pc = ParallelConfig.from_dict(spec["layout"])
    model_cfg, tmp = spec["model_cfg"], Path(spec["tmp"])
    ckpt = tmp / spec["ckpt_subdir"] if spec["ckpt_subdir"] else tmp
    mesh = init_mesh(pc)
    fork_write_queue()  # before the weights exist
    stages = ["build model", "check HF weights", "read + save dist checkpoint"]
    progress = Progress(
        stages + (["verify: reload + forward"] if spec["verify_ids"] is not None else []), enabled=rank == 0
    )
    try:
        with progress:
            progress.stage(stages[0])
            # On the meta device, then empty CPU storage: no init, no float32 master weights.
            chunks = build_empty_model(model_cfg, pc)
            marks["built"] = time.time()
            progress.stage(stages[1])
            weight_map = apply_fault(get_family(spec["architecture"]).weight_map(model_cfg), model_cfg)
            # Every check, no read: each parameter is read just before the writer writes it, and
            # released right after (StreamedSave), so a rank never holds its whole shard.
            report = load_hf_checkpoint(chunks, weight_map, spec["hf_dir"], mesh=mesh, deferred=True)
            marks["read"] = time.time()
            progress.stage(stages[2])
            done = progress.watch(tmp, spec["expected_bytes"])
            try:
                streamed = StreamedSave(chunks, report.deferred)
                # One .distcp file per rank, written by the rank itself: no writer process holding a
                # copy-on-write image of it (the writer fsyncs each file as Megatron's does).
                # checkpoint_version 3.0: Megatron-LM would otherwise treat it as a pre-2.0 checkpoint.
                save_model(
                    streamed.chunks,
                    ckpt,
                    metadata={"family": spec["family"], "layout": spec["layout"]},
                    common={"checkpoint_version": 3.0, "iteration": 0},
                    writer_threads=1,
                    in_process=True,
                    write_hooks=streamed,
                )
                del streamed
            finally:
                done.set()
                bytes_read = report.deferred.bytes_read
                report.deferred.close()
            marks["saved"] = time.time()
            logits = None
            if spec["verify_ids"] is not None:
                progress.stage("verify: reload + forward")
                restore_storage(chunks)
                with torch.no_grad():  # every value the forward sees must come from the files just written
                    for chunk in chunks:
                        for param in chunk.parameters():
                            param.fill_(float("nan"))
                load_model(chunks, ckpt, in_place_merges=True)  # fc1 loads into its halves: no copy
                logits = verify_forwards(
                    chunks, model_cfg, pc, mesh, spec["verify_ids"], spec["verify_dtypes"], release=True
                )
        peaks = rank_peaks()  # before the groups go
    finally:
        destroy_mesh(mesh)
    return {
        "logits": logits,
        "bytes_read": bytes_read,
        "checkpoint_bytes": report.checkpoint_bytes,
        "peaks": peaks,
        "marks": marks,
    }


def _timings(result: dict, t0: float) -> str:
    """Where the time went, from rank 0's marks: until the ranks ran, the model build, the read, the save."""
    m = result["marks"]
    both = m["saved"] - m["read"]
    return (
        f"ranks up at {m['started'] - t0:.1f} s, model built in {m['built'] - m['started']:.1f} s, HF weights "
        f"checked in {m['read'] - m['built']:.1f} s, rank 0 read and saved {fmt_bytes(result['bytes_read'])} in "
        f"{both:.1f} s ({result['bytes_read'] / 2**20 / max(both, 1e-3):.0f} MB/s)"
    )


def _check_mtp(hf_dir: Path, mtp):
    """The family's MTP layout when ``hf_dir`` holds MTP tensors (all checked), else None."""
    from parallel.bridge import HFCheckpointReader
    from parallel.bridge.fp8 import open_dequantizing
    from parallel.bridge.mtp import num_mtp_layers

    if mtp is None:
        return None
    count = num_mtp_layers(hf_dir)
    with open_dequantizing(HFCheckpointReader(hf_dir), hf_dir) as reader:
        errors = mtp.check(reader, count)
        if errors:
            raise ToolError(
                f"{hf_dir}: bad multi-token-prediction layers (num_nextn_predict_layers={count}): " + "; ".join(errors)
            )
        return mtp if mtp.names(reader, count) else None


def _copy_mtp(hf_dir: Path, mtp, tmp: Path) -> list[str]:
    """Carry the (checked) MTP tensors, not built by the model, bit for bit into ``tmp/MTP_FILE``,
    streamed one tensor at a time; their names."""
    if mtp is None:
        return []
    from parallel.bridge import HFCheckpointReader
    from parallel.bridge.fp8 import open_dequantizing
    from parallel.bridge.mtp import MTP_FILE, copy_mtp_tensors, num_mtp_layers

    with open_dequantizing(HFCheckpointReader(hf_dir), hf_dir) as reader:
        names = mtp.names(reader, num_mtp_layers(hf_dir))
        copy_mtp_tensors(reader, names, tmp / MTP_FILE)
    return sorted(names)


def _convert(args: argparse.Namespace) -> int:
    start, t0 = time.perf_counter(), time.time()
    prestart(args.device)  # the ranks' fork server imports Megatron while we check the inputs
    import torch

    import megatron_rl
    from megatron_rl.models.families import get_family
    from parallel.bridge import HFCheckpointReader
    from parallel.bridge.mtp import MTP_FILE
    from megatron_rl.convert.verify import check_logits, verify_inputs, verify_settings

    hf_dir = Path(args.hf_dir).resolve()
    if not (hf_dir / "config.json").is_file():
        raise ToolError(f"--hf-dir {hf_dir} holds no config.json (is it an HF checkpoint directory?)")
    # Cheap checks first: output directory, then the files (missing shards, truncated files), then
    # what needs transformers (family, layout, tokenizer) -- all before any rank starts.
    out = check_output_dir(args.out_dir, args.overwrite, hf_dir)
    with HFCheckpointReader(hf_dir) as reader:
        names = reader.keys()
        hf_bytes = sum(reader.nbytes(n) for n in names)
        hf_numel = sum(int(torch.Size(reader.shape(n)).numel()) for n in names)
    config_dict = json.loads((hf_dir / "config.json").read_text())
    hf_config = fast_hf_config(config_dict)  # transformers' config, without its docstring imports
    family = get_family(hf_config)
    architecture = next(a for a in hf_config.architectures if a in family.architectures)
    dtype = _model_dtype(args.dtype, hf_config)
    model_cfg = family.model_config(
        hf_config, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, params_dtype=dtype
    )
    pc, world, device, layout = resolve_layout(args, model_cfg)
    mtp = _check_mtp(hf_dir, family.weight_map(model_cfg).mtp)  # incomplete / mis-shaped: named, nothing written
    # The tokenizer's size, and --verify's prompt ids, from tokenizer.json where that is exact.
    tokenizer = fast_tokenizer_size(hf_dir)
    encoder = FastEncoder(hf_dir) if args.verify and tokenizer is not None else None
    if tokenizer is None:
        tokenizer = encoder = load_tokenizer(hf_dir)
    tokenizer_size = check_tokenizer(tokenizer, model_cfg.vocab_size, hf_dir)
    verify_ids, lengths = (
        verify_inputs(encoder, model_cfg.vocab_size, pc.tensor_model_parallel_size) if args.verify else (None, None)
    )
    verify_dtypes = verify_settings(args, dtype)
    extra = side_files(hf_dir)
    if is_driver():
        print(
            f"converting {family.name} checkpoint {hf_dir} ({len(names)} tensors, {fmt_bytes(hf_bytes)}) to a "
            f"Megatron checkpoint at {layout} on {world} {device} ranks, {dtype}",
            flush=True,
        )

    itemsize = torch.empty((), dtype=model_cfg.dtype).element_size()
    ensure_space(out, hf_numel * itemsize, "the Megatron checkpoint")  # before any rank starts
    diff = None
    atomic = AtomicDir(out, args.overwrite)
    memory = TreeMemory()  # the ranks are this process's descendants (not under torchrun)
    with atomic as tmp, memory if not under_torchrun() else contextlib.nullcontext():
        spec = dict(
            layout=pc.to_dict(),
            model_cfg=model_cfg,
            architecture=architecture,
            family=family.name,
            hf_dir=str(hf_dir),
            tmp=str(tmp),
            verify_ids=verify_ids,
            verify_dtypes=verify_dtypes,
            expected_bytes=hf_numel * itemsize,
            t0=t0,
            ckpt_subdir="release" if args.ckpt_layout == "megatron-lm" else "",
        )
        result = launch(convert_ranks, world, spec, device=device)
        if is_driver():
            copy_files(extra, tmp)
            mtp_names = _copy_mtp(hf_dir, mtp, tmp)
            metadata = dict(
                format_version=METADATA_VERSION,
                written_by="megatron_rl.convert.hf_to_mcore",
                megatron_rl_version=megatron_rl.__version__,
                family=family.name,
                architecture=architecture,
                dtype=dtype,
                layout=pc.to_dict(),
                world_size=world,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                hf_config=config_dict,
                hf_tensors=len(names),
                hf_numel=hf_numel,
                hf_bytes=hf_bytes,
                tokenizer_size=tokenizer_size,
                ckpt_layout=args.ckpt_layout,
                side_files=[f.name for f in extra],
                source=str(hf_dir),
                **({"mtp_file": MTP_FILE, "mtp_tensors": mtp_names} if mtp_names else {}),
            )
            (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
            if args.ckpt_layout == "megatron-lm":
                from megatron_rl.models.gpt import padded_vocab_size
                from megatron_rl.convert.megatron_lm import megatron_lm_args, write_megatron_lm_files

                padded = padded_vocab_size(
                    model_cfg.vocab_size, pc.tensor_model_parallel_size, model_cfg.make_vocab_size_divisible_by
                )
                write_megatron_lm_files(tmp, out, megatron_lm_args(model_cfg, pc, padded))
            if args.verify:
                diff = max(
                    check_logits(
                        result["logits"], hf_dir, verify_ids, model_cfg.dtype, lengths, args.tolerance
                    ).values()
                )
            atomic.commit()
    if is_driver():
        line = (
            f"done: {family.name} {hf_dir} ({len(names)} tensors, {fmt_bytes(hf_bytes)}) -> {out} "
            f"(Megatron dist checkpoint, {fmt_bytes(dir_bytes(out))}) at {layout} on {world} {device} ranks, "
            f"{dtype}, in {time.perf_counter() - start:.1f} s ({_timings(result, t0)}), "
            f"{peak_summary(result['peaks'], memory.peak)}"
        )
        print(line + (f", max |logit diff| {diff:.3e}" if diff is not None else ""), flush=True)
    return 0


def main(argv=None, prog: str = "convert_hf_to_mcore.py") -> int:
    """Parse ``argv`` and convert; returns the exit code (0 ok, 1 error, 2 bad usage)."""
    prestart_for(argv, ("--hf-dir", "--out-dir"))  # before torch is imported (the verify flags import it)
    try:
        args = _parse(argv, prog)
    except SystemExit as exc:  # argparse: --help (0) or bad usage (2)
        return int(exc.code or 0)
    return run_main(lambda: _convert(args), output=args.out_dir)


if __name__ == "__main__":
    # Spawned ranks find ``convert_ranks`` by its module name, so run the importable copy.
    from megatron_rl.convert import hf_to_mcore

    exit_now(hf_to_mcore.main())
