"""Sockets bound where they were told (parallel.netbind): torch's TCPStore listens on every interface
whatever host it is given; ours, init_mesh's rendezvous and the weight-sync side band listen on the
master's address only, and a loopback master keeps gloo's pair sockets on ``lo``."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from parallel.netbind import (
    interface_of,
    is_loopback,
    listeners,
    pin_interfaces,
    ray_on_loopback,
    reserve_port,
    tcp_store,
)
from parallel.testing import find_free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = datetime.timedelta(seconds=30)


def _mine() -> list[dict]:
    return listeners([os.getpid()])


def test_torchs_own_store_binds_every_interface_ours_the_host_only():
    theirs = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ours = tcp_store("127.0.0.1", 0, 2, is_master=True, timeout=TIMEOUT)
    by_port = {r["port"]: r for r in _mine()}
    assert by_port[theirs.port]["wildcard"]  # what the fix is for: torch ignores the host
    assert by_port[ours.port]["address"] == "127.0.0.1" and by_port[ours.port]["loopback"]
    assert not by_port[ours.port]["wildcard"]
    client = tcp_store("127.0.0.1", ours.port, 2, is_master=False, timeout=TIMEOUT)
    client.set("k", "v")
    assert ours.get("k") == b"v"
    del theirs


def test_a_taken_port_is_an_error_not_a_second_listener():
    store = tcp_store("127.0.0.1", 0, 1, is_master=True, timeout=TIMEOUT)
    with pytest.raises(OSError):
        tcp_store("127.0.0.1", store.port, 1, is_master=True, timeout=TIMEOUT)


def test_a_reserved_port_is_held_until_the_store_takes_it_over():
    # The CI failure this guards against: a port found free, closed, then bound again by rank 0's
    # store a moment later was taken in between (EADDRINUSE). A reserved one is held meanwhile.
    port = reserve_port("127.0.0.1")
    (row,) = [r for r in _mine() if r["port"] == port]
    assert row["address"] == "127.0.0.1"
    with socket.socket() as intruder, pytest.raises(OSError):
        intruder.bind(("127.0.0.1", port))
    store = tcp_store("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT)
    assert store.port == port and len([r for r in _mine() if r["port"] == port]) == 1
    client = tcp_store("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    client.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(OSError):  # taken over once: a second master on it is refused
        tcp_store("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)


def test_loopback_names_and_interfaces():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("no-such-host.invalid")
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("no-such-host.invalid") is None


def test_pin_interfaces_sets_lo_for_a_loopback_master_and_keeps_a_users_choice(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")
    assert pin_interfaces("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "eth7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert pin_interfaces("192.0.2.7") == {} and "GLOO_SOCKET_IFNAME" not in os.environ


def test_listeners_flags_a_wildcard_socket():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        (row,) = [r for r in _mine() if r["port"] == s.getsockname()[1]]
    assert row["wildcard"] and not row["loopback"] and row["pid"] == os.getpid()
    assert listeners([2**22 + 12345]) == []  # no such process: skipped


def test_ray_on_loopback_switches_rays_cluster_mode_off_and_restores_it(monkeypatch):
    import ray._private.ray_constants as constants
    from ray._private.services import get_node_ip_address

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    before = constants.ENABLE_RAY_CLUSTER
    with ray_on_loopback():
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and constants.ENABLE_RAY_CLUSTER is False
        assert get_node_ip_address() == "127.0.0.1"  # what ray.init then keeps as the node address
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ and constants.ENABLE_RAY_CLUSTER == before


_RANK = """
import json, os, sys
from parallel.mesh import init_mesh, destroy_mesh
from parallel.netbind import listeners
import torch, torch.distributed as dist
init_mesh({})
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
rows = listeners([os.getpid()])
dist.barrier()
print("ROWS" + json.dumps({"sum": float(t), "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "rows": rows}))
destroy_mesh()
"""


def test_init_mesh_listens_on_the_loopback_master_only():
    port = find_free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in outs]
    ranks = [json.loads(o.split("ROWS", 1)[1]) for o, _ in outs]
    assert [r["sum"] for r in ranks] == [3.0, 3.0] and [r["ifname"] for r in ranks] == ["lo", "lo"]
    assert port in {row["port"] for row in ranks[0]["rows"]}  # rank 0 hosts the rendezvous
    for r in ranks:
        assert r["rows"] and [row for row in r["rows"] if row["address"] != "127.0.0.1"] == [], r["rows"]
