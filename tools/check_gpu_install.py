"""Resolve the ``[gpu]`` extra against the package index without installing it, and check the set agrees.

    python tools/check_gpu_install.py [--cuda 13] [--python python3.11]

In a scratch venv under a temporary directory it runs ``pip install --dry-run --report`` of the
extra's pins (read from ``setup.py``; wheels only, so nothing is built and no large wheel is
downloaded: pip reads each wheel's metadata) with this machine's pip configuration turned off
(local wheel folders and constraint files would answer instead of the index), then checks the
resolved set: torch is the version vLLM pins, TransformerEngine's core is built for the CUDA major
that torch's CUDA runtime wheel has, and TransformerEngine's torch extension is the same release
(it is an sdist: ``pip install --no-build-isolation transformer-engine-torch==<that>`` after torch,
as the README's GPU install says). Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_extra(setup_py: Path = ROOT / "setup.py") -> list[str]:
    """The ``gpu`` entry of ``EXTRAS`` in ``setup.py`` (read, not executed)."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict)
            and any(getattr(t, "id", None) == "EXTRAS" for t in node.targets)
        ):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and key.value == "gpu":
                    return list(ast.literal_eval(value))  # only this entry: others may name constants
            raise ValueError(f"{setup_py}'s EXTRAS has no 'gpu' entry")
    raise ValueError(f"{setup_py} defines no EXTRAS")


def resolve(requirements: list[str], python: str, workdir: Path) -> dict:
    """pip's ``--report`` of a dry-run install of ``requirements`` in a fresh venv under ``workdir``."""
    venv = workdir / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no find-links folder, extra index or constraint file of this machine
    report = workdir / "report.json"
    subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "--dry-run",
            "--ignore-installed",
            "--only-binary",
            ":all:",
            "--quiet",
            "--report",
            str(report),
            *requirements,
        ],
        check=True,
        env=env,
    )
    return json.loads(report.read_text())


def _name(item: dict) -> str:
    return item["metadata"]["name"].lower().replace("_", "-")


def check(report: dict, cuda_major: int) -> list[tuple[bool, str]]:
    """``(ok, line)`` per check of a resolved set (see the module docstring)."""
    got = {_name(i): i["metadata"] for i in report["install"]}
    lines = []
    torch_v = got.get("torch", {}).get("version")
    lines.append((torch_v is not None, f"torch {torch_v}"))
    vllm = got.get("vllm")
    if vllm is not None:
        pins = [r for r in vllm.get("requires_dist", []) if re.match(r"torch\s*==", r)]
        pinned = pins[0].split("==")[1].split(";")[0].strip() if pins else None
        lines.append((pinned == torch_v, f"vllm {vllm['version']} pins torch {pinned} (resolved {torch_v})"))
    runtime = next((m["version"] for n, m in got.items() if n.startswith("nvidia-cuda-runtime")), None)
    torch_cuda = int(runtime.split(".")[0]) if runtime else None
    lines.append(
        (torch_cuda == cuda_major, f"torch's CUDA runtime wheel {runtime} (CUDA {torch_cuda}; wanted {cuda_major})")
    )
    te = next(((n, m["version"]) for n, m in got.items() if re.fullmatch(r"transformer-engine-cu\d+", n)), None)
    if te is None:
        lines.append((False, "no TransformerEngine core wheel (transformer-engine-cuNN) in the set"))
    else:
        te_cuda = int(te[0].rsplit("cu", 1)[1])
        lines.append((te_cuda == cuda_major, f"{te[0]} {te[1]} (CUDA {te_cuda})"))
        lines.append(
            (
                True,
                f"then: pip install --no-build-isolation transformer-engine-torch=={te[1]} "
                "(sdist; builds against the installed torch, needs nvcc)",
            )
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", type=int, default=13, help="the CUDA major the driver runs (nvidia-smi)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    parser.add_argument("--report", help="check this pip report instead of resolving")
    args = parser.parse_args(argv)
    requirements = gpu_extra()
    print(f"[gpu] extra: {' '.join(requirements)}")
    if args.report:
        report = json.loads(Path(args.report).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="check_gpu_install_") as tmp:
            report = resolve(requirements, args.python, Path(tmp))
    results = check(report, args.cuda)
    for ok, line in results:
        print(("PASS " if ok else "FAIL ") + line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
