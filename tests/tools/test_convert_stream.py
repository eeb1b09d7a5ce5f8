"""The converters' streaming model (``megatron_rl.convert.streamed_model.build_empty_model``: meta device, then empty
storage the loader reads into) writes the same distributed checkpoint as a model built and
initialised the classic way: on 2 gloo ranks at TP=2 and PP=2 (dense Qwen3) and EP=2 (Qwen3-MoE),
every parameter is bit-identical after ``load_hf_checkpoint`` and the sharded state dict that
``dist_checkpointing.save`` writes has the same keys, shard metadata and values; the streamed way back
(each export bucket loaded from the dist checkpoint just before it is sent) writes the source's HF
tensors bit for bit, holding at most two buckets of parameters per rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed

LAYOUTS = (
    ("qwen3", {"tensor_model_parallel_size": 2}),
    ("qwen3", {"pipeline_model_parallel_size": 2}),
    ("qwen3_moe", {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}),
)


def _leaves(chunks) -> dict:
    """{(chunk, key, offsets): (global shape, replica id, axis fragmentations, dtype, data)} of the
    state dict ``save_model`` writes (factories applied, as the save applies them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    out = {}
    for v, chunk in enumerate(chunks):
        state = chunk.sharded_state_dict()
        apply_factories(state)
        for leaf in nested_values(state):
            if isinstance(leaf, ShardedTensor):
                out[(v, leaf.key, leaf.global_offset)] = (
                    leaf.global_shape,
                    leaf.replica_id,
                    leaf.axis_fragmentations,
                    leaf.data.dtype,
                    leaf.data.clone(),
                )
            elif isinstance(leaf, ShardedObject):
                out[(v, leaf.key, leaf.global_offset)] = (leaf.global_shape, leaf.replica_id)
    return out


def _compare(rank: int, world: int, cases: list) -> list:
    from megatron_rl.models.families import get_family, load_hf_config
    from megatron_rl.models.gpt import build_model, build_transformer_config
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh
    from megatron_rl.convert.support import NO_INIT
    from megatron_rl.convert.streamed_model import build_empty_model

    counts = []
    for hf_dir, layout in cases:
        hf_config = load_hf_config(hf_dir)
        family = get_family(hf_config)
        model_cfg = family.model_config(hf_config, params_dtype="bfloat16")
        pc = ParallelConfig.from_dict(layout)
        mesh = init_mesh(pc)
        try:
            classic = build_model(model_cfg, build_transformer_config(model_cfg, pc, **NO_INIT))
            empty = build_empty_model(model_cfg, pc)
            for chunks in (classic, empty):
                load_hf_checkpoint(chunks, family.weight_map(model_cfg), hf_dir, mesh=mesh)
            for a, b in zip(classic, empty):
                pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
                assert pa.keys() == pb.keys()
                for name in pa:
                    assert torch.equal(pa[name], pb[name]) and pa[name].dtype == pb[name].dtype, name
                    assert vars(pa[name]) == vars(pb[name]), name  # Megatron's TP attributes, their values too
            la, lb = _leaves(classic), _leaves(empty)
            assert la.keys() == lb.keys()
            for key, meta in la.items():
                assert meta[:-1] == lb[key][:-1], key
                if len(meta) == 5:
                    assert torch.equal(meta[-1], lb[key][-1]), key
            counts.append(len(la))
            ckpt = f"{hf_dir}-streamed-{len(counts)}"
            _streamed_save_round_trip(rank, classic, model_cfg, pc, family.weight_map(model_cfg), hf_dir, mesh, ckpt)
            _streamed_export(rank, model_cfg, pc, family.weight_map(model_cfg), hf_dir, hf_config, mesh, ckpt)
        finally:
            destroy_mesh(mesh)
    return counts


def _streamed_save_round_trip(rank, classic, model_cfg, pc, weight_map, hf_dir, mesh, out) -> None:
    """The converter's streamed save (checked reads deferred, each tensor read just before the
    in-process writer writes it and released after) writes a checkpoint that loads back equal to
    the classic model; nothing is read before the save, and rank 0 (which writes every tensor it
    holds) ends it holding no parameter bytes."""
    from parallel.bridge import load_hf_checkpoint
    from parallel.checkpoint import load_model, save_model
    from megatron_rl.convert.streamed_model import StreamedSave, build_empty_model, restore_storage

    chunks = build_empty_model(model_cfg, pc)
    deferred = load_hf_checkpoint(chunks, weight_map, hf_dir, mesh=mesh, deferred=True).deferred
    assert deferred.bytes_read == 0
    streamed = StreamedSave(chunks, deferred)
    save_model(streamed.chunks, out, writer_threads=1, in_process=True, write_hooks=streamed)
    assert deferred.bytes_read > 0
    deferred.close()
    if rank == 0:
        held = [n for c in chunks for n, p in c.named_parameters() if p.untyped_storage().nbytes()]
        assert held == [], held
    restore_storage(chunks)
    load_model(chunks, out)
    for a, b in zip(classic, chunks):
        pb = dict(b.named_parameters())
        for name, param in a.named_parameters():
            assert torch.equal(param, pb[name]) and param.dtype == pb[name].dtype, name


BUCKET = 16 * 2**10
"""Export buckets of the streamed export test: a tiny model's export takes dozens of them."""


def _streamed_export(rank, model_cfg, pc, weight_map, hf_dir, hf_config, mesh, ckpt) -> None:
    """The way back streamed (``convert_mcore_to_hf``: ``save_hf_checkpoint`` with ``PartialLoad`` as
    its staging): the HF files are bit-identical to the source, each rank holds the parameters of
    at most two buckets (or one oversized item) at a time, and none once it is done."""
    from safetensors.torch import load_file

    from parallel.bridge import save_hf_checkpoint
    from parallel.checkpoint import PartialLoad
    from megatron_rl.convert.streamed_model import build_empty_model

    class Recorder(PartialLoad):
        """``PartialLoad`` counting the bytes it holds loaded."""

        def __init__(self, *args):
            super().__init__(*args)
            self.held, self.peak, self.loads, self.largest = {}, 0, 0, 0

        def load(self, tensors):
            tensors = list(tensors)
            super().load(tensors)
            self.loads += 1
            for t in tensors:
                self.held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                self.largest = max(self.largest, t.untyped_storage().nbytes())
            self.peak = max(self.peak, sum(self.held.values()))

        def release(self, tensors):
            for t in tensors:
                self.held.pop(t.untyped_storage().data_ptr(), None)
            super().release(tensors)

    chunks = build_empty_model(model_cfg, pc)
    staging = Recorder(chunks, ckpt)
    out = f"{ckpt}-hf"
    save_hf_checkpoint(chunks, weight_map, out, hf_config, mesh=mesh, bucket_bytes=BUCKET, staging=staging)
    assert staging.loads > 10, staging.loads  # many buckets, one collective load each, on every rank
    assert staging.held == {}
    if torch.distributed.get_world_size() > 1:  # one rank loads everything at once (PartialLoad's docstring)
        assert staging.peak <= 2 * max(BUCKET, staging.largest), (staging.peak, staging.largest)
    held = [n for c in chunks for n, p in c.named_parameters() if p.untyped_storage().nbytes()]
    assert held == [], held
    # A write that fails in rank 0's background writer fails the export on every rank, leaving nothing.
    from parallel.bridge import hf_files

    write, failed = hf_files.SafetensorsStreamWriter.write, f"{ckpt}-hf-failed"
    if rank == 0:
        calls = []

        def failing(self, name, tensor):
            calls.append(name)
            if len(calls) == 5:
                raise OSError(28, "No space left on device")
            write(self, name, tensor)

        hf_files.SafetensorsStreamWriter.write = failing
    try:
        chunks = build_empty_model(model_cfg, pc)
        with pytest.raises(OSError, match="No space left on device"):
            save_hf_checkpoint(
                chunks, weight_map, failed, hf_config, mesh=mesh, bucket_bytes=BUCKET, staging=PartialLoad(chunks, ckpt)
            )
    finally:
        hf_files.SafetensorsStreamWriter.write = write
    torch.distributed.barrier()  # rank 0 has cleaned up
    assert not Path(failed).exists() and not list(Path(failed).parent.glob(f".{Path(failed).name}*"))
    if rank == 0:
        source, written = {}, {}
        for files, into in (
            (sorted(Path(hf_dir).glob("*.safetensors")), source),
            (sorted(Path(out).glob("*.safetensors")), written),
        ):
            for f in files:
                into.update(load_file(f))
        assert sorted(written) == sorted(source)
        assert [
            n for n in source if written[n].dtype != source[n].dtype or not torch.equal(written[n], source[n])
        ] == []


def _one_rank_export(rank: int, world: int, hf_dir: str) -> None:
    from megatron_rl.models.families import get_family, load_hf_config
    from parallel.bridge import load_hf_checkpoint
    from parallel.checkpoint import save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh
    from megatron_rl.convert.streamed_model import build_empty_model

    hf_config = load_hf_config(hf_dir)
    family = get_family(hf_config)
    model_cfg = family.model_config(hf_config, params_dtype="bfloat16")
    pc = ParallelConfig.from_dict({})
    mesh = init_mesh(pc)
    try:
        chunks = build_empty_model(model_cfg, pc)
        load_hf_checkpoint(chunks, family.weight_map(model_cfg), hf_dir, mesh=mesh)
        save_model(chunks, f"{hf_dir}-one", writer_threads=1, in_process=True)
        _streamed_export(rank, model_cfg, pc, family.weight_map(model_cfg), hf_dir, hf_config, mesh, f"{hf_dir}-one")
    finally:
        destroy_mesh(mesh)


def test_streamed_export_on_one_rank(tmp_path):
    """A world of one: the export in small buckets still writes the source bit for bit (Megatron's
    partial load cannot run there; ``PartialLoad`` reads everything at its first load)."""
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    hf_dir = build_tiny_hf_checkpoint(tmp_path / "qwen3", "qwen3", dtype=torch.bfloat16)["path"]
    run_distributed(_one_rank_export, 1, str(hf_dir), timeout_s=300)


def test_save_model_refuses_bad_writer_settings(tmp_path):
    from parallel.checkpoint import save_model

    with pytest.raises(ValueError, match="writer_threads=0 is not allowed"):
        save_model([], tmp_path / "a", writer_threads=0)
    with pytest.raises(ValueError, match="write_hooks need in_process=True"):
        save_model([], tmp_path / "b", write_hooks=object())


def test_streaming_model_writes_the_classic_checkpoint(tmp_path):
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    dirs = {f: build_tiny_hf_checkpoint(tmp_path / f, f, dtype=torch.bfloat16)["path"] for f in ("qwen3", "qwen3_moe")}
    cases = [(str(dirs[family]), layout) for family, layout in LAYOUTS]
    counts = run_distributed(_compare, 2, cases, timeout_s=600)
    assert all(n > 10 for rank in counts for n in rank), counts  # ShardedTensors compared per rank and case


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_sliced_reads_equal_safetensors(tmp_path, dim, monkeypatch):
    """``HFCheckpointReader.read`` (pread, blocks of rows for a later dimension) returns what
    safetensors' own slicing returns, into a new tensor or a given one."""
    from safetensors.torch import save_file

    import parallel.bridge.hf_files as hf_files
    from parallel.bridge.hf_files import HFCheckpointReader

    gen = torch.Generator().manual_seed(dim)
    tensors = {
        "w": torch.randn(6, 10, 4, generator=gen).to(torch.bfloat16),
        "b": torch.randn(1, 9, 3, generator=gen),
        "s": torch.tensor(2.5),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(hf_files, "_BLOCK_BYTES", 100)  # several blocks per column slice
    with HFCheckpointReader(tmp_path) as reader:
        assert torch.equal(reader.read("s"), tensors["s"])
        for name in ("w", "b"):
            x = tensors[name]
            assert torch.equal(reader.read(name), x)
            start, stop = (1, x.shape[dim] - 1) if x.shape[dim] > 2 else (0, x.shape[dim])
            want = x.narrow(dim, start, stop - start)
            assert torch.equal(reader.read(name, dim, start, stop), want)
            out = torch.empty_like(want)
            assert reader.read(name, dim, start, stop, out=out) is out and torch.equal(out, want)
        with pytest.raises(ValueError, match="into a"):
            reader.read("w", 0, 0, 2, out=torch.empty(3, 10, 4, dtype=torch.bfloat16))


def test_in_place_merge_only_where_the_halves_tile_the_parameter():
    from parallel.checkpoint import _tiles

    data = torch.arange(24.0).reshape(6, 4)
    gate, up = torch.chunk(data, 2, dim=0)
    assert _tiles([gate, up], data)  # torch.cat([gate, up]) is data itself: no copy needed
    assert torch.equal(torch.cat([gate, up]), data)
    assert not _tiles([up, gate], data)  # another order: the merge must concatenate
    assert not _tiles([gate.clone(), up], data)  # a copy: not loaded into the parameter
    assert not _tiles([gate], data)  # does not cover it
    assert not _tiles(torch.chunk(data, 2, dim=1), data)  # split along another dim
