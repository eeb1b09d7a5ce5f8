"""Actor -> rollout weight sync: the actor's sharded Megatron weights streamed into running vLLM engines.

After every policy update the actor's weights -- sharded over any TP/PP/VPP/EP layout -- go
through the bridge's bucketed HF export (``parallel.bridge.HFExporter``): each bucket of full,
HF-named tensors is gathered onto actor rank 0 and handed on before the next bucket is
gathered, so no rank ever holds the whole model: the export holds at most one bucket plus one
parameter (``ExportStats``), the transport at most one more bucket. vLLM's reload path then
fuses q/k/v and gate/up, shards for the engine's *own* TP layout and repacks its kernels, so
the rollout's parallel layout need not match training's. Nothing touches persistent storage.

Placement decides the transport (``choose_transport``):

    placement    engine                                      transport   API
    colocated    in-process vLLM (TP=1) in actor rank 0      colocated   sync(rollout) on every actor rank
    same_node    a rollout worker process on rank 0's node   shm         listen/connect + sync(); receiver
    other_node   a rollout worker process elsewhere          broadcast   listen/connect + sync(); receiver

On GPUs the same listen/connect + sync() path takes ``nccl`` (rollout workers on other GPUs: the
side band's ranks also form an NCCL group) or ``cuda_ipc`` (engine processes on actor rank 0's
GPU: each bucket packed into one GPU buffer whose IPC handle travels as the stream header).
Tensors larger than the bucket travel as row pieces that the engine reassembles, so the bucket
bound also bounds every piece; a bucket smaller than one expert shard is refused at construction.

* colocated: rank 0 passes its ``VLLMRollout`` to ``sync``; tensors go by reference (an engine
  handle on rank 0 whose workers run in other processes -- vLLM TP>1 -- takes ``shm``/``bytes``/
  ``broadcast`` through the same call, see ``VLLMRollout.update_weights``).
* remote (another process): actor rank 0 and every vLLM worker of every rollout replica form a
  gloo side band (``parallel.transport.SideBand``). Rank 0 first ``listen``s (binds a port the
  OS picks) and the driver hands ``(addr, port)`` to the rollout workers; then ``connect`` here
  and ``RolloutWeightReceiver.connect`` there run concurrently. A sync is one self-describing
  stream (``parallel.transport.stream``): each bucket's header carries the transport's message;
  with ``broadcast`` the tensors follow over the side band, with ``shm`` the bucket is a
  safetensors file under ``shm_dir`` (one copy in, mapped without a copy on the other side;
  receivers acknowledge once they hold it, the sender then unlinks it -- and meanwhile exports
  and writes the next bucket). The driver (e.g. Ray) only has to start ``ActorWeightSync.sync()``
  on the actor ranks and ``RolloutWeightReceiver.receive()`` on the rollout workers at the same time.

The transports themselves (bucketing, wire formats, the side band, the name -> implementation
table) live in ``parallel.transport``; this module binds them to the bridge's export on the
actor ranks and to a ``VLLMRollout`` on the rollout side.

With ``quantization="fp8"`` (``actor_rollout_ref.rollout.quantization``) the stream carries what an
FP8 engine holds: every weight ``parallel.bridge.fp8.FP8_WEIGHTS`` names (attention, MLP and expert
projections) as ``float8_e4m3fn`` + float32 ``<name>_scale_inv`` per 128 x 128 block, quantised
here on actor rank 0 bucket by bucket (``quantize_fp8_stream``, with ``parallel.bridge.fp8``'s quantiser: DeepSeek-V3's published format,
bit for bit what ``megatron-rl convert --export-fp8`` writes); router gates, norms, embeddings and
the head travel in the export's dtype.

Every sync ends with ``reset_prefix_cache()`` on the engine (cached KV is stale).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.config.base_config import check_choice, check_range
from megatron_rl.config.rollout import QUANTIZATIONS
from parallel.bridge import ExportStats, HFExporter
from parallel.bridge.export import parse_piece, piece_name
from parallel.bridge.fp8 import DEFAULT_BLOCK, FP8_WEIGHTS, SCALE_SUFFIX, quantize_fp8_blocks
from parallel.bridge.collective import raise_together
from parallel.transport import DEFAULT_TIMEOUT_S, STREAMABLE, RemoteWeightSender, get_transport
from parallel.transport.cuda import require_cuda

__all__ = [
    "PLACEMENTS",
    "REMOTE_TRANSPORTS",
    "choose_transport",
    "ActorWeightSync",
    "RemoteWeightSender",
    "RolloutWeightReceiver",
    "quantize_fp8_stream",
]

PLACEMENTS = {"colocated": "colocated", "same_node": "shm", "other_node": "broadcast"}
REMOTE_TRANSPORTS = STREAMABLE  # ("broadcast", "cuda_ipc", "nccl", "shm"): they stream to another process


def choose_transport(placement: str) -> str:
    """The transport for a placement of the rollout engine relative to actor rank 0 (table above)."""
    check_choice("placement", placement, list(PLACEMENTS))
    return PLACEMENTS[placement]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _drain(weights: Iterator) -> None:
    """Finish a collective export generator, so the other actor ranks are not left waiting."""
    for _ in weights:
        pass


def quantize_fp8_stream(buckets, block: tuple[int, int] = DEFAULT_BLOCK, *, pattern: re.Pattern = FP8_WEIGHTS):
    """Buckets of HF ``(name, tensor)`` pairs with every 2-D float weight whose name ``pattern``
    matches replaced by its ``float8_e4m3fn`` weight and float32 ``<name>_scale_inv`` (``quantize_fp8_blocks``,
    bit for bit what ``parallel.bridge.fp8.write_fp8_export`` writes for a plain source); other tensors pass unchanged.

    Row pieces (``parallel.bridge.export.piece_name``) are quantised per whole row blocks: rows up to a
    block boundary are held back and sent with the next piece of the same tensor, and the scale
    travels as a piece of ``<name>_scale_inv`` (its rows ``start / block[0]`` ...), so receivers
    reassemble both as they reassemble any piece. Tensors already in FP8 pass unchanged.
    ValueError when a stream ends with a tensor's rows incomplete.
    """
    carry: dict[str, tuple[int, torch.Tensor]] = {}  # base name -> (first held-back row, the rows)
    r0 = block[0]
    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            piece = parse_piece(name)
            base = piece[0] if piece else name
            if (
                tensor.dim() != 2
                or not tensor.is_floating_point()
                or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                or not pattern.fullmatch(base)
            ):
                out.append((name, tensor))
                continue
            tensor = tensor.detach()  # the export's tensors may alias parameters: no autograd graph for the scales
            if piece is None:
                q, scale = quantize_fp8_blocks(tensor, block)
                out += [(name, q), (name + SCALE_SUFFIX, scale)]
                continue
            _, start, stop, rows = piece
            if base in carry:
                first, held = carry.pop(base)
                if first + held.shape[0] != start:
                    raise ValueError(
                        f"weight piece {name!r} does not follow rows {first}:{first + held.shape[0]} of {base!r}"
                    )
                tensor, start = torch.cat([held, tensor]), first
            elif start % r0:
                raise ValueError(f"weight piece {name!r} starts inside a {list(block)} block of {base!r}")
            end = stop if stop == rows else start + (stop - start) // r0 * r0
            if end < stop:  # the rows of a partly sent block wait for the next piece
                carry[base] = (end, tensor[end - start :].clone())
            if end > start:
                q, scale = quantize_fp8_blocks(tensor[: end - start], block)
                out += [
                    (piece_name(base, start, end, rows), q),
                    (piece_name(base + SCALE_SUFFIX, start // r0, -(-end // r0), -(-rows // r0)), scale),
                ]
        if out:
            yield out
    if carry:
        raise ValueError(f"the weight stream ended with rows of {sorted(carry)[:4]} not sent")


def _count_whole(buckets: Iterator, count: list) -> Iterator:
    """Pass ``buckets`` on, counting in ``count[0]`` the whole tensors they carry (a split tensor
    once, at its last piece)."""
    for bucket in buckets:
        for name, _ in bucket:
            piece = parse_piece(name)
            count[0] += piece is None or piece[2] == piece[3]
        yield bucket


# ----------------------------------------------------------------------------- actor side
class ActorWeightSync:
    """The actor side of weight sync; construct and call on every actor rank (collective).

    Args:
        chunks: this rank's model chunks (``MegatronEngine.model``; DDP wrappers are fine).
        weight_map: the family's HF <-> Megatron table (``get_family(...).weight_map(model_cfg)``).
        mesh: ``parallel.mesh.Mesh`` (default: Megatron's parallel state).
        dtype: cast exported tensors (e.g. bfloat16 for a bf16 engine); None keeps the
            parameters' dtype.
        bucket_megabytes: bound of one bucket in MiB (export and transport alike); a single
            larger tensor travels alone. Required: the default lives in
            ``WeightSyncConfig.update_weights_bucket_megabytes``.
        ignore: regexes of Megatron names to leave out (see ``HFExporter``).
        quantization: the engine's ``rollout.quantization``: None sends the export as it is;
            ``fp8`` sends DeepSeek-V3's block FP8 (module docstring).
        merged: a context-manager factory entered (on every rank) around each export, e.g. a LoRA
            engine's ``merged_weights`` (``lora.merge: true``): the exported base weights are then
            ``W + scale * B A`` under their HF names and the adapters themselves (in ``ignore``) stay.

    The plan of the export is built once here (collectively); parameters are referenced, so
    ``sync`` always sends the current weights.
    """

    def __init__(
        self,
        chunks: Iterable[torch.nn.Module],
        weight_map,
        *,
        bucket_megabytes: float,
        mesh=None,
        dtype: Optional[torch.dtype] = None,
        ignore: Sequence[str] = (),
        quantization: Optional[str] = None,
        merged: Optional[Callable[[], ContextManager]] = None,
    ):
        check_range("bucket_megabytes", bucket_megabytes, low=0, low_inclusive=False)
        self.merged = merged
        check_choice("rollout.quantization", quantization, (None, *QUANTIZATIONS))
        self.quantization = quantization
        self.bucket_bytes = max(1, int(bucket_megabytes * 2**20))
        self.exporter = HFExporter(list(chunks), weight_map, mesh=mesh, dtype=dtype, ignore=ignore)
        # Pieces never exceed the bucket (split export); an expert shard cannot be split: refuse now.
        self.exporter.check_bucket(
            self.bucket_bytes, what=f"checkpoint_engine.update_weights_bucket_megabytes={bucket_megabytes:g}"
        )
        self.rank = _rank()
        self.remote_transport: Optional[str] = None
        self._sender: Optional[RemoteWeightSender] = None

    @classmethod
    def from_engine(cls, engine, weight_map, **kwargs: Any) -> "ActorWeightSync":
        """For a ``MegatronEngine`` (its chunks); a LoRA engine's export is its merged weights
        (``engine.merged_weights``; the adapters, ``engine.bridge_ignore``, are left out)."""
        kwargs["ignore"] = (*kwargs.get("ignore", ()), *engine.bridge_ignore)
        if engine.bridge_ignore:
            kwargs.setdefault("merged", engine.merged_weights)
        return cls(engine.model, weight_map, **kwargs)

    @property
    def num_bytes(self) -> int:
        """Bytes of one full sync (every exported HF tensor)."""
        return sum(t.nbytes for t in self.exporter.tensors)

    def iter_weights(self, stats: Optional[ExportStats] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The bucketed export: ``(hf_name, tensor)`` pairs on rank 0, nothing elsewhere.
        Collective: exhaust it on every actor rank. Tensors may alias parameters (read-only)."""
        return self._within_merged(
            self.exporter.iter_weights(bucket_bytes=self.bucket_bytes, all_ranks=False, stats=stats)
        )

    def _within_merged(self, items: Iterator) -> Iterator:
        """``items`` produced inside ``merged()`` (entered at the first item, left once exhausted)."""
        if self.merged is None:
            return items

        def produce():
            with self.merged():
                yield from items

        return produce()

    def iter_buckets(self, stats: Optional[ExportStats] = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """What ``sync`` sends: the export one bucket at a time, tensors larger than the bucket as
        row pieces (``parallel.bridge.export``; receivers reassemble them), so no bucket and no
        single piece exceeds the bound (FP8 buckets are smaller: 1 byte per quantised weight).
        With ``quantization="fp8"`` rank 0's buckets are quantised (``quantize_fp8_stream``).
        Collective, like ``iter_weights``."""
        buckets = self._within_merged(
            self.exporter.iter_buckets(bucket_bytes=self.bucket_bytes, all_ranks=False, stats=stats, split=True)
        )
        if self.quantization == "fp8" and self.rank == 0:
            return quantize_fp8_stream(buckets, DEFAULT_BLOCK)
        return buckets

    # -- remote placement --------------------------------------------------------------------
    def listen(
        self,
        world_size: int,
        *,
        transport: str,
        master_addr: str = "127.0.0.1",
        port: int = 0,
        shm_dir: Optional[str] = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Optional[tuple[str, int]]:
        """Remote placement, step 1 (every actor rank): rank 0 hosts the side band's store
        and returns ``(master_addr, port)`` for the rollout workers; the others return None.

        ``world_size`` = 1 + the vLLM workers of all receiving replicas; ``transport`` one of
        ``REMOTE_TRANSPORTS``; ``master_addr`` is the address they reach rank 0 at; ``port=0``
        lets the OS pick a free one; ``shm_dir`` (``checkpoint_engine.shm_dir``) is required by ``shm``.
        """
        if get_transport(transport, allowed=REMOTE_TRANSPORTS).requires_cuda:
            require_cuda(transport)  # on every rank, before anything is bound
        check_range("world_size", world_size, low=2)
        self.remote_transport = transport
        if self.rank != 0:
            return None
        self._sender = RemoteWeightSender(
            world_size, transport=transport, master_addr=master_addr, port=port, shm_dir=shm_dir, timeout_s=timeout_s
        )
        return master_addr, self._sender.listen()

    def connect(self) -> None:
        """Remote placement, step 2 (every actor rank): rank 0 blocks until every rollout worker
        has joined (``RolloutWeightReceiver.connect``, started concurrently)."""
        if self.remote_transport is None:
            raise RuntimeError("ActorWeightSync.connect before listen()")
        if self._sender is not None:
            self._sender.connect()

    def close(self) -> None:
        """Leave the side band (remote placement)."""
        if self._sender is not None:
            self._sender.close()
        self._sender = None
        self.remote_transport = None

    # -- one sync ----------------------------------------------------------------------------
    def sync(self, rollout=None, *, transport: Optional[str] = None, allow_partial: bool = False) -> dict[str, Any]:
        """Push the current weights to the engine(s); collective over the actor ranks.

        Args:
            rollout: the ``VLLMRollout`` on rank 0 when the engine handle lives there
                (colocated); None on the other ranks and for the remote placement.
            transport: for a rollout handle, a ``parallel.transport`` name (default its
                ``checkpoint_engine.backend``); must be None for the remote placement (fixed
                by ``listen``).
            allow_partial: accept a sync that leaves engine parameters untouched (handle only;
                the receiver checks for the remote placement).

        Returns:
            On rank 0 ``{"transport", "bytes", "num_tensors", "num_buckets", "seconds",
            "export_buckets", "export_max_live_bytes", "export_bound_bytes"}`` (the export held
            at most ``export_max_live_bytes <= export_bound_bytes`` = bucket + largest
            piece at once), ``export_pieces`` (row pieces of tensors larger than the bucket)
            and ``export_max_piece_bytes``; on the other ranks ``{"transport", "seconds"}``.
        """
        errors = []
        if self.rank != 0 and rollout is not None:
            errors.append((ValueError, f"rollout must be None on actor rank {self.rank}: only rank 0 sends"))
        if self.rank == 0:
            if self.remote_transport is not None and (rollout is not None or transport is not None):
                errors.append(
                    (
                        ValueError,
                        f"this sync is connected to remote rollout workers (transport="
                        f"{self.remote_transport!r}); pass neither rollout nor transport",
                    )
                )
            if self.remote_transport is None and rollout is None:
                errors.append(
                    (
                        ValueError,
                        "rank 0 has no rollout to sync into: pass its VLLMRollout "
                        "(colocated) or listen() and connect() first (remote rollout workers)",
                    )
                )
            if self._sender is not None and self._sender.group is None:
                errors.append((RuntimeError, "listen() was called but not connect()"))
        raise_together(errors)  # all ranks raise alike, before any export collective starts
        used = self.remote_transport or transport or (rollout.config.checkpoint_engine.backend if rollout else None)
        start = time.perf_counter()
        stats = ExportStats()
        weights = self.iter_buckets(stats)
        whole = [0]  # HF tensors sent (a split one once; FP8 scales included), not pieces
        if self.rank == 0:
            weights = _count_whole(weights, whole)
        if self.rank != 0:
            _drain(weights)
            return {"transport": used, "seconds": time.perf_counter() - start}
        try:
            if self._sender is not None:
                out = self._sender.send(weights, self.bucket_bytes)
            else:
                out = rollout.update_weights(
                    weights,
                    transport=transport,
                    bucket_megabytes=self.bucket_bytes / 2**20,
                    allow_partial=allow_partial,
                )
        except BaseException:
            _drain(weights)  # the other actor ranks complete their sends of the export
            raise
        return {
            "transport": out["transport"],
            "bytes": out["bytes"],
            "num_tensors": whole[0],
            "num_buckets": out["num_buckets"],
            "seconds": time.perf_counter() - start,
            "export_buckets": stats.num_buckets,
            "export_max_live_bytes": stats.max_live_bytes,
            "export_bound_bytes": stats.bucket_bytes + stats.max_item_bytes,
            "export_pieces": stats.num_pieces,
            "export_max_piece_bytes": stats.max_piece_bytes,
        }


# ----------------------------------------------------------------------------- rollout side
class RolloutWeightReceiver:
    """The rollout worker's side of the remote placement: its vLLM workers join the group.

    Args:
        rollout: this process's ``VLLMRollout``.
        master_addr, port, world_size: the group that actor rank 0 hosts (``ActorWeightSync.connect``).
        rank_offset: group rank of this engine's first vLLM worker (1 for the first replica,
            1 + its worker count for the next ...; ``VLLMRollout.num_workers``: TP x PP).
    """

    def __init__(
        self,
        rollout,
        master_addr: str,
        port: int,
        world_size: int,
        *,
        rank_offset: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        check_range("rank_offset", rank_offset, low=1)
        workers = rollout.num_workers
        if rank_offset + workers > world_size:
            raise ValueError(
                f"rank_offset={rank_offset} + the engine's {workers} worker(s) exceed world_size={world_size}"
            )
        self.rollout, self.master_addr, self.port, self.world_size = rollout, master_addr, port, world_size
        self.rank_offset, self.timeout_s = rank_offset, timeout_s
        self.ranks: list[int] = []

    def connect(self) -> list[int]:
        """Join the group (blocks until actor rank 0 and every other receiver joined); returns
        the group ranks of this engine's workers."""
        self.ranks = self.rollout.rpc(
            "init_weight_sync_group", self.master_addr, self.port, self.rank_offset, self.world_size, self.timeout_s
        )
        return self.ranks

    def receive(self, *, allow_partial: bool = False) -> dict[str, Any]:
        """Receive one whole sync into the engine, then reset its prefix cache.

        Returns ``{"bytes", "num_tensors", "num_buckets", "seconds"}``; raises ``ValueError``
        if the sync left engine parameters untouched (unless ``allow_partial``) and
        ``RuntimeError`` if the sender aborted.
        """
        if not self.ranks:
            raise RuntimeError("RolloutWeightReceiver.receive before connect()")
        start = time.perf_counter()
        stats = self.rollout.rpc("receive_weight_stream")[0]
        self.rollout.reset_prefix_cache()
        if stats["not_loaded"] and not allow_partial:
            raise ValueError(
                f"weight sync left {len(stats['not_loaded'])} engine parameter(s) unchanged: "
                f"{stats['not_loaded'][:8]}; pass allow_partial=True for a partial update"
            )
        return {
            "bytes": stats["bytes"],
            "num_tensors": stats["num_tensors"],
            "num_buckets": stats["num_buckets"],
            "seconds": time.perf_counter() - start,
        }

    def close(self) -> None:
        """Leave the group."""
        self.rollout.rpc("destroy_weight_sync_group")
        self.ranks = []
