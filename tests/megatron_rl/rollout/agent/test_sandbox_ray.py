"""The sandbox reaches none of Ray's listeners (issue 27), judged from the host side.

A real local Ray is started as ``megatron_rl.job.main_job`` starts it (on loopback:
``parallel.netbind.ray_on_loopback``); its processes' listening TCP ports are read from the kernel
(``psutil``). Without that switch Ray 2.60 listens on ``0.0.0.0`` / ``::`` (all interfaces) despite
``_node_ip_address="127.0.0.1"``; either way a sandbox shares none of the host's network. The
sandbox's code tries every one of those ports on loopback and on every host address, and Ray's
Unix sockets, with the seccomp filter (which refuses non-Unix sockets) and without it (the
network namespace alone: only a downed ``lo``); a host listener of the test's own on 127.0.0.1
and 0.0.0.0 accepts nothing, and the host itself can connect to Ray's ports (so they are real).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import socket

import psutil
import pytest

from megatron_rl.rollout.tools import sandbox
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation

pytestmark = pytest.mark.skipif(
    not (isolation().minimal_root and isolation().seccomp), reason="needs user namespaces and libseccomp"
)

_CODE = """
import json, socket
out = {}
import fcntl, struct
try:  # SIOCSIFFLAGS IFF_UP on lo: even up, it would be the sandbox's own loopback
    fcntl.ioctl(socket.socket(socket.AF_UNIX), 0x8914, struct.pack('16sH14x', b'lo', 1))
    out['lo_up'] = 'done'
except OSError as err:
    out['lo_up'] = err.errno
for host, port in %(targets)r:
    family = socket.AF_INET6 if ':' in host else socket.AF_INET
    try:
        s = socket.socket(family)
        s.settimeout(2)
        s.connect((host, port))
        out[f'{host} {port}'] = 'connected'
    except OSError as err:
        out[f'{host} {port}'] = err.errno
for path in %(unix)r:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        out[path] = 'connected'
    except OSError as err:
        out[path] = err.errno
try:
    out['interfaces'] = [name for _, name in socket.if_nameindex()]
except OSError as err:  # a netlink socket: refused by the seccomp filter
    out['interfaces'] = err.errno
print(json.dumps(out))
"""


def _listening_ports(pids: set) -> dict:
    return {
        c.laddr.port: c.laddr.ip
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    }


def test_no_ray_port_nor_host_listener_is_reachable_from_the_sandbox():
    ray = pytest.importorskip("ray")
    from parallel.netbind import ray_on_loopback

    with ray_on_loopback():
        ray.init(
            address="local",
            num_cpus=1,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",
        )
    own = []
    try:
        me = psutil.Process()
        ports = _listening_ports({me.pid} | {p.pid for p in me.children(recursive=True)})
        info = ray._private.worker.global_worker.node.address_info
        gcs_port = int(info["gcs_address"].rsplit(":", 1)[1])
        assert gcs_port in ports, (info, ports)
        for port, ip in ports.items():  # each is a live listener the host can reach
            assert ip in ("127.0.0.1", "::ffff:127.0.0.1"), (port, ip)  # loopback only, as the trainer's
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        own += [socket.create_server(("127.0.0.1", 0)), socket.create_server(("0.0.0.0", 0))]
        for server in own:
            server.setblocking(False)
            ports[server.getsockname()[1]] = server.getsockname()[0]
        hosts = {"127.0.0.1", "::1"} | {
            a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET
        }
        targets = sorted((host, port) for port in ports for host in hosts)
        unix = [info["raylet_socket_name"], info["object_store_address"]]
        code = _CODE % {"targets": targets, "unix": unix}
        limits = SandboxLimits(wall_seconds=30)
        iso = isolation()
        for label, where in (("seccomp", iso), ("network namespace only", dataclasses.replace(iso, seccomp=None))):
            res = sandbox._execute(code, limits, where, False, False)  # no audit hook: the kernel's walls alone
            assert res.ok, (label, res)
            got = json.loads(res.stdout)
            # the network namespace's only interface: its own lo, down (no route to the host)
            assert got.pop("interfaces") == (errno.EPERM if label == "seccomp" else ["lo"]), label
            assert [got.pop(path) for path in unix] == [errno.ENOENT] * 2, label  # not in the minimal root
            assert got.pop("lo_up") == errno.EPERM, label  # no CAP_NET_ADMIN left
            allowed = {errno.EPERM} if label == "seccomp" else {errno.ENETUNREACH, errno.EADDRNOTAVAIL}
            assert set(got.values()) <= allowed and len(got) == len(targets), (label, got)
            for server in own:
                with pytest.raises(BlockingIOError):
                    server.accept()
        assert ray.cluster_resources().get("CPU") == 1  # Ray's GCS answers as before
    finally:
        for server in own:
            server.close()
        ray.shutdown()
