"""``ruff check`` passes with pyproject.toml's settings (pyflakes and pycodestyle's error classes, line
length 120), as ``.ci/run`` runs it."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_passes():
    exe = shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: install the test extra (pip install -e '.[test]')")
    out = subprocess.run(
        [exe, "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
