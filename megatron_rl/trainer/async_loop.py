"""The asynchronous training loops of ``trainer.v1.trainer_mode`` (``colocate_async``, ``separate_async``).

``RayPPOTrainer.fit`` takes its batches from ``AsyncBatches`` when the mode is not ``sync`` (the
loop and the step's tail are the synchronous run's: ``megatron_rl.trainer.batch_source``). A rollouter
(``Rollouter``) draws prompt batches, has the Ray rollout worker generate them with whatever
weights it holds (``RolloutWorker.generate_tagged`` tags each call with the engine's policy
version: the weight pushes it had received), scores them on the driver and streams the finished
prompt groups into the bounded ``ReplayBuffer``; the trainer takes ``data.train_batch_size``
groups when they are ready, trains on them (``RayPPOTrainer.train_step``: old log-probs, advantages,
update, weight push) and moves the buffer's window.

* ``colocate_async`` (one-step off-policy with ``num_warmup_batches=1``): the driver itself submits
  the generation of the batches ahead before training the current one; the rollout worker runs
  them while the actor trains, and the weight push queues behind them on the worker. Step k
  therefore trains on rollouts of the weights after step k-2; step 1 is synchronous. Decoupled
  rollout correction (the actor recomputes old log-probs) stays available.
* ``separate_async``: a rollouter thread keeps one generation in flight at a time (so a push
  waits for at most one generation), scores it and fills the buffer up to ``num_warmup_batches``
  batches ahead; the rollout worker runs on its own resources (``placement``). Bypass mode is
  forced (``async_run_config``): the rollout's log-probs are the old ones, as in verl's V1.

DAPO dynamic sampling (``algorithm.filter_groups``) filters each finished group before the buffer
(its slot is freed and refilled; the trainer waits for ``train_batch_size`` kept groups). ReMax's
greedy baseline (``colocate_async`` only) is queued on the rollout worker right behind its samples,
so one policy version generates both. Checkpoints drain the queue deterministically
(``replay_buffer.DrawLedger``): the trainer state records the dataloader position before the oldest
drawn batch with an unsettled group and the uids settled from there on (``async_settled_uids``); a
resumed run re-draws from there, leaves those out and generates the rest again with the
checkpoint's weights. No prompt group is lost or trained twice; one evicted, filtered or whose
reward failed before the checkpoint never comes back. Every step's trained sample ids
(``<epoch>-<row>/<j>``) and the ids evicted or filtered since the step before go to
``async_samples.jsonl`` in the run directory (``SampleLedger``).

Every sample carries ``rollout_policy_version`` (all its tokens come from that one version, unless
``trainer.v1.partial_rollout``: then a push pauses the generation in flight, which continues with
the new weights, every token carries its own version in ``rollout_policy_versions`` [b, R], the
sample's is its oldest token's, and the staleness metrics count tokens by their own version;
``async/partial/partial_ratio`` / ``total_partial_num`` / ``max_partial_span`` are verl's
``fully_async/partial/*``). Metrics per step: ``async/staleness_mean`` / ``async/staleness_max``
(policy versions behind the trainer, over the step's response tokens),
``async/token_fraction/staleness_<d>``, ``async/queue_depth``, ``async/in_flight_groups``,
``async/trainer_idle_s`` (waiting for a batch), ``async/rollout_idle_s`` (the step's wall time the
engine was not generating), ``training/off_policy/evicted_samples``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_rl.data.batch import Batch
from megatron_rl.data.rewards import RewardError
from megatron_rl.trainer.async_records import SAMPLES_FILE, GroupFilter, SampleLedger, select_prompts
from megatron_rl.trainer.replay_buffer import DrawLedger, Group, ReplayBuffer
from megatron_rl.trainer.rollout_phase import REWARD_EXTRA_KEYS, reward_metrics

__all__ = [
    "AsyncSettings",
    "async_settings",
    "async_run_config",
    "check_async_trainer",
    "AsyncBatches",
    "Rollouter",
    "staleness_metrics",
    "partial_staleness_metrics",
]


def async_run_config(config: Any) -> Any:
    """``config`` with what its ``trainer.v1`` mode forces: ``separate_async`` switches on bypass mode
    (``algorithm.rollout_correction.bypass_mode=True``; old log-probs = the rollout's), warning when
    the config had decoupled correction or none."""
    if config.trainer.v1.trainer_mode != "separate_async":
        return config
    from megatron_rl.config.algorithm import RolloutCorrectionConfig

    rc = config.algorithm.rollout_correction
    if rc is not None and rc.bypass_mode:
        return config
    warnings.warn(
        "trainer.v1.trainer_mode='separate_async' forces algorithm.rollout_correction.bypass_mode=True "
        "(the rollout's log-probs are the old ones; verl's V1 does the same)",
        UserWarning,
        stacklevel=3,
    )
    rc = RolloutCorrectionConfig(rollout_is=None, bypass_mode=True) if rc is None else rc.replace(bypass_mode=True)
    return config.replace(algorithm=config.algorithm.replace(rollout_correction=rc))


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    """What the asynchronous loop runs with, read off ``trainer.v1`` (``async_settings``)."""

    mode: str
    lookahead: int
    threshold: Optional[int]
    strategy: str
    mini_batches_per_push: Optional[int]  # separate_async: verl's parameter_sync_step; None otherwise


def async_settings(v1: Any) -> AsyncSettings:
    """The loop's settings from the ``trainer.v1`` section."""
    sampler = v1.sampler
    push = v1.separate_async.parameter_sync_step if v1.trainer_mode == "separate_async" else None
    return AsyncSettings(
        v1.trainer_mode, v1.lookahead(), sampler.max_off_policy_threshold, sampler.max_off_policy_strategy, push
    )


def check_async_trainer(config: Any, needs: Any, total_steps: int) -> None:
    """What the asynchronous loops cannot run, refused before any worker starts (``ValueError``):
    an estimator's greedy baseline (ReMax) outside ``colocate_async`` or with partial rollouts, and
    warm-up batches that reach past the run's last step."""
    v1 = config.trainer.v1
    if not v1.is_async:
        return
    # colocate_async submits a batch's greedy baseline right behind its samples from the driver, which
    # also pushes the weights: both come from one policy version. The rollouter thread of
    # separate_async races the trainer's pushes, and partial rollouts pause the samples mid-way.
    if needs.baseline and (v1.trainer_mode != "colocate_async" or v1.partial_rollout):
        why = "with trainer.v1.partial_rollout=True" if v1.partial_rollout else "outside colocate_async"
        raise ValueError(
            f"trainer.v1.trainer_mode={v1.trainer_mode!r} with algorithm.adv_estimator="
            f"{config.algorithm.adv_estimator!r} (a greedy baseline per prompt) is not supported {why} "
            "(the baseline must come from the weights that generated its samples); use "
            "trainer_mode='colocate_async' without partial rollouts, or 'sync'"
        )
    ahead = v1.lookahead()
    if ahead >= total_steps:
        raise ValueError(
            f"trainer.v1.{v1.trainer_mode}.num_warmup_batches={ahead} is not smaller than the run's "
            f"{total_steps} steps: the batches generated ahead would never be trained on"
        )


def _split_groups(batch: Batch) -> list[tuple[str, list[int]]]:
    """``(uid, row indices)`` per prompt group, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(batch["uid"]):
        groups.setdefault(str(uid), []).append(i)
    return list(groups.items())


class Rollouter:
    """Draws prompt batches, generates and scores them, and streams groups into ``buffer``.

    Args:
        phase: the run's ``RolloutPhase`` (dataloader, reward, rollout worker).
        buffer: the ``ReplayBuffer`` (its window bounds what may be submitted).
        threaded: True (``separate_async``): a thread keeps one generation in flight; False
            (``colocate_async``): the driver submits in ``pump()`` and collects in ``wait_batch``.
        max_failed: consecutive chunks whose reward failed before the run stops
            (``trainer.max_consecutive_skipped_steps``).
        settled_before: uids settled before the checkpoint the run resumed from (its
            ``async_settled_uids``): the re-drawn prompt batches leave them out (``DrawLedger``).
    """

    def __init__(
        self, phase: Any, buffer: ReplayBuffer, *, threaded: bool, max_failed: int = 3, settled_before: Any = ()
    ):
        self.phase, self.buffer, self.threaded, self.max_failed = phase, buffer, threaded, max_failed
        self.ledger = DrawLedger(settled_before)
        fg = getattr(phase, "filter_groups", None)  # DAPO dynamic sampling: groups filtered before the buffer
        self.filter = (
            None
            if fg is None
            else GroupFilter(
                fg, buffer.batch_groups, buffer.lookahead * buffer.batch_groups // phase.dataloader.batch_size
            )
        )
        dl = phase.dataloader  # prompt batches drawn so far (a resumed run continues the count): the seed index
        self.chunks = dl.epoch * dl.num_batches + dl.batch_in_epoch
        self.pending: list[tuple[Any, dict, list[Group]]] = []  # submitted, not collected: (future, prompts, groups)
        self.carry: Optional[tuple[dict, list[Group]]] = None  # a drawn batch's groups not submitted yet
        self.busy: list[tuple[float, float]] = []  # the engine's (start, end) generation intervals
        self.failed_in_a_row, self.failed_samples, self.last_error = 0, 0, ""
        self.cond = threading.Condition()
        self.error: Optional[BaseException] = None
        self.stopping = False
        self.thread: Optional[threading.Thread] = None

    # -- submitting -------------------------------------------------------------------------
    def _submit_one(self) -> bool:
        """Submit the generation of the next prompt groups the window has room for (the rest of the
        last drawn batch first, else a new draw); True if submitted. A batch is submitted in parts
        only when evicted or filtered groups left the window room for fewer than its groups."""
        budget = self.buffer.budget()
        if budget < 1:
            return False
        if self.carry is None:
            while True:  # after a resume, batches whose every group settled before the checkpoint are passed over
                before = self.phase.dataloader.state_dict()
                prompts = self.phase.dataloader.next_batch()
                self.chunks += 1  # the per-batch sampling seed follows the draw, skipped or not
                keep, skipped = self.ledger.split([str(u) for u in prompts["uid"]])
                if skipped:
                    prompts = select_prompts(prompts, keep)
                groups = [Group(uid=str(u), size=self.phase.n) for u in prompts["uid"]]
                self.ledger.record(before, groups, skipped)
                if groups:
                    break
            self.carry = (prompts, groups)
        prompts, groups = self.carry
        if len(groups) > budget:  # the rest waits in carry (unsettled: a checkpoint re-draws its batch)
            self.carry = (select_prompts(prompts, list(range(budget, len(groups)))), groups[budget:])
            prompts, groups = select_prompts(prompts, list(range(budget))), groups[:budget]
        else:
            self.carry = None
        self.buffer.reserve(groups)
        future = self.phase.submit(prompts, step=self.chunks)
        if self.phase.baseline:  # ReMax: the greedy response per prompt, queued right behind the samples
            future = [future, self.phase.submit(prompts, step=self.chunks, n=1, do_sample=False)]
        self.pending.append((future, prompts, groups))
        return True

    def pump(self) -> None:
        """Submit generations while the window allows (the driver-side mode)."""
        while self._submit_one():
            pass

    # -- collecting -------------------------------------------------------------------------
    def _finish(self, out: dict, prompts: dict, groups: list[Group]) -> None:
        """Score one finished generation and put its groups into the buffer (the reward's failure
        frees their slots instead). ``out`` is ``[samples, greedy baseline]`` for ReMax."""
        out, base = out if isinstance(out, list) else (out, None)
        batch = self.phase.to_batch(prompts, out["batch"])
        self.busy.append((float(out["start"]), float(out["end"])))
        version = int(out["policy_version"])
        batch["rollout_policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        if "rollout_policy_versions" in batch:  # partial rollouts: a sample's version is its oldest token's
            tokens = batch["rollout_policy_versions"].masked_fill(~batch["response_mask"].bool(), 2**62)
            batch["rollout_policy_version"] = torch.minimum(tokens.min(-1).values, batch["rollout_policy_version"])
        try:
            self.phase.score(batch)
            if base is not None:
                self._score_baseline(batch, prompts, base, int(out["policy_version"]))
        except RewardError as err:
            self.failed_in_a_row += 1
            self.failed_samples += len(batch)
            self.last_error = str(err)
            print(f"rollout chunk {self.chunks}: reward failed, its groups are dropped: {err}", flush=True)
            for group in groups:
                self.buffer.discard(group)
            if self.failed_in_a_row >= self.max_failed:
                raise RuntimeError(
                    f"{self.failed_in_a_row} rollout chunks in a row failed their reward "
                    f"(trainer.max_consecutive_skipped_steps={self.max_failed}): {err}"
                ) from err
            return
        self.failed_in_a_row = 0
        rows = dict(_split_groups(batch))
        keep = None if self.filter is None else self.filter.keep(batch)
        for group in groups:
            if keep is not None:
                self.filter.count(group.uid, bool(keep[rows[group.uid][0]]))
                if not keep[rows[group.uid][0]]:
                    self.buffer.discard(group, "filtered")
                    continue
            group.payload = batch.select_idxs(rows[group.uid])
            self.buffer.put(group, int(group.payload["rollout_policy_version"].min()))

    def _score_baseline(self, batch: Batch, prompts: dict, base: dict, version: int) -> None:
        """ReMax: ``reward_baselines`` = the reward of each prompt's greedy response, which the same
        policy version generated (``RuntimeError`` otherwise: the push got between them)."""
        if int(base["policy_version"]) != version:
            raise RuntimeError(
                f"ReMax baseline generated by policy version {base['policy_version']}, its samples by "
                f"{version}: a weight push got between them"
            )
        try:
            scores = self.phase.reward_fn(self.phase.to_batch(prompts, base["batch"])).scores  # [prompts]
        except RewardError as err:
            err.args = (f"greedy baseline: {err}",)
            raise
        batch["reward_baselines"] = scores.repeat_interleave(self.phase.n)

    def _collect_oldest(self) -> None:
        future, prompts, groups = self.pending.pop(0)
        self._finish(self.phase.resolve(future), prompts, groups)

    def wait_batch(self, trainer_version: int) -> tuple[list[Group], dict[str, float], float]:
        """Block until the next batch is ready; ``(groups, buffer metrics, seconds waited)``."""
        start = time.perf_counter()
        if not self.threaded:
            while not self.buffer.ready(trainer_version):
                if self.filter is not None:
                    self.filter.check_rounds()
                if not self.pending:
                    self.pump()
                    if not self.pending:
                        raise RuntimeError("async rollouter: the window is full but the next batch is not ready")
                self._collect_oldest()
            groups, metrics = self.buffer.take(trainer_version)
            metrics.update({} if self.filter is None else self.filter.take_metrics())
            return groups, metrics, time.perf_counter() - start
        with self.cond:
            while self.error is None and not self.buffer.ready(trainer_version):
                if self.filter is not None:
                    self.filter.check_rounds()
                self.cond.wait(timeout=1.0)
            if self.error is not None:
                raise RuntimeError(f"async rollouter failed: {self.error}") from self.error
            groups, metrics = self.buffer.take(trainer_version)
            metrics.update({} if self.filter is None else self.filter.take_metrics())
            self.cond.notify_all()
        return groups, metrics, time.perf_counter() - start

    def step_done(self) -> None:
        """The trainer pushed its weights: move the window and let the rollouter submit more."""
        with self.cond:
            self.buffer.step_done()
            self.cond.notify_all()
        if not self.threaded:
            self.pump()

    # -- the thread (separate_async) --------------------------------------------------------
    def start(self) -> None:
        """Begin generating: the first submissions (driver mode) or the rollouter thread."""
        if not self.threaded:
            self.pump()
            return
        self.thread = threading.Thread(target=self._run, name="async-rollouter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stopping and self.buffer.budget() < 1:
                        self.cond.wait(timeout=1.0)
                    if self.stopping:
                        return
                    self._submit_one()
                future, prompts, groups = self.pending[-1]
                out = self.phase.resolve(future)  # the engines generate while the trainer trains
                with self.cond:
                    self.pending.pop()
                    self._finish(out, prompts, groups)
                    self.cond.notify_all()
        except BaseException as err:  # surfaced by wait_batch in the driver's thread
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def stop(self) -> None:
        """Stop submitting and wait for what is in flight (the engine finishes its call)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=600)
        for future, _, _ in self.pending:
            try:
                self.phase.resolve(future)
            except Exception:  # already failing: nothing more to do with an abandoned generation
                pass
        self.pending = []

    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint taken now records so that a resumed run loses no prompt group and trains
        none twice (``DrawLedger.resume_point``): ``dataloader`` -- the position before the oldest
        drawn batch with a group not yet settled (it and every later batch are re-drawn and their
        unsettled groups generated again, with the checkpoint's weights) -- and
        ``async_settled_uids``, the groups of those batches already taken, evicted, discarded or
        filtered, which the resumed run leaves out."""
        with self.cond:
            point = self.ledger.resume_point(self.phase.dataloader.state_dict())
        return {"dataloader": point["dataloader"], "async_settled_uids": point["settled_uids"]}

    def take_filtered(self) -> list[str]:
        """The uids DAPO's filter dropped since the last call (for the sample ledger)."""
        with self.cond:  # the rollouter thread appends to them
            if self.filter is None:
                return []
            filtered = self.filter.filtered_uids[:]
            self.filter.filtered_uids.clear()
        return filtered

    def busy_within(self, start: float, end: float) -> float:
        """Seconds the engine generated within the wall-clock window ``[start, end]``."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.busy)


def staleness_metrics(batch: Batch, trainer_version: int) -> dict[str, float]:
    """``async/staleness_mean`` / ``_max`` over the batch's response tokens (policy versions behind
    the trainer) and ``async/token_fraction/staleness_<d>`` per lag; with partial rollouts each token
    counts with its own version (``rollout_policy_versions``, see ``partial_staleness_metrics``)."""
    if "rollout_policy_versions" in batch:
        return partial_staleness_metrics(batch, trainer_version)
    lag = (trainer_version - batch["rollout_policy_version"]).double()
    tokens = batch["response_mask"].sum(-1).double()
    total = float(tokens.sum()) or 1.0
    out = {
        "async/staleness_mean": float((lag * tokens).sum()) / total,
        "async/staleness_max": float(lag.max()),
        "async/trainer_policy_version": float(trainer_version),
        "async/rollout_policy_version_min": float(batch["rollout_policy_version"].min()),
    }
    for d in sorted(set(lag.long().tolist())):
        out[f"async/token_fraction/staleness_{d}"] = float(tokens[lag.long() == d].sum()) / total
    return out


def partial_staleness_metrics(batch: Batch, trainer_version: int) -> dict[str, float]:
    """``staleness_metrics`` over per-token versions (partial rollouts), plus verl's partial-rollout
    statistics: ``async/partial/total_partial_num`` (samples whose tokens span several versions),
    ``partial_ratio`` (their share) and ``max_partial_span`` (most versions one sample spans, minus 1)."""
    mask = batch["response_mask"].bool()
    versions = batch["rollout_policy_versions"].long()
    lag = (trainer_version - versions)[mask]
    total = float(mask.sum()) or 1.0
    out = {
        "async/staleness_mean": float(lag.double().sum()) / total,
        "async/staleness_max": float(lag.max()) if lag.numel() else 0.0,
        "async/trainer_policy_version": float(trainer_version),
        "async/rollout_policy_version_min": float(batch["rollout_policy_version"].min()),
    }
    for d in sorted(set(lag.tolist())):
        out[f"async/token_fraction/staleness_{d}"] = float((lag == d).sum()) / total
    big = 2**62
    newest = versions.masked_fill(~mask, -big).max(-1).values
    oldest = versions.masked_fill(~mask, big).min(-1).values
    span = torch.where(mask.any(-1), newest - oldest, torch.zeros_like(newest))
    out["async/partial/total_partial_num"] = float((span > 0).sum())
    out["async/partial/partial_ratio"] = float((span > 0).double().mean())
    out["async/partial/max_partial_span"] = float(span.max())
    return out


def _assemble(groups: list[Group]) -> Batch:
    """The groups' rows as one batch (reward fields missing from some chunk become None)."""
    parts = [g.payload for g in groups]
    keys = list(dict.fromkeys(k for b in parts for k in b.meta_info.get(REWARD_EXTRA_KEYS, ())))
    for b in parts:
        for key in keys:
            if key not in b:
                b[key] = [None] * len(b)
    batch = Batch.concat(parts)
    batch.meta_info = {**batch.meta_info, REWARD_EXTRA_KEYS: keys}
    return batch


class AsyncBatches:
    """The batch source (``megatron_rl.trainer.batch_source``) of the asynchronous modes: a step's
    batch is ``data.train_batch_size`` prompt groups taken from the replay buffer the ``Rollouter``
    fills ahead of the trainer (see the module docstring).

    ``versions`` maps each policy version (weight push) to the step it came after,
    ``trained_versions`` each step to the policy versions of the rollouts it trained on and
    ``trained_uids`` each step to the prompt groups it trained on.
    """

    last_error = ""  # a failed reward frees its groups' slots; a step is never skipped

    def __init__(self, trainer: Any):
        cfg, tcfg = trainer.config, trainer.config.trainer
        settings = async_settings(tcfg.v1)
        if settings.mini_batches_per_push is not None:  # one push per step = parameter_sync_step optimizer steps
            per_step = cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
            if per_step != settings.mini_batches_per_push:
                raise ValueError(
                    f"trainer.v1.separate_async.parameter_sync_step={settings.mini_batches_per_push} but a "
                    f"step has {per_step} mini-batches"
                )
        self.trainer, self.phase = trainer, trainer.rollout_phase
        self.buffer = ReplayBuffer(cfg.data.train_batch_size, settings.lookahead, settings.threshold, settings.strategy)
        resumed = trainer.resume_state or {}  # the checkpoint's trainer state, if one was loaded
        self.rollouter = Rollouter(
            self.phase,
            self.buffer,
            threaded=settings.mode == "separate_async",
            max_failed=tcfg.max_consecutive_skipped_steps,
            settled_before=resumed.get("async_settled_uids", ()),
        )
        self.ledger = SampleLedger(Path(trainer.log_dir) / SAMPLES_FILE, trainer.global_steps)
        self.versions = {trainer.weight_version: trainer.global_steps}
        self.trained_versions: dict[int, list[int]] = {}
        self.trained_uids: dict[int, list[str]] = {}

    def __enter__(self) -> "AsyncBatches":
        self.rollouter.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.rollouter.stop()

    def next_batch(self, step: int, metrics: dict, timing: dict) -> Batch:
        """Wait for the step's groups, assemble them, record them; the step's buffer and staleness metrics."""
        rollouter = self.rollouter
        with self.trainer.phases.stage("gen", timing, metrics):  # the rollouter's engines in their phase
            version = self.trainer.weight_version
            groups, buffer_metrics, waited = rollouter.wait_batch(version)
        batch = _assemble(groups)
        metrics.update(buffer_metrics)
        metrics.update(reward_metrics(batch))
        metrics.update(staleness_metrics(batch, version))
        metrics.update(rollouter.phase.replica_metrics())  # the last generation's replicas
        metrics["async/trainer_idle_s"] = waited
        self.trained_versions[step] = sorted(set(batch["rollout_policy_version"].tolist()))
        self.trained_uids[step] = sorted(set(str(u) for u in batch["uid"]))
        filtered = rollouter.take_filtered()
        self.ledger.write(step, groups, evicted=self.buffer.last_evicted, filtered=filtered, n=self.phase.n)
        self.phase.dump_samples(step, batch)
        return batch

    def trained(self, step: int) -> None:
        """The step's update and weight push are done: the buffer's window moves on."""
        self.versions[self.trainer.weight_version] = step
        self.rollouter.step_done()

    def end_metrics(self, metrics: dict, wall_start: float) -> None:
        now = time.time()
        metrics["async/rollout_idle_s"] = max(0.0, (now - wall_start) - self.rollouter.busy_within(wall_start, now))
        if self.rollouter.failed_samples:
            metrics["reward/num_failed_samples"], self.rollouter.failed_samples = (
                float(self.rollouter.failed_samples),
                0,
            )

    def state(self) -> dict[str, Any]:
        """A checkpoint drains the queue: the prompts rewind to the oldest unsettled batch (``DrawLedger``)."""
        return self.rollouter.resume_state()
