"""The gloo side band: process groups of their own between one sender and its receivers.

Trainer ranks already own a default group (Megatron's) and vLLM workers theirs, so weight
traffic runs over groups built from a ``TCPStore`` directly, outside ``torch.distributed``'s
default world. ``SideBand`` is one such link: rank 0 (the sender) hosts the store, the
receivers join it, and two groups come up over the same store:

* ``data_group``: tensor bytes (the broadcast transport);
* ``control_group``: the stream's JSON headers and per-bucket acknowledgements
  (``parallel.transport.stream``). Keeping them apart lets the data of a bucket start
  (asynchronously) before its header is delivered, in one order on every rank.

``send_header`` / ``recv_header`` / ``ack`` are the control messages; ``broadcast`` starts one
asynchronous broadcast from rank 0 of a group.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.netbind import tcp_store

__all__ = ["DEFAULT_TIMEOUT_S", "SideBand", "new_gloo_group", "broadcast", "send_header", "recv_header", "ack"]

DEFAULT_TIMEOUT_S = 600.0  # how long a side-band rank waits for its peers (joining, or any one message)


def new_gloo_group(
    master_addr: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prefix: str = "weight_sync",
    store=None,
):
    """A gloo process group of its own, outside ``torch.distributed``'s default group.

    Rank 0 hosts the ``TCPStore`` (or passes the one it already hosts as ``store``, e.g. bound
    to port 0 to let the OS pick a free port). Blocks until all ``world_size`` ranks have joined.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = tcp_store(master_addr, port, world_size, is_master=(rank == 0), timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, timeout)


def broadcast(group, tensor: torch.Tensor, root: int = 0):
    """Start broadcasting ``tensor`` from ``root`` over ``group``; returns the work to ``wait()`` on."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return group.broadcast([tensor], opts)


def send_header(group, header: dict[str, Any]) -> None:
    """Broadcast a JSON header from rank 0 of ``group``: its length, then its bytes."""
    payload = json.dumps(header, separators=(",", ":")).encode("utf-8")
    broadcast(group, torch.tensor([len(payload)], dtype=torch.int64)).wait()
    broadcast(group, torch.frombuffer(bytearray(payload), dtype=torch.uint8)).wait()


def recv_header(group) -> dict[str, Any]:
    """Receive the header ``send_header`` broadcast."""
    length = torch.zeros(1, dtype=torch.int64)
    broadcast(group, length).wait()
    payload = torch.empty(int(length), dtype=torch.uint8)
    broadcast(group, payload).wait()
    return json.loads(bytes(payload.numpy()).decode("utf-8"))


def ack(group) -> None:
    """All ranks of ``group`` meet (an all-reduce of one number)."""
    group.allreduce([torch.zeros(1)]).wait()


class SideBand:
    """A data group and a control group between rank 0 (the sender) and ``world_size - 1`` receivers.

    The sender ``listen()``s first (binds the store; ``port=0`` lets the OS pick one -- a port
    chosen in advance may be taken meanwhile, e.g. by gloo's own listeners), hands
    ``(master_addr, port)`` to the receivers, then every rank calls ``connect()`` concurrently
    (it blocks until all have joined). With ``nccl=True`` on rank 0 (the ``nccl`` transport) every
    rank also brings up an NCCL group of the same ranks in ``connect`` (``group_for("nccl")``).
    """

    def __init__(
        self,
        master_addr: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        nccl: bool = False,
    ):
        if world_size < 2:
            raise ValueError(f"world_size={world_size} is out of range; allowed: [2, inf)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.master_addr, self.port, self.rank, self.world_size = master_addr, port, rank, world_size
        self.timeout_s = timeout_s
        self.nccl = nccl  # rank 0's choice; the others read it from the store when they connect
        self.data_group = self.control_group = None
        self._nccl_group = None
        self._store: Optional[dist.TCPStore] = None

    @property
    def connected(self) -> bool:
        return self.control_group is not None

    def listen(self) -> int:
        """Rank 0: host the groups' store without waiting for anyone; returns its port."""
        if self.rank != 0:
            raise RuntimeError(f"SideBand.listen on rank {self.rank}: only rank 0 hosts the store")
        if self._store is None:
            self._store = tcp_store(
                self.master_addr,
                self.port,
                self.world_size,
                is_master=True,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
            self._store.set("weight_sync/nccl", "1" if self.nccl else "0")
            self.port = self._store.port
        return self.port

    def connect(self) -> "SideBand":
        """Join both groups; blocks until all ``world_size`` ranks have joined. Returns ``self``."""
        if self.rank == 0:
            self.listen()
        store = self._store or tcp_store(
            self.master_addr,
            self.port,
            self.world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self._store = store
        make = dict(timeout_s=self.timeout_s, store=store)
        self.data_group = new_gloo_group(
            self.master_addr, self.port, self.rank, self.world_size, prefix="weight_sync/data", **make
        )
        self.control_group = new_gloo_group(
            self.master_addr, self.port, self.rank, self.world_size, prefix="weight_sync/control", **make
        )
        self.nccl = store.get("weight_sync/nccl") == b"1"
        if self.nccl:  # NCCL's first collective blocks until every rank joins: do it now, while all are here
            import torch

            group = self.group_for("nccl")
            broadcast(group, torch.zeros(1, device=torch.cuda.current_device())).wait()
            torch.cuda.synchronize()
        return self

    def group_for(self, backend: str):
        """The group a transport's bytes travel over: ``gloo`` (the data group) or ``nccl`` (an
        NCCL group of the same ranks over the same store, made on first use: every rank asks for
        it in the same order -- when its transport's first half is built -- and NCCL itself
        rendezvouses on the first collective; ``connect`` runs that one when rank 0 was built with
        ``nccl=True``). None before ``connect``."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"side band backend={backend!r} is not allowed; choose 'gloo' or 'nccl'")
        if not self.connected:
            return None
        if backend == "gloo":
            return self.data_group
        if self._nccl_group is None:
            import torch

            from parallel.transport.cuda import require_cuda

            require_cuda("nccl")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=self.timeout_s)
            self._nccl_group = dist.ProcessGroupNCCL(
                dist.PrefixStore("weight_sync/nccl", self._store), self.rank, self.world_size, options
            )
            self._nccl_device = torch.cuda.current_device()
        return self._nccl_group

    def close(self) -> None:
        """Drop the groups and the store (their sockets close with them)."""
        shutdown = getattr(self._nccl_group, "shutdown", None)  # frees the NCCL communicator now
        if shutdown is not None:
            shutdown()
        self.data_group = self.control_group = self._nccl_group = None
        self._store = None
