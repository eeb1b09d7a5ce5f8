"""Partial rollouts: generations that a weight push pauses between two engine steps and that then
continue with the new weights (``trainer.v1.partial_rollout``).

The engine is driven step by step (``LLMEngine.add_request`` / ``step`` / ``abort_request``, what
``LLM.generate`` does inside, with ``RequestOutputKind.DELTA`` outputs so that every token is kept
as it arrives). A ``PauseGate`` serialises that loop with weight pushes coming from another thread
(the rollout worker's push calls run in their own Ray concurrency group):

* ``PauseGate.push()`` announces a push, waits for the engine step in progress to end, runs the
  push alone on the engine and counts it (``version``: pushes applied);
* the generation checks ``push_pending`` after every engine step; when a push is pending it
  aborts its unfinished requests (their tokens so far and their log-probs are kept), lets the push
  run, and re-submits each one as a continuation: the prompt plus the tokens generated so far as
  token ids (never re-tokenised text), ``max_tokens`` the remaining budget. The continuation's
  prefill recomputes the KV cache with the new weights (``update_weights`` also resets the prefix
  cache), so the tokens after the push -- and their log-probs -- come from the new weights.

Every token is tagged with the gate's version while it was generated (``PartialSample.versions``);
``VLLMRollout.generate(..., pause=gate)`` puts them in the batch as ``rollout_policy_versions``
``[b, response_len]``. A continuation re-draws with a derived seed (``seed + CONTINUATION_SEED_STRIDE
* pauses``), so seeded runs stay reproducible given where the pushes fell.

Limits: a stop *string* spanning a pause is not detected (stop token ids are); sampling penalties
over output tokens other than ``repetition_penalty`` (which vLLM applies to prompt and output
alike) would restart with the continuation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence

__all__ = ["PauseGate", "PartialSample", "generate_pausable", "CONTINUATION_SEED_STRIDE"]

CONTINUATION_SEED_STRIDE = 1_000_003
"""A continuation after the k-th pause of a sample draws with ``seed + k * CONTINUATION_SEED_STRIDE``."""


class PauseGate:
    """Lets weight pushes pause a generation between engine steps (see the module docstring).

    ``version`` counts the pushes applied through ``push()``; ``pauses`` the generations paused;
    ``steps`` the engine steps generations ran (progress, e.g. for a test's hook).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pushes = 0  # pushes announced and not finished
        self._busy = False  # the engine is held (a generation's step loop, or a push)
        self.version = 0
        self.pauses = 0
        self.steps = 0

    @property
    def push_pending(self) -> bool:
        """True while a push waits for (or holds) the engine: a generation must pause."""
        return self._pushes > 0

    @contextlib.contextmanager
    def push(self) -> Iterator[None]:
        """Hold the engine for one weight push: waits for the engine step in progress (a generation
        pauses at its next check), then runs the body alone. ``version`` grows when the body
        returns without an error (a failed push leaves the weights of the old version)."""
        with self._cond:
            self._pushes += 1
            while self._busy:
                self._cond.wait()
            self._busy = True
        try:
            yield
            with self._cond:
                self.version += 1
        finally:
            with self._cond:
                self._pushes -= 1
                self._busy = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self) -> Iterator[int]:
        """Hold the engine for a generation's steps; waits while a push is pending. Yields the
        version of the weights the engine holds meanwhile."""
        with self._cond:
            while self._busy or self._pushes:
                self._cond.wait()
            self._busy = True
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


@dataclasses.dataclass
class PartialSample:
    """One sample of a pausable generation: its tokens so far, their log-probs and versions."""

    prompt: list[int]
    params: Any  # vllm.SamplingParams with n=1: the sample's original request
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    pauses: int = 0  # how many times a push paused it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def continuation(self) -> tuple[list[int], Any]:
        """The request that continues this sample: prompt + tokens so far (token ids) and the
        original sampling parameters with the remaining token budget and a derived seed."""
        from vllm.sampling_params import RequestOutputKind

        params = self.params.clone()
        params.max_tokens = int(self.params.max_tokens) - len(self.tokens)
        if self.params.seed is not None:
            params.seed = int(self.params.seed) + CONTINUATION_SEED_STRIDE * self.pauses
        params.output_kind = RequestOutputKind.DELTA
        return self.prompt + self.tokens, params


def generate_pausable(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[Any],
    gate: PauseGate,
    *,
    engine_context: Callable[[], Any] = contextlib.nullcontext,
    on_step: Optional[Callable[[int], None]] = None,
) -> list[PartialSample]:
    """Generate one sample per ``(prompt, params)`` (``params[i].n`` must be 1) on ``engine`` (an
    ``LLMEngine``), pausing at every weight push announced on ``gate``; the samples in order.

    Args:
        engine_context: entered around every stretch of engine calls (the engine's torch.distributed
            world: ``VLLMRollout.engine_call``); always inside the gate's hold.
        on_step: called with ``gate.steps`` after every engine step, the gate still held (progress).
    """
    from vllm.inputs import TokensPrompt

    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts need as many sampling params, got {len(params)}")
    samples = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if sp.n != 1:
            raise ValueError(f"generate_pausable: sampling params {i} have n={sp.n}; expand them to n=1 requests")
        samples.append(PartialSample(list(p), sp))
    tag = uuid.uuid4().hex[:12]
    while not all(s.finished for s in samples):
        with gate.hold() as version, engine_context():
            live: dict[str, PartialSample] = {}
            for j, sample in enumerate(samples):
                if sample.finished:
                    continue
                tokens, sp = sample.continuation()
                request_id = f"partial-{tag}-{j}-{sample.pauses}"
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=tokens), sp)
                live[request_id] = sample
            try:
                _run_segment(engine, live, version, gate, on_step)
            except BaseException:  # leave no request of ours behind in the engine for its next caller
                if live:
                    with contextlib.suppress(Exception):
                        engine.abort_request(list(live))
                raise
    return samples


def _run_segment(
    engine: Any, live: dict[str, PartialSample], version: int, gate: PauseGate, on_step: Optional[Callable[[int], None]]
) -> None:
    """Step the engine until the ``live`` requests finish or a push is pending (then abort the rest:
    their tokens so far stay in their samples, which the caller continues)."""
    while live:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"the engine finished without reporting requests {sorted(live)[:4]}")
        for out in engine.step():
            sample = live.get(out.request_id)
            if sample is None:  # not ours: nothing else runs on this engine meanwhile
                continue
            comp = out.outputs[0]
            new = list(comp.token_ids)
            sample.tokens += new
            sample.versions += [version] * len(new)
            if sample.params.logprobs is not None:
                sample.log_probs += [step[tok].logprob for step, tok in zip(comp.logprobs, new)]
            if out.finished:
                sample.finish_reason = comp.finish_reason
                del live[out.request_id]
        gate.steps += 1
        if on_step is not None:
            on_step(gate.steps)
        if live and gate.push_pending:  # pause: keep what was generated, continue after the push
            engine.abort_request(list(live))
            for sample in live.values():
                sample.pauses += 1
            live.clear()
            gate.pauses += 1
