"""The import layers of docs/architecture.md hold: ``lint-imports`` keeps every contract of .importlinter."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: install the test extra (pip install -e '.[test]')")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout and "6 kept" in out.stdout, out.stdout[-2000:]
