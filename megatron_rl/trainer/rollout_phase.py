"""The first phase of a step: generate responses and score them into the step's ``Batch``.

``RolloutPhase.run(step)`` draws the step's prompts, has the rollout worker sample ``n``
responses per prompt (seeded by (rollout seed, step, round), so a resumed run draws what the
uninterrupted one would have), and scores them: the rule reward (``token_level_scores`` on
each response's last token), plus the reward model's score when one runs, plus -- when the
estimator declared ``needs_baseline`` (ReMax) -- one greedy response per prompt scored as
``reward_baselines``. Under DAPO dynamic sampling (``algorithm.filter_groups``) it repeats
generation rounds until ``data.train_batch_size`` prompts have informative groups, bounded by
``filter_groups.max_num_gen_batches``. A reward that fails returns None: the step is reported
(``training/step_skipped``) and skipped, and ``last_error`` says why.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from megatron_rl.algos.dapo import compute_filter_metric, filter_groups
from megatron_rl.algos.needs import RunNeeds
from megatron_rl.config import RunConfig
from megatron_rl.data.batch import Batch
from megatron_rl.rollout.agent.session_batch import agent_batch, agent_metrics
from megatron_rl.data.rewards import RewardError, finite_means
from megatron_rl.trainer.callbacks import ground_truths
from megatron_rl.trainer.watchdog import phase as timer  # phases the hang watchdog sees

__all__ = ["RolloutPhase", "PROMPT_FIELDS", "reward_metrics"]

PROMPT_FIELDS = ("data_source", "ground_truth", "extra_info", "index", "raw_prompt", "reward_model")
"""Per-prompt values of the dataloader batch that follow their prompt's ``n`` samples."""
REWARD_EXTRA_KEYS = "reward_extra_keys"
"""``meta_info`` key: the per-sample reward fields (``acc``, ``score`` ...) the reward returned."""
_SEED_STRIDE = 1_000_003  # > samples per generation round: per-sample seeds never repeat across rounds


def reward_metrics(batch: Batch) -> dict[str, float]:
    """``reward/<key>/mean`` over the finite values of every numeric per-sample reward field, and
    ``reward/<key>/num_nonfinite`` where some were NaN/inf (``finite_means``)."""
    return finite_means({key: batch[key] for key in batch.meta_info.get(REWARD_EXTRA_KEYS, ())})


class RolloutPhase:
    """Generation + scoring of one step (see the module docstring).

    Args:
        config: the run.
        needs: what the run needs (``baseline`` turns on ReMax's greedy baseline).
        rollout: the ``RolloutRouter`` over the run's engines (``megatron_rl.workers.router``).
        dataloader: the training ``PromptDataLoader``.
        reward_fn: the rule reward (``RewardFunction``).
        reward_model: the reward-model worker group, or None.
        dump: where each step's scored samples go (``trainer.rollout_data_dir``), or None.
    """

    def __init__(
        self,
        config: RunConfig,
        needs: RunNeeds,
        rollout: Any,
        dataloader: Any,
        reward_fn: Any,
        reward_model: Any = None,
        dump: Any = None,
        stage: Any = None,
    ):
        self.rollout, self.dataloader, self.reward_fn, self.reward_model = rollout, dataloader, reward_fn, reward_model
        self.dump = dump
        # the step's stage context (``PhaseRunner.stage``: timed, watched, the devices in the phase "gen");
        # without a runner, timed and watched only
        self.stage = stage or (lambda name, timing, metrics=None: timer(name, timing))
        self.n = config.actor_rollout_ref.rollout.n
        self.seed = config.actor_rollout_ref.rollout.seed
        self.baseline = needs.baseline
        self.multi_turn = config.actor_rollout_ref.rollout.multi_turn.enable  # agent sessions instead of samples
        self.chat_template = config.actor_rollout_ref.model.custom_chat_template
        self.train_batch_size = config.data.train_batch_size
        fg = config.algorithm.filter_groups
        self.filter_groups = fg if fg is not None and fg.enable else None
        self.last_error = ""

    # -- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: dict[str, Any],
        *,
        step: int = 0,
        gen_round: int = 0,
        validate: bool = False,
        greedy: bool = False,
    ) -> Batch:
        """``n`` samples per prompt (``val_kwargs`` when validating, one greedy one with ``greedy``)
        as a ``Batch``; each prompt's ``PROMPT_FIELDS`` follow its samples."""
        if validate:
            kwargs: dict[str, Any] = {"validate": True}
        elif greedy:  # ReMax's baseline: one greedy response per prompt
            kwargs = {"n": 1, "do_sample": False}
        else:
            kwargs = {"n": self.n, "seed": self.seed + _SEED_STRIDE * (step * 64 + gen_round)}
        if self.multi_turn:  # megatron_rl.rollout.agent: chat messages in, sessions (observations masked) out
            return agent_batch(
                self.rollout.run_agent_sessions(
                    list(prompts["raw_prompt"]), uids=list(prompts["uid"]), chat_template=self.chat_template, **kwargs
                ),
                prompts,
                PROMPT_FIELDS,
            )
        out = self.rollout.generate(
            {"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"]},
            uids=list(prompts["uid"]),
            **kwargs,
        )
        return self.to_batch(prompts, out)

    def submit(self, prompts: dict[str, Any], *, step: int, gen_round: int = 0, **kwargs: Any) -> Any:
        """Start the training generation ``generate`` would run, without waiting: the router's pending
        ``RolloutWorker.generate_tagged`` calls (``resolve`` waits for them; the asynchronous trainer
        then takes the output with ``to_batch``). ``kwargs`` replace the sampling (ReMax's greedy
        baseline: ``n=1, do_sample=False``, unseeded)."""
        n = kwargs.pop("n", self.n)
        seed = None if kwargs else self.seed + _SEED_STRIDE * (step * 64 + gen_round)
        return self.rollout.submit(
            "generate_tagged",
            {"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"]},
            n=n,
            seed=seed,
            uids=list(prompts["uid"]),
            **kwargs,
        )

    def resolve(self, pending: Any) -> Any:
        """The output of ``submit`` (a list of them: a list of outputs), once every replica answered."""
        if isinstance(pending, list):
            return [self.resolve(p) for p in pending]
        return self.rollout.collect(pending)

    def replica_metrics(self) -> dict[str, float]:
        """``rollout/replicas`` and the last generation's per-replica balance and times (``RolloutRouter.metrics``)."""
        return self.rollout.metrics()

    def to_batch(self, prompts: dict[str, Any], out: dict[str, Any]) -> Batch:
        """The rollout worker's output for ``prompts`` as a ``Batch``; each prompt's
        ``PROMPT_FIELDS`` follow its samples."""
        batch = Batch.from_single_dict(out)
        repeats = len(batch) // len(prompts["uid"])
        for key in PROMPT_FIELDS:
            if key in prompts:
                batch[key] = [x for x in prompts[key] for _ in range(repeats)]
        return batch

    # -- scoring ----------------------------------------------------------------------------
    def score(self, batch: Batch) -> None:
        """``token_level_scores`` = rule reward (``RewardError`` on a failure or a non-finite score)
        + the reward model's score on each response's last token; the reward's per-sample fields
        become batch fields named in ``meta_info["reward_extra_keys"]``."""
        out = self.reward_fn(batch)
        scores = out.token_level_scores
        extra = dict(out.reward_extra_info)
        if self.reward_model is not None:
            rm = self.reward_model.compute_rm_score(batch)["rm_scores"].float()  # [b]
            if not torch.isfinite(rm).all():
                bad = torch.nonzero(~torch.isfinite(rm)).flatten().tolist()
                sources = batch.get("data_source")
                raise RewardError(
                    [
                        (i, sources[i] if sources is not None else None, f"reward model score {float(rm[i])}")
                        for i in bad
                    ],
                    len(rm),
                )
            last = (batch["response_mask"].sum(-1).long() - 1).clamp(min=0)
            scores = scores.scatter_add(1, last[:, None], rm[:, None])
            extra["rm_score"] = rm.tolist()
        batch["token_level_scores"] = scores
        for key, values in extra.items():
            batch[key] = values
        batch.meta_info[REWARD_EXTRA_KEYS] = list(extra)

    def _score_round(self, batch: Batch, baseline: Optional[Batch]) -> None:
        """Score ``batch`` (and ReMax's greedy ``baseline``); ``RewardError`` names what failed."""
        self.score(batch)
        if baseline is not None:
            try:
                scores = self.reward_fn(baseline).scores  # [b] one greedy response per prompt
            except RewardError as err:
                err.args = (f"greedy baseline: {err}",)
                raise
            batch["reward_baselines"] = scores.repeat_interleave(self.n)

    # -- the phase --------------------------------------------------------------------------
    def run(self, step: int, metrics: dict, timing: dict) -> Optional[Batch]:
        """This step's scored batch (see the module docstring); None when the reward failed.
        With a dump, the step's samples are written (``trainer.rollout_data_dir``)."""
        batch = self._run(step, metrics, timing)
        if batch is not None:
            self.dump_samples(step, batch)
        return batch

    def dump_samples(self, step: int, batch: Batch) -> None:
        """Write the step's samples to the generation dump (``trainer.rollout_data_dir``), if there is one."""
        if self.dump is None:
            return
        prompts = batch["raw_prompt"] if "raw_prompt" in batch else [""] * len(batch)
        texts = self.reward_fn.decode(batch["responses"], batch["response_mask"].sum(-1))
        extra = {k: list(batch[k]) for k in batch.meta_info.get(REWARD_EXTRA_KEYS, ())}
        self.dump.write(
            step, list(prompts), texts, ground_truths(batch), batch["token_level_scores"].sum(-1).tolist(), extra
        )

    def _run(self, step: int, metrics: dict, timing: dict) -> Optional[Batch]:
        want = self.train_batch_size * self.n
        kept, num_kept, rounds = [], 0, 0
        while True:
            rounds += 1
            prompts = self.dataloader.next_batch()
            with self.stage("gen", timing, metrics):
                batch = self.generate(prompts, step=step, gen_round=rounds - 1)
            metrics.update(self.replica_metrics())
            if self.multi_turn:
                metrics.update(agent_metrics(batch))
            baseline = None
            if self.baseline:  # ReMax's greedy response per prompt: verl's timing_s/gen_max, not the reward's
                with timer("gen_max", timing):
                    baseline = self.generate(prompts, step=step, gen_round=rounds - 1, greedy=True)
            with timer("reward", timing):
                try:
                    self._score_round(batch, baseline)
                except RewardError as err:
                    self.last_error = str(err)
                    print(f"step {step}: skipped, {self.last_error}", flush=True)
                    metrics.update({"training/step_skipped": 1.0, "reward/num_failed_samples": float(len(err.indices))})
                    return None
            if self.filter_groups is None:
                metrics.update(reward_metrics(batch))
                return batch
            extra = {k: list(batch[k]) for k in batch.meta_info[REWARD_EXTRA_KEYS]}
            values = compute_filter_metric(
                self.filter_groups.metric or "seq_reward",
                batch["token_level_scores"],
                batch["token_level_scores"],
                extra,
            )
            _, idx, _ = filter_groups(values, np.asarray(batch["uid"]).tolist())
            kept.append(batch.select_idxs(idx))
            num_kept += int(idx.numel())
            if num_kept >= want:
                break
            limit = self.filter_groups.max_num_gen_batches
            if 0 < limit <= rounds:
                raise RuntimeError(
                    f"DAPO dynamic sampling: {rounds} generation rounds gave {num_kept // self.n} informative prompt "
                    f"groups, fewer than data.train_batch_size={want // self.n} (algorithm.filter_groups."
                    f"max_num_gen_batches={limit}); the data may be too hard or too easy for the model -- "
                    "raise max_num_gen_batches (0 = unbounded) or data.gen_batch_size"
                )
        batch = _concat_rounds(kept).select_idxs(range(want))
        metrics.update(reward_metrics(batch))
        metrics.update(
            {
                "filter_groups/num_gen_batches": float(rounds),
                "filter_groups/kept_sample_ratio": num_kept / (rounds * len(prompts["uid"]) * self.n),
            }
        )
        return batch


def _concat_rounds(batches: list[Batch]) -> Batch:
    """The rounds' batches stacked; a reward field some round lacks is None for its samples."""
    keys = list(dict.fromkeys(k for b in batches for k in b.meta_info[REWARD_EXTRA_KEYS]))
    for b in batches:
        for key in keys:
            if key not in b:
                b[key] = [None] * len(b)
        b.meta_info[REWARD_EXTRA_KEYS] = keys
    return Batch.concat(batches)
