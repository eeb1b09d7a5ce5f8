"""Start-up checks of the GPU stack (``megatron_rl.job.preflight.check_gpu_stack``), each by key.

On this CPU machine the probes answer for real: torch sees no GPU and TransformerEngine does not
import; the ``cuda_available`` / ``te_error`` arguments give the answers a GPU node would.
"""

from __future__ import annotations

import pytest

from megatron_rl.algos.needs import resolve_run
from megatron_rl.config import load_config
from megatron_rl.job.preflight import check_gpu_stack

GPUS = ["trainer.device=cuda", "trainer.n_gpus_per_node=2"]
CP2 = ["actor_rollout_ref.actor.megatron.context_parallel_size=2"]


def _check(overrides, **probes):
    config = load_config("grpo", overrides)
    check_gpu_stack(config, resolve_run(config), **probes)


def test_cuda_requested_but_torch_sees_no_gpu_is_refused_by_key():
    with pytest.raises(ValueError, match=r"^trainer.device='cuda' but torch \S+ \(a CPU build\) sees no GPU"):
        _check(GPUS)  # the real probe: this machine's torch is the CPU build
    _check(GPUS, cuda_available=True, te_error=None)
    _check([])  # a CPU run asks nothing of CUDA or TE


def test_te_asked_for_but_not_importable_shows_its_import_error():
    with pytest.raises(
        ValueError,
        match=r"^actor_rollout_ref.actor.model attention_backend='te' needs "
        r"TransformerEngine, which does not import here \(ModuleNotFoundError: "
        r"No module named 'transformer_engine'\)",
    ):
        _check(["actor_rollout_ref.model.config.attention_backend=te"])  # the real probe
    broken = "ImportError: transformer_engine_torch.so: undefined symbol: _ZN3c10"  # TE built against another torch
    with pytest.raises(ValueError, match="undefined symbol"):
        _check(GPUS + CP2 + ["actor_rollout_ref.actor.megatron.dtype=bfloat16"], cuda_available=True, te_error=broken)
    _check(GPUS + CP2 + ["actor_rollout_ref.actor.megatron.dtype=bfloat16"], cuda_available=True, te_error=None)
    _check(["actor_rollout_ref.model.config.attention_backend=sdpa"])  # no TE asked for: nothing to import


def test_context_parallel_at_float32_is_refused_by_key():
    with pytest.raises(
        ValueError,
        match=r"^actor_rollout_ref.actor.megatron.context_parallel_size=2 needs bfloat16 "
        r"or float16 parameters \(this role trains in 'float32'\)",
    ):
        _check(GPUS + CP2, cuda_available=True, te_error=None)
    _check(GPUS + CP2 + ["actor_rollout_ref.actor.megatron.dtype=float16"], cuda_available=True, te_error=None)
