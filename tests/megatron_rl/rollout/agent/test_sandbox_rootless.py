"""The sandbox's rootless path end to end (issue 27): a caller that is host ``nobody`` (no capability, no
cgroup) runs the main attacks, and the runner maps the caller's own user (RLIMIT_NPROC and RLIMIT_AS
as the bounds). Judged from the host side, as in ``test_sandbox_escapes``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.rollout.tools.sandbox import isolation

from .rootless import ROOTLESS_CALLER

pytestmark = pytest.mark.skipif(
    not (isolation().minimal_root and isolation().seccomp), reason="needs user namespaces and libseccomp"
)
_ROOTLESS_ATTACKS = """
import json, os
from megatron_rl.rollout.tools.sandbox import SandboxLimits, isolation, run_python
def run(code, **limits):
    r = run_python(code, SandboxLimits(**limits), python_guards=False)
    return [r.status, r.stdout, r.stderr[-300:], r.exit_code]
iso = isolation()
print(json.dumps({"uid": os.getuid(), "map_to": iso.map_to, "cgroup": list(iso.cgroup),
    "whoami": run("import os; print(os.getuid(), open('/proc/self/uid_map').read().split())"),
    "root": run("import os; print(sorted(os.listdir('/')), sorted(p for p in os.listdir('/proc') if p.isdigit()))"),
    "secret": run("print(open(%(secret)r).read())"),
    "socket": run("import socket; socket.socket()"),
    "fork": run("import os; os.fork()"),
    "mount": run("import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.umount2(b'/proc', 2), ctypes.get_errno())"),
    "disk": run("n = 0\\nwhile True:\\n    open(f'f{n}', 'wb').write(b'x' * 100000); n += 1", max_disk_bytes=1 << 20),
    "spoof": run("import os; os._exit(86)"),
    "memory": run("x = [bytearray(1 << 24) for _ in range(100)]", memory_mb=128),
    "caps": run("print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapBnd', 'NoNewPrivs'))])"),
}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="run as an unprivileged user, every test here is the rootless path")
def test_the_rootless_path_holds_for_an_unprivileged_caller(secret):
    import megatron_rl

    project = os.path.dirname(os.path.dirname(megatron_rl.__file__))
    out = subprocess.run(
        [sys.executable, "-c", ROOTLESS_CALLER, project, "/", "-c", _ROOTLESS_ATTACKS % {"secret": str(secret)}],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["uid"] == 65534 and got["map_to"] is None  # the runner maps the caller's own user
    assert got["cgroup"] == []  # an unprivileged caller makes no cgroup here: the address-space limit instead
    assert got["whoami"][:2] == ["ok", "0 ['0', '65534', '1']\n"]  # root inside is the caller's own uid
    assert got["root"][0] == "ok" and got["root"][1].endswith("['1', '2']\n") and "'work'" not in got["root"][1]
    assert got["secret"][0] == "error" and "No such file or directory" in got["secret"][2]
    assert got["socket"][0] == got["fork"][0] == "error" and "Operation not permitted" in got["socket"][2]
    assert got["mount"][1] == "-1 1\n"
    assert got["disk"][0] == "disk_limit" and got["spoof"][::3] == ["error", 86]
    assert got["memory"][0] == "error" and "MemoryError" in got["memory"][2]  # RLIMIT_AS: no cgroup to count
    assert got["caps"][1] == "['0000000000000000', '0000000000000000', '1']\n"
