"""Weight sync into running vLLM engines: the worker extension and the trainer-side sender.

vLLM loads an extension class into each of its workers when the engine is built with
``LLM(..., worker_extension_cls="megatron_rl.workers.vllm_extension.WeightSyncExtension")``;
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
                   prefix: str = "weight_sync"):
    """A gloo process group of its own, outside ``torch.distributed``'s default group.

    Trainer ranks already own a default group (Megatron's) and vLLM workers theirs, so the
    weight-sync group is built from a ``TCPStore`` directly. Rank 0 hosts the store. The
    constructor blocks until all ``world_size`` ranks have joined.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
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
        """Load HF-named tensors: into the open session, else as one complete reload."""
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        state = getattr(self, "_weight_sync_state", None)
        if state is None:
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
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

    def destroy_weight_sync_group(self) -> None:
        """Drop the broadcast group (its sockets close with it)."""
        self._weight_sync_group = None
