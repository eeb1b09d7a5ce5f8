"""Running code, or this suite's sandbox tests, as host ``nobody``: the unprivileged caller the sandbox's
rootless path is tested with (``test_sandbox_escapes``, ``test_sandbox_rootless``, ``test_sandbox_cgroup``,
``test_sandbox_fingerprints``)."""

from __future__ import annotations

import os
import subprocess
import sys

SECRET = "s3cr3t-token-27"
"""What the ``secret`` fixture (conftest.py) puts in the caller's environment and a host file."""

ROOTLESS_CALLER = """
# argv: PROJECT HOME PYTHON-ARGS...: runs python PYTHON-ARGS in PROJECT as host nobody.
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
# As root: a private mount namespace where the interpreter under /root is reachable by anybody,
# then become nobody for good (no capability left) and start a fresh interpreter as that user.
assert libc.unshare(0x20000) == 0, ctypes.get_errno()
assert libc.mount(None, b"/", None, 16384 | (1 << 18), None) == 0
fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in {sys.base_prefix, sys.prefix} if p.startswith("/root/")}
if fds:
    assert libc.mount(b"tmpfs", b"/root", b"tmpfs", 0, b"mode=0755") == 0
for path, fd in fds.items():
    os.makedirs(path, exist_ok=True)
    assert libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, 4096 | 16384, None) == 0
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
os.chdir(sys.argv[1])
os.execve(sys.executable, [sys.executable, *sys.argv[3:]], {"PYTHONPATH": sys.argv[1], "HOME": sys.argv[2],
          "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"})
"""


def run_pytest_as_nobody(*args: str) -> subprocess.CompletedProcess:
    """``python -m pytest -q -rs *args`` with the caller as host ``nobody`` (its own home, removed after):
    test files in ``args`` are given as paths; the completed process is returned."""
    import tempfile

    import megatron_rl

    project = os.path.dirname(os.path.dirname(megatron_rl.__file__))
    paths = [os.path.relpath(a, project) if os.path.isabs(a) else a for a in args]
    home = tempfile.mkdtemp(prefix="mrl-nobody-")
    try:
        os.chown(home, 65534, 65534)
        os.chmod(home, 0o755)
        cmd = [sys.executable, "-c", ROOTLESS_CALLER, project, home, "-m", "pytest", "-q", "-rs"]
        cmd += ["-p", "no:cacheprovider", f"--basetemp={home}/base", *paths]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["rm", "-rf", home], check=True)
