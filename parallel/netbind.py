"""Sockets that listen on the address they were given, and a report of who listens where.

torch's ``TCPStore`` listens on every interface (``*`` / ``::``) whatever host it is told; a
rendezvous of a single-node run then takes connections from the whole network. ``tcp_store`` binds the
listening socket itself, to ``host``, and hands it to torch (``master_listen_fd``). ``pin_interfaces``
keeps gloo's and NCCL's own pair sockets on the interface of a loopback master, and ``listeners`` lists
the listening sockets of a process tree, each with whether it is reachable from other hosts (what
``megatron-rl train`` writes to ``network.json``).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import sys
from typing import Any, Iterable, Iterator, Optional

import torch.distributed as dist

__all__ = [
    "reserve_port",
    "tcp_store",
    "store_from_env",
    "is_loopback",
    "interface_of",
    "pin_interfaces",
    "ray_on_loopback",
    "joining_ray",
    "listeners",
]

_BACKLOG = 2048  # torch's own TCPStore backlog

# Listening sockets this process holds for a store it will host: port -> socket (``reserve_port``).
_RESERVED: dict[int, socket.socket] = {}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) resolves to loopback addresses only."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def reserve_port(host: str) -> int:
    """A port on ``host`` that stays this process's: a socket is bound and listening there now, and
    the next ``tcp_store(host, port, is_master=True)`` in this process takes it over.

    A port found free, closed and bound again later can be taken in between (another run's store, a
    client's ephemeral port: ``EADDRINUSE`` on a busy node); a held one cannot. Connections that arrive
    before the store starts wait in the socket's backlog."""
    sock = _listen(host, 0)
    port = int(sock.getsockname()[1])
    _RESERVED[port] = sock
    return port


def tcp_store(
    host: str,
    port: int,
    world_size: int,
    *,
    is_master: bool,
    timeout: datetime.timedelta,
    wait_for_workers: bool = False,
) -> dist.TCPStore:
    """A ``torch.distributed.TCPStore``; the master's listens on ``host`` only (``port=0``: a free port,
    read back as ``store.port``; a port from ``reserve_port``: the socket held there). Clients connect
    as torch's do."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    sock = _RESERVED.pop(port, None) if port else None
    sock = sock or _listen(host, port)
    bound = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        bound,
        world_size,
        is_master=True,
        wait_for_workers=wait_for_workers,
        timeout=timeout,
        master_listen_fd=sock.detach(),
    )


def store_from_env(timeout: datetime.timedelta) -> Optional[tuple[dist.TCPStore, int, int]]:
    """``(store, rank, world_size)`` of the ``env://`` rendezvous (``MASTER_ADDR``/``MASTER_PORT``/
    ``RANK``/``WORLD_SIZE``), rank 0's store bound to ``MASTER_ADDR``; None when the variables are
    not all set or torchrun's agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    if any(k not in os.environ for k in keys) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = tcp_store(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    return store, rank, world_size


def interface_of(host: str) -> Optional[str]:
    """The name of the network interface that holds ``host``'s address (e.g. ``lo``), or None."""
    import psutil

    try:
        wanted = {i[4][0].split("%")[0] for i in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in wanted for a in addrs):
            return name
    return None


def pin_interfaces(host: str) -> dict[str, str]:
    """When ``host`` is loopback, keep gloo's and NCCL's pair sockets on its interface: set
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` where unset (a user's own choice stands). Returns
    what it set. Elsewhere gloo binds the address its hostname resolves to (never ``*``)."""
    if not is_loopback(host):
        return {}
    name = interface_of(host)
    if name is None:
        return {}
    set_now = {k: name for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ}
    os.environ.update(set_now)
    return set_now


_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def ray_on_loopback() -> Iterator[None]:
    """Around ``ray.init(_node_ip_address="127.0.0.1")``: make Ray keep that address.

    Ray 2.60 replaces a loopback node address with the machine's interface address
    (``services.resolve_ip_for_localhost``) unless its "local cluster" switch is off; the GCS, the
    raylet and every worker's gRPC server then listen on ``*``. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    (read at call time; the processes Ray starts inherit it) the node address stays 127.0.0.1 and
    they listen on loopback only. Restores both afterwards."""
    previous = os.environ.get(_RAY_CLUSTER_ENV)
    os.environ[_RAY_CLUSTER_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    flag = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_RAY_CLUSTER_ENV, None)
        else:
            os.environ[_RAY_CLUSTER_ENV] = previous
        if constants is not None:
            constants.ENABLE_RAY_CLUSTER = flag


def joining_ray(address: str):
    """Around ``ray.init(address=...)`` joining a running cluster: ``ray_on_loopback()`` when the
    cluster's address is loopback (one started by ``ray_on_loopback``: its raylet is registered as
    127.0.0.1, and a driver that took the interface address would wait for a raylet of that address
    forever), else nothing."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return ray_on_loopback() if host and is_loopback(host) else contextlib.nullcontext()


def _wildcard(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_unspecified


def listeners(pids: Iterable[int]) -> list[dict[str, Any]]:
    """The TCP sockets listening in processes ``pids``: ``{"pid", "name", "address", "port",
    "loopback", "wildcard"}`` each (``wildcard``: bound to every interface), sorted by pid and port.
    A process gone meanwhile is skipped."""
    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            name = proc.name()
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status != psutil.CONN_LISTEN:
                continue
            ip = c.laddr.ip
            plain = ip.removeprefix("::ffff:") if "." in ip else ip
            out.append(
                dict(
                    pid=pid,
                    name=name,
                    address=ip,
                    port=c.laddr.port,
                    loopback=ipaddress.ip_address(plain.split("%")[0]).is_loopback,
                    wildcard=_wildcard(plain),
                )
            )
    return sorted(out, key=lambda r: (r["pid"], r["port"]))
