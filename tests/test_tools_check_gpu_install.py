"""tools/check_gpu_install.py: the [gpu] extra is pinned, and the resolved set's checks catch a mismatch.

The resolution itself needs the package index (run by hand: its output is in the issue 35 note);
here ``check`` reads pip ``--report`` entries of the shape pip writes (``install[].metadata``).
"""

from __future__ import annotations

from tools.check_gpu_install import check, gpu_extra


def _report(**versions):
    requires = {"vllm": ["torch==2.13.0", "transformers>=4.56"]}
    return {
        "install": [
            {"metadata": {"name": n.replace("_", "-"), "version": v, "requires_dist": requires.get(n, [])}}
            for n, v in versions.items()
        ]
    }


GOOD = dict(torch="2.13.0", vllm="0.32.0", nvidia_cuda_runtime="13.0.96", transformer_engine_cu13="2.20.2")


def test_the_gpu_extra_pins_torch_vllm_and_te_core():
    assert gpu_extra() == ["torch==2.13.0", "vllm==0.32.0", "transformer-engine[core-cu13]==2.20.2"]


def test_an_agreeing_set_passes_every_check():
    results = check(_report(**GOOD), cuda_major=13)
    assert all(ok for ok, _ in results), results
    assert results[-1][1].startswith("then: pip install --no-build-isolation transformer-engine-torch==2.20.2")


def test_mismatches_fail_by_name():
    failed = [line for ok, line in check(_report(**dict(GOOD, torch="2.14.0")), cuda_major=13) if not ok]
    assert failed == ["vllm 0.32.0 pins torch 2.13.0 (resolved 2.14.0)"]
    failed = [line for ok, line in check(_report(**GOOD), cuda_major=12) if not ok]  # a CUDA 12 driver
    assert failed == [
        "torch's CUDA runtime wheel 13.0.96 (CUDA 13; wanted 12)",
        "transformer-engine-cu13 2.20.2 (CUDA 13)",
    ]
    no_te = {k: v for k, v in GOOD.items() if k != "transformer_engine_cu13"}
    assert [line for ok, line in check(_report(**no_te), 13) if not ok] == [
        "no TransformerEngine core wheel (transformer-engine-cuNN) in the set"
    ]
