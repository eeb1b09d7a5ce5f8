"""Runs several conversions in one process (for tests): each case is ``main(argv)`` of a converter,
with this process as the only rank (the torchrun path: no spawned ranks, imports paid once).

    python tests/tools/convert_cases.py CASES.json   # [{"tool": "hf-to-mcore", "argv": [...], "env": {...}}, ...]

Prints one JSON line per case: its exit code, stdout and stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    """Run the cases named in ``sys.argv[1]`` one after another."""
    from parallel.testing import find_free_port
    from megatron_rl.convert import hf_to_mcore, mcore_to_hf
    from megatron_rl.convert.launch import quiet_warnings

    quiet_warnings()
    tools = {"hf-to-mcore": hf_to_mcore.main, "mcore-to-hf": mcore_to_hf.main}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", CUDA_VISIBLE_DEVICES="")
    from parallel.bridge.hf_files import HFCheckpointReader

    plain_read = HFCheckpointReader.read
    for case in json.loads(Path(sys.argv[1]).read_text()):
        os.environ["MASTER_PORT"] = str(find_free_port())
        saved = {k: os.environ.get(k) for k in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = tools[case["tool"]](case["argv"])
        except BaseException as exc:  # noqa: BLE001 - reported as the case's result
            rc, err = 99, io.StringIO(err.getvalue() + f"{type(exc).__name__}: {exc}")
        finally:
            HFCheckpointReader.read = plain_read  # a fault hook patches it for its case only
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}), flush=True)


if __name__ == "__main__":
    main()
