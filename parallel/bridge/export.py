"""A sharded Megatron model -> ``(hf_name, tensor)`` in buckets bounded in bytes.

With ``split=True`` (weight sync) the bucket bound also bounds the largest single piece: a
non-expert tensor larger than the bucket travels as row pieces named
``piece_name(hf_name, start, stop, rows)`` (``<hf_name>@rows=<start>:<stop>/<rows>``), each in
a bucket of its own, which the receiver reassembles with ``PieceAssembler`` before loading;
expert tensors are already exported one expert at a time and are never split, so a bucket
smaller than one expert shard is a ``ValueError`` (``HFExporter.check_bucket``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.bridge.collective import all_gather_object
from parallel.bridge.hf_files import ST_DTYPES, HFTensorInfo
from parallel.bridge.rules import Run, WeightMap, WeightRule, full_hf_shapes, resolve_params, shard_runs

PIECE_MARK = "@rows="  # <hf_name>@rows=<start>:<stop>/<rows>: rows [start, stop) of a split tensor
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
    num_pieces: int = 0
    """Row pieces of split tensors (``split=True``), counted in ``num_tensors`` too."""
    num_split_tensors: int = 0
    """HF tensors that travelled as pieces (``num_tensors - num_pieces + num_split_tensors`` whole tensors)."""
    max_piece_bytes: int = 0
    """Largest single tensor or piece yielded."""

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


@dataclasses.dataclass
class _Piece:
    """Rows [start, stop) of HF output ``which`` of an item larger than the bucket (``split``)."""

    item: _Item
    which: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        info = self.item.outputs[self.which]
        return piece_name(info.name, self.start, self.stop, info.shape[0])


def piece_name(hf_name: str, start: int, stop: int, rows: int) -> str:
    """The name rows [start, stop) of the ``rows``-row tensor ``hf_name`` travel under."""
    return f"{hf_name}{PIECE_MARK}{start}:{stop}/{rows}"


def parse_piece(name: str) -> Optional[tuple[str, int, int, int]]:
    """``(hf_name, start, stop, rows)`` of a piece name, None for a whole tensor's name."""
    m = re.fullmatch(r"(.+)" + re.escape(PIECE_MARK) + r"(\d+):(\d+)/(\d+)", name)
    if m is None:
        return None
    start, stop, rows = int(m.group(2)), int(m.group(3)), int(m.group(4))
    if not 0 <= start < stop <= rows:
        raise ValueError(f"weight piece {name!r}: rows {start}:{stop} do not lie in [0, {rows})")
    return m.group(1), start, stop, rows


class PieceAssembler:
    """Receiver side of ``split``: row pieces back into whole tensors, whole tensors passed on.

    ``feed(bucket)`` returns the bucket's whole tensors plus every tensor its pieces completed
    (a tensor's rows are copied into one buffer as they arrive; nothing else is held);
    ``pending`` names the tensors still incomplete (non-empty at the end of a sync: an error).
    """

    def __init__(self):
        self._partial: dict[str, tuple[torch.Tensor, set[tuple[int, int]], int]] = {}

    @property
    def pending(self) -> list[str]:
        return sorted(self._partial)

    def feed(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, tensor in bucket:
            piece = parse_piece(name)
            if piece is None:
                out.append((name, tensor))
                continue
            base, start, stop, rows = piece
            if tensor.shape[0] != stop - start:
                raise ValueError(f"weight piece {name!r} has {tensor.shape[0]} rows, its name says {stop - start}")
            if base not in self._partial:
                full = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
                self._partial[base] = (full, set(), 0)
            full, seen, filled = self._partial[base]
            if full.shape[1:] != tensor.shape[1:] or full.dtype != tensor.dtype or full.shape[0] != rows:
                raise ValueError(
                    f"weight piece {name!r} ({tuple(tensor.shape)}, {tensor.dtype}) does not fit "
                    f"{base!r} ({tuple(full.shape)}, {full.dtype})"
                )
            if any(a < stop and start < b for a, b in seen):
                raise ValueError(f"weight piece {name!r} overlaps rows already received for {base!r}")
            full[start:stop].copy_(tensor)
            seen.add((start, stop))
            filled += stop - start
            if filled == rows:
                del self._partial[base]
                out.append((base, full))
            else:
                self._partial[base] = (full, seen, filled)
        return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _sort_key(name: str) -> tuple:
    """Embedding, layers in numeric order, final norm, output layer."""
    prefixes = ("embedding.", "decoder.layers.", "decoder.")  # then everything else (the output layer)
    section = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), len(prefixes))
    return (section, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])


class HFExporter:
    """Exports a sharded model's weights under HF names; construct on all ranks (collective).

    Construction gathers what every rank holds (names, shard indices, shapes; no tensor data)
    and fixes the export order, identical on all ranks; ``tensors`` lists what will be yielded.
    Build it once and call ``iter_weights`` after every update (weight sync): parameters are
    referenced, not copied. ``dtype`` casts the exported tensors (e.g. bfloat16 for inference).
    """

    def __init__(
        self,
        chunks: Iterable[torch.nn.Module],
        weight_map: WeightMap,
        *,
        mesh=None,
        dtype: Optional[torch.dtype] = None,
        ignore: Sequence[str] = (),
    ):
        self.weight_map = weight_map
        self.dtype = dtype
        params, _ = resolve_params(list(chunks), weight_map, mesh, ignore)
        params = [p for p in params if p.rule.export]
        self._local = {(p.global_name, p.shard): p.tensor for p in params}
        meta = [
            (p.global_name, p.shard, p.num_shards, p.partition_dim, tuple(p.tensor.shape), str(p.tensor.dtype))
            for p in params
        ]
        by_name: dict[str, dict] = {}
        for rank, rank_meta in enumerate(all_gather_object(meta)):
            for name, shard, num, dim, shape, dtype_str in rank_meta:
                entry = by_name.setdefault(
                    name, {"num": num, "dim": dim, "shapes": {}, "holders": {}, "dtype": _TORCH_DTYPES[dtype_str]}
                )
                if entry["num"] != num or entry["dim"] != dim:
                    raise RuntimeError(
                        f"{name}: ranks disagree on its sharding ({entry['num']}/{entry['dim']} vs {num}/{dim})"
                    )
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
            infos = [
                HFTensorInfo(n, s, out_dtype)
                for n, s in zip(hf_names, full_hf_shapes(rule, e["num"], e["dim"], shapes[0], weight_map))
            ]
            elem = max(_itemsize(e["dtype"]), _itemsize(out_dtype))
            self.items.append(
                _Item(
                    name,
                    rule,
                    hf_names,
                    e["num"],
                    e["dim"],
                    shapes,
                    e["dtype"],
                    [tuple(sorted(e["holders"][k])) for k in range(e["num"])],
                    infos,
                    sum(math.prod(s) for s in shapes) * elem,
                    math.prod(shapes[0][1:]) * elem,
                )
            )
        self.tensors: list[HFTensorInfo] = [info for item in self.items for info in item.outputs]

    def check_bucket(self, bucket_bytes: int, what: Optional[str] = None) -> None:
        """``ValueError`` unless ``split`` can honour ``bucket_bytes``: every expert shard (one
        expert's tensors, never split) and one row of every other tensor must fit a bucket.
        ``what`` names the setting in the message (default ``bucket_bytes=<n>``)."""
        what = what or f"bucket_bytes={bucket_bytes}"
        if bucket_bytes < 1:
            raise ValueError(f"{what} must be >= 1 byte")
        for item in self.items:
            if item.rule.is_expert and item.nbytes > bucket_bytes:
                raise ValueError(
                    f"{what} ({bucket_bytes} bytes) is smaller than one expert shard: {item.global_name} -> "
                    f"{list(item.hf_names)} takes {item.nbytes} bytes (experts travel whole, one at a time); "
                    f"allowed: >= {item.nbytes} bytes ({item.nbytes / 2**20:.4g} MiB)"
                )
            if item.nbytes > bucket_bytes and self._piece_rows(item, 0, bucket_bytes) < 1:
                row = self._row_cost(item, 0)
                raise ValueError(
                    f"{what} ({bucket_bytes} bytes) is smaller than one row of {item.global_name} "
                    f"({row} bytes with its staging); allowed: >= {row} bytes"
                )

    def _row_cost(self, item: _Item, which: int) -> int:
        """Bytes one output row of a piece holds at once: the row, plus its staging when not direct."""
        info = item.outputs[which]
        row = math.prod(info.shape[1:]) * _itemsize(info.dtype)
        return row + (0 if self._direct(item) else item.row_bytes)

    def _piece_rows(self, item: _Item, which: int, bucket_bytes: int) -> int:
        return bucket_bytes // self._row_cost(item, which)

    def _buckets(self, bucket_bytes: int, split: bool = False) -> list:
        """Runs of items whose planning size fits ``bucket_bytes`` (one larger item alone); with
        ``split`` a larger non-expert item becomes row ``_Piece``s, one bucket each."""
        if split:
            self.check_bucket(bucket_bytes)
        buckets: list = []
        current, size = [], 0
        for item in self.items:
            if split and item.nbytes > bucket_bytes:
                if current:
                    buckets.append(current)
                    current, size = [], 0
                for which, info in enumerate(item.outputs):
                    step = self._piece_rows(item, which, bucket_bytes)
                    buckets.extend(
                        _Piece(item, which, a, min(a + step, info.shape[0])) for a in range(0, info.shape[0], step)
                    )
                continue
            if current and size + item.nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(item)
            size += item.nbytes
        if current:
            buckets.append(current)
        return buckets

    def iter_weights(
        self,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        all_ranks: bool = False,
        stats: Optional[ExportStats] = None,
        split: bool = False,
        staging=None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` in ``self.tensors`` order, bucket by bucket; collective.

        With ``all_ranks=False`` only global rank 0 yields (the others send it their shards);
        with ``all_ranks=True`` every rank yields everything (shards are broadcast). Either way
        every rank must exhaust the generator. Yielded tensors may share storage with the
        model's parameters: treat them as read-only and copy what must outlive the next update.

        Shards travel as row ranges straight into the rows of the output tensors where the
        layout allows (``copy`` along dim 0, ``vocab``, ``qkv``, ``gate_up``); column-split
        weights and dtype casts go through a staging buffer, in row chunks of at most
        ``bucket_bytes`` when one parameter alone exceeds the bucket. With ``split`` such a
        parameter is yielded as row pieces instead (module docstring), so no yielded tensor
        exceeds the bucket.

        ``staging``: parameters that are not in memory until asked for (a streamed conversion).
        An object whose ``load(tensors)`` fills this rank's shards of a bucket (called on every
        rank before each bucket, collective: possibly with none) and ``release(tensors)`` frees
        them once the bucket is consumed (no later bucket needs them).
        """
        stats = stats if stats is not None else ExportStats()
        for ready in self._produce(bucket_bytes, all_ranks, stats, split, staging):
            ready.reverse()
            while ready:
                name, tensor = ready.pop()
                nbytes = _nbytes(tensor)
                yield name, tensor
                del tensor
                stats._add(-nbytes)

    def iter_buckets(
        self, *, bucket_bytes: int, all_ranks: bool = False, stats: Optional[ExportStats] = None, split: bool = True
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``iter_weights`` one bucket (a list of pairs) at a time; collective.

        The generator keeps no reference to a bucket once it has yielded it: when the consumer
        drops each bucket before asking for the next (``parallel.transport.transfer`` does), at
        most one bucket's tensors plus the next one's staging are alive on this rank."""
        stats = stats if stats is not None else ExportStats()
        for ready in self._produce(bucket_bytes, all_ranks, stats, split, None):
            nbytes = sum(_nbytes(t) for _, t in ready)
            yield ready
            del ready
            stats._add(-nbytes)

    def _shards_of(self, bucket) -> dict[tuple[str, int], torch.Tensor]:
        """This rank's shards of the items of ``bucket`` (a list of items, or one piece)."""
        items = [bucket.item] if isinstance(bucket, _Piece) else bucket
        return {
            key: self._local[key]
            for item in items
            for k in range(item.num_shards)
            if (key := (item.global_name, k)) in self._local
        }

    def _staged(self, buckets: list, staging) -> Iterator[tuple[Any, Callable[[], None]]]:
        """Each bucket with its shards loaded by ``staging`` (when given), and a function that
        releases those no later bucket needs (call it once the bucket is consumed)."""
        if staging is None:
            for bucket in buckets:
                yield bucket, lambda: None
            return
        shards = [self._shards_of(bucket) for bucket in buckets]
        last = {_storage(t): i for i, bucket in enumerate(shards) for t in bucket.values()}
        for i, bucket in enumerate(buckets):
            staging.load(list(shards[i].values()))  # loads each storage once (a piece's later buckets: none)
            done = {_storage(t): t for t in shards[i].values() if last[_storage(t)] == i}
            yield bucket, lambda done=list(done.values()): staging.release(done)

    def _produce(
        self, bucket_bytes: int, all_ranks: bool, stats: ExportStats, split: bool, staging=None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The export: one list of ``(hf_name, tensor)`` per bucket (empty lists on ranks that
        do not yield are skipped); ``staging``: see ``iter_weights``."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        stats.bucket_bytes = bucket_bytes
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        yields = all_ranks or rank == 0
        # Where the parameters live now (an engine may have moved them since construction).
        self.device = next(iter(self._local.values())).device if self._local else torch.device("cpu")

        def moves(holders: tuple[int, ...]) -> bool:  # does this shard travel at all?
            return len(holders) < world if all_ranks else 0 not in holders

        for bucket, release in self._staged(self._buckets(bucket_bytes, split), staging):
            stats.num_buckets += 1
            if isinstance(bucket, _Piece):
                piece = self._produce_piece(bucket, rank, all_ranks, yields, moves, stats)
                if piece is not None:
                    stats.num_pieces += 1
                    stats.num_split_tensors += bucket.start == 0
                    yield self._account([piece], stats)
                    del piece
                release()
                continue
            ready = self._produce_bucket(bucket, bucket_bytes, rank, all_ranks, yields, moves, stats)
            if ready is not None:
                yield self._account(ready, stats)
                del ready  # the consumer holds the bucket now; nothing here keeps it alive
            release()

    def _produce_bucket(
        self,
        bucket: list[_Item],
        bucket_bytes: int,
        rank: int,
        all_ranks: bool,
        yields: bool,
        moves,
        stats: ExportStats,
    ) -> Optional[list[tuple[str, torch.Tensor]]]:
        """One bucket of whole items: its ``(hf_name, tensor)`` list on yielding ranks, else None.
        (A function of its own so that no local outlives the bucket once returned.)"""
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
            return None
        ready: list[tuple[str, torch.Tensor]] = []
        for item, outs, item_staged, got in zip(bucket, outputs, staged, received):
            if not outs:
                outs = self._alloc_outputs(item, stats, alias=not got)
            for run, buf in item_staged:
                run.dest(outs, run.src_a, run.src_b).copy_(buf)
                stats._add(-_nbytes(buf))
            item_staged.clear()  # staging freed as soon as it is copied
            buf = None
            for k in range(item.num_shards):
                local = self._local.get((item.global_name, k))
                if k in got or outs[0] is local:
                    continue
                for run in self._runs(item, k):
                    run.dest(outs, run.src_a, run.src_b).copy_(local[run.src_a : run.src_b])
            ready.extend(zip(item.hf_names, outs))
        return ready

    @staticmethod
    def _account(ready: list[tuple[str, torch.Tensor]], stats: ExportStats) -> list[tuple[str, torch.Tensor]]:
        for _, tensor in ready:
            stats.num_tensors += 1
            stats.total_bytes += _nbytes(tensor)
            stats.max_piece_bytes = max(stats.max_piece_bytes, _nbytes(tensor))
        return ready

    def _produce_piece(
        self, piece: _Piece, rank: int, all_ranks: bool, yields: bool, moves, stats: ExportStats
    ) -> Optional[tuple[str, torch.Tensor]]:
        """Rows [start, stop) of one HF output of an item, gathered from its shards' runs one
        at a time (each run waited for: pieces and their staging stay within one bucket)."""
        item = piece.item
        info = item.outputs[piece.which]
        out = None
        if yields:
            out = torch.empty((piece.stop - piece.start, *info.shape[1:]), dtype=info.dtype, device=self.device)
            stats._add(_nbytes(out))
        direct = self._direct(item)
        stats.max_item_bytes = max(stats.max_item_bytes, (piece.stop - piece.start) * self._row_cost(item, piece.which))
        for k, holders in enumerate(item.holders):
            owner, local = holders[0], self._local.get((item.global_name, k))
            got = yields and moves(holders) and rank != owner
            for run in self._runs(item, k):
                lo = max(piece.start, run.dst_row)
                hi = min(piece.stop, run.dst_row + run.src_b - run.src_a)
                if run.which != piece.which or lo >= hi:
                    continue
                a, b = run.src_a + lo - run.dst_row, run.src_a + hi - run.dst_row
                dest = None
                if out is not None:
                    dest = out[lo - piece.start : hi - piece.start]
                    dest = dest if run.cols is None else dest[:, run.cols[0] : run.cols[1]]
                if not moves(holders):
                    if dest is not None:
                        dest.copy_(local.detach()[a:b])
                    continue
                if direct or not got:
                    work = _transfer(local, a, b, dest if got else None, owner, rank, all_ranks)
                    if work is not None:
                        work.wait()
                    if yields and not got:  # the owner itself yields: its own rows
                        dest.copy_(local.detach()[a:b])
                    continue
                buf = self._stage(item, k, a, b, stats)
                work = _transfer(local, a, b, buf, owner, rank, all_ranks)
                if work is not None:
                    work.wait()
                dest.copy_(buf)
                stats._add(-_nbytes(buf))
                del buf
        return (piece.name, out) if out is not None else None

    def _runs(self, item: _Item, k: int) -> list[Run]:
        return shard_runs(item.rule.transform, item.partition_dim, item.shard_shapes[k], k, self.weight_map)

    def _direct(self, item: _Item) -> bool:
        """Shards can be received straight into output rows (no column split, no cast)."""
        return self.dtype in (None, item.dtype) and not (item.rule.transform == "copy" and item.partition_dim == 1)

    def _alloc_outputs(self, item: _Item, stats: ExportStats, alias: bool) -> list[torch.Tensor]:
        """Output tensors of ``item``; with ``alias`` an unsplit local parameter is its own output."""
        local = self._local.get((item.global_name, 0))
        if (
            alias
            and local is not None
            and item.num_shards == 1
            and item.rule.transform == "copy"
            and self._direct(item)
        ):
            outs = [local.detach()]
        else:
            outs = [torch.empty(i.shape, dtype=i.dtype, device=self.device) for i in item.outputs]
        stats._add(sum(_nbytes(t) for t in outs))
        return outs

    def _stage(self, item: _Item, k: int, a: int, b: int, stats: ExportStats) -> torch.Tensor:
        buf = torch.empty((b - a, *item.shard_shapes[k][1:]), dtype=item.dtype, device=self.device)
        stats._add(_nbytes(buf))
        return buf


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _transfer(
    local: Optional[torch.Tensor], a: int, b: int, dest: Optional[torch.Tensor], owner: int, rank: int, all_ranks: bool
):
    """Move rows [a, b) of the owner's shard into ``dest``: broadcast, or point-to-point to rank 0."""
    if rank == owner:
        data = local.detach()[a:b]
        return dist.broadcast(data, src=owner, async_op=True) if all_ranks else dist.isend(data, dst=0)
    if all_ranks:
        return dist.broadcast(dest, src=owner, async_op=True)
    if dest is not None:
        return dist.irecv(dest, src=owner)
    return None


def export_hf_weights(
    chunks: Iterable[torch.nn.Module],
    weight_map: WeightMap,
    *,
    mesh=None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    all_ranks: bool = False,
    dtype: Optional[torch.dtype] = None,
    ignore: Sequence[str] = (),
    stats: Optional[ExportStats] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One-shot ``HFExporter(...).iter_weights(...)``; collective, exhaust it on every rank."""
    exporter = HFExporter(chunks, weight_map, mesh=mesh, dtype=dtype, ignore=ignore)
    yield from exporter.iter_weights(bucket_bytes=bucket_bytes, all_ranks=all_ranks, stats=stats)
