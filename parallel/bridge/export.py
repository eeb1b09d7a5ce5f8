"""A sharded Megatron model -> ``(hf_name, tensor)`` in buckets bounded in bytes."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.bridge.collective import all_gather_object
from parallel.bridge.hf_files import ST_DTYPES, HFTensorInfo
from parallel.bridge.rules import Run, WeightMap, WeightRule, full_hf_shapes, resolve_params, shard_runs

DEFAULT_BUCKET_BYTES = 128 * 2**20  # on CPU 64-128 MiB buckets export faster than 256+ (less allocation)
_TORCH_DTYPES = {str(d): d for d in ST_DTYPES}


@dataclasses.dataclass
class ExportStats:
    """Filled in by ``iter_weights``: how the export was bucketed and the most it held at once.

    ``max_live_bytes`` counts every buffer the generator held at the same moment (staging
    buffers and HF tensors, including ones that alias parameters); it never exceeds
    ``bucket_bytes + max_item_bytes``. A bucket is filled up to ``bucket_bytes`` unless one
    parameter alone is larger; a staged parameter briefly holds its staging buffers and its
    output, and a parameter larger than the bucket is staged in chunks of at most the bucket.
    "Item" = one Megatron parameter (all its TP shards) at max(parameter, export) element size.
    """

    bucket_bytes: int = 0
    num_buckets: int = 0
    num_tensors: int = 0
    total_bytes: int = 0
    max_item_bytes: int = 0
    max_bucket_bytes: int = 0
    max_live_bytes: int = 0
    live_bytes: int = 0

    def _add(self, n: int) -> None:
        self.live_bytes += n
        self.max_live_bytes = max(self.max_live_bytes, self.live_bytes)


@dataclasses.dataclass
class _Item:
    global_name: str
    rule: WeightRule
    hf_names: tuple[str, ...]
    num_shards: int
    partition_dim: Optional[int]
    shard_shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    holders: list[tuple[int, ...]]
    outputs: list[HFTensorInfo]
    nbytes: int
    """Planning size: all shards at max(parameter, export) element size."""
    row_bytes: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _sort_key(name: str) -> tuple:
    """Embedding, layers in numeric order, final norm, output layer."""
    section = 0 if name.startswith("embedding.") else 1 if name.startswith("decoder.layers.") else \
        2 if name.startswith("decoder.") else 3
    return (section, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])


class HFExporter:
    """Exports a sharded model's weights under HF names; construct on all ranks (collective).

    Construction gathers what every rank holds (names, shard indices, shapes; no tensor data)
    and fixes the export order, identical on all ranks; ``tensors`` lists what will be yielded.
    Build it once and call ``iter_weights`` after every update (weight sync): parameters are
    referenced, not copied. ``dtype`` casts the exported tensors (e.g. bfloat16 for inference).
    """

    def __init__(self, chunks: Iterable[torch.nn.Module], weight_map: WeightMap, *, mesh=None,
                 dtype: Optional[torch.dtype] = None, ignore: Sequence[str] = ()):
        self.weight_map = weight_map
        self.dtype = dtype
        params, _ = resolve_params(list(chunks), weight_map, mesh, ignore)
        params = [p for p in params if p.rule.export]
        self._local = {(p.global_name, p.shard): p.tensor for p in params}
        meta = [(p.global_name, p.shard, p.num_shards, p.partition_dim, tuple(p.tensor.shape), str(p.tensor.dtype))
                for p in params]
        by_name: dict[str, dict] = {}
        for rank, rank_meta in enumerate(all_gather_object(meta)):
            for name, shard, num, dim, shape, dtype_str in rank_meta:
                entry = by_name.setdefault(name, {"num": num, "dim": dim, "shapes": {}, "holders": {},
                                                  "dtype": _TORCH_DTYPES[dtype_str]})
                if entry["num"] != num or entry["dim"] != dim:
                    raise RuntimeError(f"{name}: ranks disagree on its sharding "
                                       f"({entry['num']}/{entry['dim']} vs {num}/{dim})")
                entry["shapes"][shard] = shape
                entry["holders"].setdefault(shard, []).append(rank)
        self.items: list[_Item] = []
        for name in sorted(by_name, key=_sort_key):
            e = by_name[name]
            if sorted(e["shapes"]) != list(range(e["num"])):
                raise RuntimeError(f"{name}: shards {sorted(e['shapes'])} of {e['num']} found on the ranks")
            rule, hf_names = weight_map.resolve(name)
            shapes = [e["shapes"][k] for k in range(e["num"])]
            out_dtype = dtype or e["dtype"]
            infos = [HFTensorInfo(n, s, out_dtype) for n, s in
                     zip(hf_names, full_hf_shapes(rule, e["num"], e["dim"], shapes[0], weight_map))]
            elem = max(_itemsize(e["dtype"]), _itemsize(out_dtype))
            self.items.append(_Item(name, rule, hf_names, e["num"], e["dim"], shapes, e["dtype"],
                                    [tuple(sorted(e["holders"][k])) for k in range(e["num"])], infos,
                                    sum(math.prod(s) for s in shapes) * elem, math.prod(shapes[0][1:]) * elem))
        self.tensors: list[HFTensorInfo] = [info for item in self.items for info in item.outputs]

    def _buckets(self, bucket_bytes: int) -> list[list[_Item]]:
        buckets: list[list[_Item]] = []
        current, size = [], 0
        for item in self.items:
            if current and size + item.nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(item)
            size += item.nbytes
        if current:
            buckets.append(current)
        return buckets

    def iter_weights(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, all_ranks: bool = False,
                     stats: Optional[ExportStats] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` in ``self.tensors`` order, bucket by bucket; collective.

        With ``all_ranks=False`` only global rank 0 yields (the others send it their shards);
        with ``all_ranks=True`` every rank yields everything (shards are broadcast). Either way
        every rank must exhaust the generator. Yielded tensors may share storage with the
        model's parameters: treat them as read-only and copy what must outlive the next update.

        Shards travel as row ranges straight into the rows of the output tensors where the
        layout allows (``copy`` along dim 0, ``vocab``, ``qkv``, ``gate_up``); column-split
        weights and dtype casts go through a staging buffer, in row chunks of at most
        ``bucket_bytes`` when one parameter alone exceeds the bucket.
        """
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        stats = stats if stats is not None else ExportStats()
        stats.bucket_bytes = bucket_bytes
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        yields = all_ranks or rank == 0
        # Where the parameters live now (an engine may have moved them since construction).
        self.device = next(iter(self._local.values())).device if self._local else torch.device("cpu")

        def moves(holders: tuple[int, ...]) -> bool:  # does this shard travel at all?
            return len(holders) < world if all_ranks else 0 not in holders

        for bucket in self._buckets(bucket_bytes):
            stats.num_buckets += 1
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, sum(i.nbytes for i in bucket))
            stats.max_item_bytes = max(stats.max_item_bytes, max(i.nbytes for i in bucket))
            oversize = len(bucket) == 1 and bucket[0].nbytes > bucket_bytes
            outputs: list[list[torch.Tensor]] = []
            staged: list[list[tuple[Run, torch.Tensor]]] = []
            received: list[set[int]] = []
            works = []
            for item in bucket:
                direct = self._direct(item)
                got = {k for k, h in enumerate(item.holders) if moves(h) and rank != h[0]} if yields else set()
                outs = self._alloc_outputs(item, stats, alias=not got) if yields and (direct or oversize) else []
                outputs.append(outs)
                staged.append([])
                received.append(got)
                for k, holders in enumerate(item.holders):
                    if not moves(holders):
                        continue
                    owner, local = holders[0], self._local.get((item.global_name, k))
                    for run in self._runs(item, k):
                        if direct:
                            dest = run.dest(outs, run.src_a, run.src_b) if k in got else None
                            works.append(_transfer(local, run.src_a, run.src_b, dest, owner, rank, all_ranks))
                        elif oversize:  # chunk by chunk: the output plus one chunk <= bucket + item
                            step = max(1, bucket_bytes // item.row_bytes)
                            for a in range(run.src_a, run.src_b, step):
                                b = min(a + step, run.src_b)
                                buf = self._stage(item, k, a, b, stats) if k in got else None
                                work = _transfer(local, a, b, buf, owner, rank, all_ranks)
                                if work is not None:
                                    work.wait()
                                if buf is not None:
                                    run.dest(outs, a, b).copy_(buf)
                                    stats._add(-_nbytes(buf))
                        else:
                            buf = self._stage(item, k, run.src_a, run.src_b, stats) if k in got else None
                            if buf is not None:
                                staged[-1].append((run, buf))
                            works.append(_transfer(local, run.src_a, run.src_b, buf, owner, rank, all_ranks))
            for work in works:
                if work is not None:
                    work.wait()
            if not yields:
                continue
            ready: list[tuple[str, torch.Tensor]] = []
            for item, outs, item_staged, got in zip(bucket, outputs, staged, received):
                if not outs:
                    outs = self._alloc_outputs(item, stats, alias=not got)
                for run, buf in item_staged:
                    run.dest(outs, run.src_a, run.src_b).copy_(buf)
                    stats._add(-_nbytes(buf))
                for k in range(item.num_shards):
                    local = self._local.get((item.global_name, k))
                    if k in got or outs[0] is local:
                        continue
                    for run in self._runs(item, k):
                        run.dest(outs, run.src_a, run.src_b).copy_(local[run.src_a: run.src_b])
                ready.extend(zip(item.hf_names, outs))
            del outputs, staged
            ready.reverse()
            while ready:
                name, tensor = ready.pop()
                nbytes = _nbytes(tensor)
                stats.num_tensors += 1
                stats.total_bytes += nbytes
                yield name, tensor
                del tensor
                stats._add(-nbytes)

    def _runs(self, item: _Item, k: int) -> list[Run]:
        return shard_runs(item.rule.transform, item.partition_dim, item.shard_shapes[k], k, self.weight_map)

    def _direct(self, item: _Item) -> bool:
        """Shards can be received straight into output rows (no column split, no cast)."""
        return self.dtype in (None, item.dtype) and not (item.rule.transform == "copy" and item.partition_dim == 1)

    def _alloc_outputs(self, item: _Item, stats: ExportStats, alias: bool) -> list[torch.Tensor]:
        """Output tensors of ``item``; with ``alias`` an unsplit local parameter is its own output."""
        local = self._local.get((item.global_name, 0))
        if alias and local is not None and item.num_shards == 1 and item.rule.transform == "copy" \
                and self._direct(item):
            outs = [local.detach()]
        else:
            outs = [torch.empty(i.shape, dtype=i.dtype, device=self.device) for i in item.outputs]
        stats._add(sum(_nbytes(t) for t in outs))
        return outs

    def _stage(self, item: _Item, k: int, a: int, b: int, stats: ExportStats) -> torch.Tensor:
        buf = torch.empty((b - a, *item.shard_shapes[k][1:]), dtype=item.dtype, device=self.device)
        stats._add(_nbytes(buf))
        return buf


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _transfer(local: Optional[torch.Tensor], a: int, b: int, dest: Optional[torch.Tensor], owner: int, rank: int,
              all_ranks: bool):
    """Move rows [a, b) of the owner's shard into ``dest``: broadcast, or point-to-point to rank 0."""
    if rank == owner:
        data = local.detach()[a:b]
        return dist.broadcast(data, src=owner, async_op=True) if all_ranks else dist.isend(data, dst=0)
    if all_ranks:
        return dist.broadcast(dest, src=owner, async_op=True)
    if dest is not None:
        return dist.irecv(dest, src=owner)
    return None


def export_hf_weights(chunks: Iterable[torch.nn.Module], weight_map: WeightMap, *, mesh=None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, all_ranks: bool = False,
                      dtype: Optional[torch.dtype] = None, ignore: Sequence[str] = (),
                      stats: Optional[ExportStats] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One-shot ``HFExporter(...).iter_weights(...)``; collective, exhaust it on every rank."""
    exporter = HFExporter(chunks, weight_map, mesh=mesh, dtype=dtype, ignore=ignore)
    yield from exporter.iter_weights(bucket_bytes=bucket_bytes, all_ranks=all_ranks, stats=stats)
