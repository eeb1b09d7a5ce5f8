"""A conversion killed outright (SIGKILL to the tool and its ranks, as the OOM killer would) leaves no
output directory; rerunning the same command succeeds and removes the dead run's temporary directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _hidden(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.convert-*"))


def test_a_killed_conversion_leaves_no_output_and_can_be_rerun(tmp_path):
    from megatron_rl.models.tiny_checkpoints import build_tiny_hf_checkpoint

    hf = build_tiny_hf_checkpoint(tmp_path / "hf", "qwen3")["path"]
    out = tmp_path / "mcore"
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "convert_hf_to_mcore.py"),
        "--hf-dir",
        str(hf),
        "--out-dir",
        str(out),
        "--verify",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 300
    # Kill once the checkpoint is being written (its files exist in the hidden directory); --verify
    # keeps the run going for seconds after that, before the rename.
    while time.monotonic() < deadline and proc.poll() is None:
        if any(f.is_file() for d in _hidden(tmp_path, "mcore") for f in d.rglob("*")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the conversion finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(0.5)  # the spawned ranks are in the same session: gone with it
    assert not out.exists()
    stale = _hidden(tmp_path, "mcore")
    assert stale, "the killed run's temporary directory should still be there (nothing could clean it)"

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert _hidden(tmp_path, "mcore") == [] and not any(p.exists() for p in stale)
