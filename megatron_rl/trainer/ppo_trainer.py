"""The single-controller PPO/GRPO trainer: one driver process calls Ray worker groups.

``RayPPOTrainer.fit()`` is the loop of verl's ``RayPPOTrainer.fit`` (see ARCHITECTURE.md, "One
training step"): prompts -> rollout (n samples each) -> reward -> old log-probs (actor) ->
reference log-probs (only with a KL term) -> values (only with a critic) -> KL-in-reward ->
advantages (``ADV_ESTIMATORS[algorithm.adv_estimator]``, on the driver) -> critic update ->
actor update -> weight sync actor -> rollout -> metrics. Roles are created only when the config
needs them (verl's ``need_critic`` / ``need_reference_policy``; a reward model with
``reward.reward_model.enable``, a teacher with ``distillation.enabled``).

Around the step: DAPO dynamic sampling (generation rounds until ``train_batch_size`` prompts have
informative groups, bounded by ``filter_groups.max_num_gen_batches``), ReMax's greedy baseline,
rollout correction (decoupled IS weights / rejection, or bypass mode), validation every
``trainer.test_freq`` steps, checkpoints every ``trainer.save_freq`` steps and resume
(``megatron_rl.trainer.checkpoint``). A reward that fails skips the step (reported); a worker
that dies stops the run naming the last good checkpoint. Rollouts are seeded per (step, round),
so a resumed run draws exactly what the uninterrupted one would have.

``config`` is a ``TrainerRunConfig`` or a DictConfig with its (verl's) keys; everything is read
through attribute access / ``cfg_get``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from megatron_rl.algos import ADV_ESTIMATORS, apply_kl_penalty, get_kl_controller
from megatron_rl.algos.utils import cfg_get
from megatron_rl.trainer.batch import concat_batches, repeat_interleave_lists, select_batch, worker_failure
from megatron_rl.trainer.metrics import (
    MetricsLogger,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    timer,
)

__all__ = ["RayPPOTrainer"]

_SEED_STRIDE = 1_000_003  # > samples per generation round: per-sample seeds never repeat across rounds


class RayPPOTrainer:
    """Drives the actor / reference / critic worker groups and the rollout worker (Ray must be up).

    Args:
        config: ``TrainerRunConfig`` or DictConfig with its keys: an HF model in
            ``actor_rollout_ref.model.path``, or an inline ``model.config`` + ``family`` that is
            first materialised as an HF checkpoint under ``log_dir`` (and warmed up by
            ``trainer.sft_warmup_steps`` supervised steps; see ``main_job.prepare_policy_model``).
        model_path: HF directory to start from, instead of preparing it from the config.
        log_dir: where ``metrics.jsonl`` goes (default ``trainer.default_local_dir``).
        tokenizer / train_dataloader / reward_fn: override what the config would build.
    """

    def __init__(self, config: Any, *, model_path: Optional[str | Path] = None, log_dir: Optional[str | Path] = None,
                 tokenizer: Any = None, train_dataloader: Any = None, reward_fn: Any = None,
                 teacher_path: Optional[str | Path] = None):
        from megatron_rl.config import TrainerRunConfig

        config = config if isinstance(config, TrainerRunConfig) else TrainerRunConfig.from_dict(config)
        self.config = config
        self.log_dir = Path(log_dir or cfg_get(config, "trainer.default_local_dir") or "outputs")
        if model_path is None:
            from megatron_rl.job.main_job import prepare_policy_model

            model_path = prepare_policy_model(config, self.log_dir)
        self.model_path = str(model_path)
        self.teacher_path = None
        if cfg_get(config, "distillation.enabled", False):
            from megatron_rl.job.main_job import prepare_teacher_model

            self.teacher_path = teacher_path or prepare_teacher_model(config, self.log_dir, self.model_path)
        from megatron_rl.algos.needs import resolve_run

        self.needs = resolve_run(config)
        self.use_critic, self.use_reference = self.needs.critic, self.needs.reference
        self.n = int(cfg_get(config, "actor_rollout_ref.rollout.n", 1))
        self.temperature = float(cfg_get(config, "actor_rollout_ref.rollout.temperature", 1.0))
        self.adv_fn = ADV_ESTIMATORS[cfg_get(config, "algorithm.adv_estimator")]
        self.kl_ctrl = get_kl_controller(cfg_get(config, "algorithm.kl_ctrl")) if cfg_get(
            config, "algorithm.use_kl_in_reward", False) else None
        self.tokenizer = tokenizer or self._build_tokenizer()
        self.train_dataloader = train_dataloader or self._build_dataloader()
        self.reward_fn = reward_fn or self._build_reward_fn()
        self.val_dataloader = self._build_val_dataloader()
        self.rollout_seed = int(cfg_get(config, "actor_rollout_ref.rollout.seed", 42) or 0)
        rc = cfg_get(config, "algorithm.rollout_correction")
        self.rollout_correction = rc if rc is not None and (
            cfg_get(rc, "bypass_mode", False) or cfg_get(rc, "rollout_is") or cfg_get(rc, "rollout_rs")) else None
        distill = cfg_get(config, "distillation")
        self.distillation_loss = cfg_get(distill, "distillation_loss") if cfg_get(distill, "enabled", False) else None
        self.remax = self.needs.baseline
        self._weight_sync_connected = False
        self.global_steps = 0
        self.last_reward_error = ""
        self.actor = self.ref = self.critic = self.rollout = self.rm = self.teacher = None

    # -- construction -----------------------------------------------------------------------
    def _build_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg_get(self.config, "actor_rollout_ref.model.tokenizer_path")
                                             or self.model_path)

    def _build_dataloader(self):
        from megatron_rl.data.datasets import build_prompt_dataloader, make_toy_dataset

        data = cfg_get(self.config, "data")
        files = cfg_get(data, "train_files")
        if files is None:
            task, kwargs = cfg_get(data, "task"), dict(cfg_get(data, "task_kwargs") or {})
            num = int(kwargs.pop("num_samples", 1024))
            files = str(make_toy_dataset(task, num, seed=int(cfg_get(data, "seed") or 0),
                                         path=self.log_dir / "train.parquet", **kwargs))
        return build_prompt_dataloader(files, self.tokenizer, data,
                                       max_samples=int(cfg_get(data, "train_max_samples", -1)))

    def _build_val_dataloader(self):
        """``data.val_files``, or for a built-in task a held-out set drawn with another seed; None
        when neither exists."""
        from megatron_rl.data.datasets import PromptDataLoader, PromptDataset, make_toy_dataset

        data = cfg_get(self.config, "data")
        files = cfg_get(data, "val_files")
        limit = int(cfg_get(data, "val_max_samples", -1) or -1)
        if files is None:
            task = cfg_get(data, "task")
            if task is None:
                return None
            kwargs = dict(cfg_get(data, "task_kwargs") or {})
            kwargs.pop("num_samples", None)
            files = str(make_toy_dataset(task, limit if limit > 0 else 64, seed=int(cfg_get(data, "seed") or 0) + 7919,
                                         path=self.log_dir / "val.parquet", **kwargs))
        dataset = PromptDataset(files, self.tokenizer, data, max_samples=limit)
        size = min(int(cfg_get(data, "val_batch_size") or len(dataset)), len(dataset))
        return PromptDataLoader(dataset, size, shuffle=False, drop_last=False)

    def _build_reward_fn(self):
        from megatron_rl.data.rewards import RewardFunction, load_custom_reward_fn

        kw = cfg_get(self.config, "reward.reward_kwargs")
        score = cfg_get(self.config, "reward.reward_fn")
        custom = cfg_get(self.config, "reward.custom_reward_function")
        if cfg_get(custom, "path"):
            score = load_custom_reward_fn(cfg_get(custom, "path"), cfg_get(custom, "name") or "compute_score")
        return RewardFunction(self.tokenizer, score,
                              overlong_buffer_cfg=cfg_get(kw, "overlong_buffer_cfg"),
                              max_resp_len=cfg_get(kw, "max_resp_len"))

    def init_workers(self) -> None:
        """Create the roles the config needs, each in its own placement group."""
        from megatron_rl.trainer.placement import Placement, role_specs

        specs = role_specs(self.config, self.needs, model_path=self.model_path, teacher_path=self.teacher_path)
        self.placement = Placement(self.config, specs, model_path=self.model_path)
        get = self.placement.get
        self.actor, self.ref, self.critic, self.rm, self.teacher = (get(r) for r in ("actor", "ref", "critic", "reward",
                                                                                      "teacher"))
        self.rollout = self.placement.rollout

    # -- the loop ---------------------------------------------------------------------------
    def fit(self, total_steps: Optional[int] = None, on_step: Optional[Callable[[dict], None]] = None
            ) -> list[dict[str, float]]:
        """Train until step ``total_steps`` (default ``trainer.total_training_steps``), resuming
        from the latest checkpoint when ``trainer.resume_mode`` allows; returns this call's metrics.
        ``on_step(metrics)`` runs after each step is logged (progress bars)."""
        total = int(total_steps or cfg_get(self.config, "trainer.total_training_steps") or len(self.train_dataloader))
        tcfg = cfg_get(self.config, "trainer")
        save_freq, test_freq = int(cfg_get(tcfg, "save_freq", -1)), int(cfg_get(tcfg, "test_freq", -1))
        skip_limit = int(cfg_get(tcfg, "max_consecutive_skipped_steps", 3))
        self.resume()
        logger = MetricsLogger(self.log_dir, cfg_get(tcfg, "logger", ["console"]), total_steps=total,
                               project=cfg_get(tcfg, "project_name", "megatron_rl"),
                               experiment=cfg_get(tcfg, "experiment_name"))
        if self.val_dataloader is not None and cfg_get(tcfg, "val_before_train", True):
            logger.log(self.validate(), step=self.global_steps)
        history, skipped = [], 0
        while self.global_steps < total:
            self.global_steps += 1
            metrics, timing = {}, {}
            with timer("step", timing), worker_failure(self.global_steps, self.log_dir):
                batch = self.rollout_and_score(metrics, timing)  # None: the rewards failed
                if batch is not None:
                    self.train_step(batch, metrics, timing)
            skipped = skipped + 1 if batch is None else 0
            metrics.update(self.step_metrics(batch, timing))
            last = self.global_steps >= total
            if test_freq > 0 and self.val_dataloader is not None and (self.global_steps % test_freq == 0 or last):
                metrics.update(self.validate())
            if save_freq > 0 and (self.global_steps % save_freq == 0 or last):
                with timer("save_checkpoint", timing):
                    self.save_checkpoint()
                metrics["timing_s/save_checkpoint"] = timing["save_checkpoint"]
            logger.log(metrics, step=self.global_steps)
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            if skipped and skipped >= skip_limit:
                logger.close()
                raise RuntimeError(f"{skipped} steps in a row were skipped because the reward failed "
                                   f"(trainer.max_consecutive_skipped_steps={skip_limit}); last error: "
                                   f"{self.last_reward_error}")
        logger.close()
        return history

    # -- the phases -------------------------------------------------------------------------
    def generate(self, prompts: dict[str, Any], *, gen_round: int = 0, validate: bool = False,
                 greedy: bool = False) -> dict[str, Any]:
        """Rollout ``n`` samples per prompt (``val_kwargs`` when validating); per-prompt lists
        follow their samples. Training draws are seeded by (rollout seed, step, round), so a
        resumed run samples what the uninterrupted run would have."""
        import ray

        if validate:
            kwargs: dict[str, Any] = {"validate": True}
        elif greedy:  # ReMax's baseline: one greedy response per prompt
            kwargs = {"n": 1, "do_sample": False}
        else:
            kwargs = {"n": self.n, "seed": self.rollout_seed + _SEED_STRIDE * (self.global_steps * 64 + gen_round)}
        batch = ray.get(self.rollout.generate.remote(
            {"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"]},
            uids=list(prompts["uid"]), **kwargs))
        batch.update(repeat_interleave_lists(prompts, len(batch["uid"]) // len(prompts["uid"])))
        return batch

    def rollout_and_score(self, metrics: dict, timing: dict) -> Optional[dict[str, Any]]:
        """Generate and score this step's batch -- with DAPO dynamic sampling, round after round
        until ``train_batch_size`` prompts have informative groups. None when the reward failed
        (the step is reported and skipped: its metrics say why)."""
        from megatron_rl.algos.dapo import compute_filter_metric, filter_groups
        from megatron_rl.data.rewards import RewardError

        fg = cfg_get(self.config, "algorithm.filter_groups")
        dynamic = bool(fg is not None and cfg_get(fg, "enable", False))
        want = int(cfg_get(self.config, "data.train_batch_size")) * self.n
        kept, num_kept, rounds = [], 0, 0
        while True:
            rounds += 1
            prompts = self.train_dataloader.next_batch()
            with timer("gen", timing):
                batch = self.generate(prompts, gen_round=rounds - 1)
            with timer("reward", timing):
                scored = ""  # what failed, for the message: the samples, or ReMax's greedy baseline
                try:
                    reward_metrics, extra = self.score(batch)
                    if self.remax:
                        scored = "greedy baseline: "
                        baseline = self.generate(prompts, gen_round=rounds - 1, greedy=True)
                        # [b] one greedy response per prompt
                        batch["reward_baselines"] = self.reward_fn(baseline).scores.repeat_interleave(self.n)
                except RewardError as err:
                    self.last_reward_error = f"{scored}{err}"
                    print(f"step {self.global_steps}: skipped, {self.last_reward_error}", flush=True)
                    metrics.update({"training/step_skipped": 1.0, "reward/num_failed_samples": float(len(err.indices))})
                    return None
            if not dynamic:
                metrics.update(reward_metrics)
                return batch
            values = compute_filter_metric(cfg_get(fg, "metric") or "seq_reward", batch["token_level_scores"],
                                           batch["token_level_scores"], extra)
            _, idx, _ = filter_groups(values, batch["uid"])
            kept.append(select_batch(batch, idx.tolist()))
            num_kept += int(idx.numel())
            if num_kept >= want:
                break
            limit = int(cfg_get(fg, "max_num_gen_batches", 0))
            if 0 < limit <= rounds:
                raise RuntimeError(
                    f"DAPO dynamic sampling: {rounds} generation rounds gave {num_kept // self.n} informative prompt "
                    f"groups, fewer than data.train_batch_size={want // self.n} (algorithm.filter_groups."
                    f"max_num_gen_batches={limit}); the data may be too hard or too easy for the model -- "
                    "raise max_num_gen_batches (0 = unbounded) or data.gen_batch_size")
        batch = select_batch(concat_batches(kept), list(range(want)))
        reward_metrics, _ = self._reward_metrics(batch)
        metrics.update(reward_metrics)
        metrics.update({"filter_groups/num_gen_batches": float(rounds),
                        "filter_groups/kept_sample_ratio": num_kept / (rounds * len(prompts["uid"]) * self.n)})
        return batch

    def score(self, batch: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
        """``token_level_scores`` = rule reward (raises ``RewardError`` on a failure or a
        non-finite score) + reward-model score, on each response's last token."""
        import torch

        out = self.reward_fn(batch)
        batch["token_level_scores"] = out.token_level_scores
        batch["_reward_extra"] = out.reward_extra_info
        if self.rm is not None:
            rm = self.rm.compute_rm_score(batch)["rm_scores"].float()  # [b]
            if not torch.isfinite(rm).all():
                from megatron_rl.data.rewards import RewardError

                bad = torch.nonzero(~torch.isfinite(rm)).flatten().tolist()
                raise RewardError([(i, batch["data_source"][i] if "data_source" in batch else None,
                                    f"reward model score {float(rm[i])}") for i in bad], len(rm))
            last = (batch["response_mask"].sum(-1).long() - 1).clamp(min=0)
            batch["token_level_scores"] = batch["token_level_scores"].scatter_add(1, last[:, None], rm[:, None])
            batch["_reward_extra"] = {**out.reward_extra_info, "rm_score": rm.tolist()}
        return self._reward_metrics(batch)

    @staticmethod
    def _reward_metrics(batch: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
        extra = batch.get("_reward_extra", {})
        metrics = {}
        for key, values in extra.items():
            nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if nums:
                metrics[f"reward/{key}/mean"] = sum(nums) / len(nums)
        return metrics, extra

    def train_step(self, batch: dict[str, Any], metrics: dict, timing: dict) -> None:
        """Everything after scoring: log-probs, advantages, updates, weight sync."""
        with timer("old_log_prob", timing):
            metrics.update(self.compute_old_log_prob(batch))
        if self.use_reference:
            with timer("ref", timing):
                batch["ref_log_prob"] = self.ref.compute_log_prob(batch, temperature=self.temperature)["log_probs"]
        if self.teacher is not None:
            with timer("teacher", timing):
                if cfg_get(self.distillation_loss, "loss_mode") == "forward_kl_topk":
                    out = self.teacher.compute_topk_log_probs(batch, k=int(cfg_get(self.distillation_loss, "topk", 128)),
                                                              temperature=self.temperature)
                    batch["teacher_topk_log_probs"], batch["teacher_topk_ids"] = out["topk_log_probs"], out["topk_ids"]
                else:
                    batch["teacher_log_probs"] = self.teacher.compute_log_prob(
                        batch, temperature=self.temperature)["log_probs"]
        if self.use_critic:
            with timer("values", timing):
                batch["values"] = self.critic.compute_values(batch)["values"]
        with timer("adv", timing):
            metrics.update(self.compute_advantage(batch))
        if self.use_critic:
            with timer("update_critic", timing):
                metrics.update(self.critic.update_critic(batch))
        if self.global_steps > int(cfg_get(self.config, "trainer.critic_warmup", 0)):
            with timer("update_actor", timing):
                metrics.update(self.actor.update_policy(batch, temperature=self.temperature,
                                                        **({"distillation_loss": self.distillation_loss}
                                                           if self.distillation_loss is not None else {})))
            with timer("update_weights", timing):
                metrics.update(self.sync_weights())

    def compute_old_log_prob(self, batch: dict[str, Any]) -> dict[str, float]:
        """Actor log-probs of the sampled tokens (the PPO ratio's denominator) and their entropy;
        then rollout correction: bypass mode takes vLLM's log-probs as the old ones (the loss
        corrects against them), decoupled mode adds IS weights / rejection to the batch."""
        from megatron_rl.algos import agg_loss
        from megatron_rl.algos.rollout_correction import (
            compute_rollout_corr_metrics_from_logprobs,
            compute_rollout_correction_and_add_to_batch,
        )

        out = self.actor.compute_log_prob(batch, temperature=self.temperature, calculate_entropy=True)
        mode = cfg_get(self.config, "actor_rollout_ref.actor.loss_agg_mode", "token-mean")
        metrics = {"actor/entropy": float(agg_loss(out["entropys"], batch["response_mask"], mode))}
        rc = self.rollout_correction
        if rc is not None and "rollout_log_probs" not in batch:
            raise ValueError("algorithm.rollout_correction needs the rollout's log-probs; set "
                             "actor_rollout_ref.rollout.calculate_log_probs=True")
        if rc is not None and cfg_get(rc, "bypass_mode", False):
            batch["old_log_probs"] = batch["rollout_log_probs"]
            metrics.update(compute_rollout_corr_metrics_from_logprobs(out["log_probs"], batch["rollout_log_probs"],
                                                                      batch["response_mask"]))
            return metrics
        batch["old_log_probs"] = out["log_probs"]
        if rc is not None:
            _, corr = compute_rollout_correction_and_add_to_batch(batch, rc)
            metrics.update(corr)
        return metrics

    def compute_advantage(self, batch: dict[str, Any]) -> dict[str, float]:
        """KL-in-reward (optional), then the configured estimator, on the driver."""
        metrics = {}
        if self.kl_ctrl is not None:
            batch["token_level_rewards"], metrics = apply_kl_penalty(
                batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"],
                self.kl_ctrl, cfg_get(self.config, "algorithm.kl_penalty", "kl"))
        else:
            batch["token_level_rewards"] = batch["token_level_scores"]
        algo = cfg_get(self.config, "algorithm")
        batch["advantages"], batch["returns"] = self.adv_fn(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
            index=np.array(batch["uid"], dtype=object), values=batch.get("values"),
            gamma=float(cfg_get(algo, "gamma", 1.0)), lam=float(cfg_get(algo, "lam", 1.0)),
            norm_adv_by_std_in_grpo=bool(cfg_get(algo, "norm_adv_by_std_in_grpo", True)), config=algo,
            **({"reward_baselines": batch["reward_baselines"]} if "reward_baselines" in batch else {}))
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """Actor -> rollout engine, in place. ``checkpoint_engine.backend`` ``broadcast`` / ``shm``:
        streamed bucket by bucket from actor rank 0 over a gloo side band (the model is never
        whole anywhere; ``megatron_rl.rollout.weight_sync``). ``colocated`` / ``bytes``: rank 0
        gathers the HF tensors and hands them over through Ray's object store (small models)."""
        import ray

        ce = cfg_get(self.config, "actor_rollout_ref.rollout.checkpoint_engine")
        backend = cfg_get(ce, "backend", "colocated")
        mb = float(cfg_get(ce, "update_weights_bucket_megabytes", 256) or 256)
        from megatron_rl.workers.weight_sync import connect_weight_sync, export_weights, sync_weights

        if backend in ("broadcast", "shm"):
            if not self._weight_sync_connected:
                connect_weight_sync(self.actor, self.rollout, transport=backend, bucket_megabytes=mb)
                self._weight_sync_connected = True
            stats = sync_weights(self.actor, self.rollout)
        else:
            stats = ray.get(self.rollout.update_weights.remote(export_weights(self.actor, bucket_bytes=int(mb * 2**20))))
        return {"weight_sync/bytes": float(stats["bytes"]), "weight_sync/seconds": float(stats["seconds"])}

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Generate for the whole validation set with ``rollout.val_kwargs`` (greedy by default)
        and score it: ``val-core/<data_source>/reward/mean@<n>`` and ``val-aux/...`` for the
        reward's other keys (verl's names). Prints ``trainer.log_val_generations`` samples."""
        from collections import defaultdict

        from megatron_rl.data.rewards import RewardError

        per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        samples, n = [], 1
        start = self.val_dataloader.state_dict()
        self.val_dataloader.load_state_dict({**start, "epoch": 0, "batch_in_epoch": 0})
        for prompts in self.val_dataloader:
            batch = self.generate(prompts, validate=True)
            n = len(batch["uid"]) // len(prompts["uid"])
            try:
                out = self.reward_fn(batch)
            except RewardError as err:
                return {"val-aux/num_failed_samples": float(len(err.indices))}
            sources = batch.get("data_source") or ["unknown"] * len(out.scores)
            for i, src in enumerate(sources):
                per_source[src]["reward"].append(float(out.scores[i]))
                for key, values in out.reward_extra_info.items():
                    if key != "score" and isinstance(values[i], (int, float)) and not isinstance(values[i], bool):
                        per_source[src][key].append(float(values[i]))
            samples.extend(zip(batch.get("raw_prompt") or [""] * len(out.scores), out.response_texts,
                               out.scores.tolist()))
        shown = int(cfg_get(self.config, "trainer.log_val_generations", 0) or 0)
        for prompt, text, score in samples[:shown]:
            print(f"[val] {prompt!r} -> {text!r} (score {score:.3f})", flush=True)
        metrics = {}
        for src, keys in per_source.items():
            for key, values in keys.items():
                tier = "val-core" if key == "reward" else "val-aux"
                metrics[f"{tier}/{src}/{key}/mean@{n}"] = sum(values) / len(values)
        return metrics

    # -- checkpoint / resume -----------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """Driver-side state a resume needs (the workers save their own)."""
        return {"global_steps": self.global_steps, "dataloader": self.train_dataloader.state_dict(),
                "kl_coef": None if self.kl_ctrl is None else float(self.kl_ctrl.value),
                "model_path": self.model_path}

    def save_checkpoint(self) -> Path:
        """Actor / critic (model + optimizer + schedule + RNG) and the driver state, as one atomic
        ``global_step_N`` directory; old ones pruned by ``trainer.max_actor_ckpt_to_keep``."""
        from megatron_rl.trainer.checkpoint import StepCheckpoint, prune_checkpoints

        with StepCheckpoint(self.log_dir, self.global_steps) as ckpt:
            self.actor.save_checkpoint(ckpt.part("actor"))
            if self.critic is not None:
                self.critic.save_checkpoint(ckpt.part("critic"))
            final = ckpt.commit(self.trainer_state())
        keep = [k for k in (cfg_get(self.config, "trainer.max_actor_ckpt_to_keep"),
                            cfg_get(self.config, "trainer.max_critic_ckpt_to_keep")) if k is not None]
        prune_checkpoints(self.log_dir, min(keep) if keep else None)
        return final

    def resume(self) -> Optional[Path]:
        """Load the checkpoint ``trainer.resume_mode`` selects (None: fresh start): worker states,
        step, data position, KL coefficient; push the restored actor into the rollout engine and
        drop metrics.jsonl lines of steps after the checkpoint (they will be re-run)."""
        import json

        from megatron_rl.trainer.checkpoint import TRAINER_STATE, find_resume_dir

        path = find_resume_dir(self.log_dir, cfg_get(self.config, "trainer.resume_mode", "auto"),
                               cfg_get(self.config, "trainer.resume_from_path"))
        if path is None or self.global_steps > 0:
            return None
        state = json.loads((path / TRAINER_STATE).read_text())
        self.actor.load_checkpoint(path / "actor")
        if self.critic is not None:
            if not (path / "critic").is_dir():
                raise ValueError(f"{path} has no critic checkpoint, but this run trains a critic")
            self.critic.load_checkpoint(path / "critic")
        self.train_dataloader.load_state_dict(state["dataloader"])
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = float(state["kl_coef"])
        self.global_steps = int(state["global_steps"])
        self.sync_weights()
        log = self.log_dir / "metrics.jsonl"
        if log.is_file():
            rows = [line for line in log.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= self.global_steps]
            log.write_text("".join(row + "\n" for row in rows))
        print(f"resumed from {path} at step {self.global_steps}", flush=True)
        return path

    def save_hf_checkpoint(self, out_dir: str | Path) -> Path:
        """Write the actor as an HF checkpoint (the bridge's export, gathered to rank 0) with the
        starting checkpoint's config, generation config and tokenizer files; atomic (a temporary
        sibling directory renamed into place). Returns ``out_dir``."""
        import shutil
        import uuid

        import ray
        from safetensors.torch import save_file

        final = Path(out_dir).resolve()
        if final.exists():
            raise FileExistsError(f"save_hf_checkpoint: {final} exists")
        from megatron_rl.workers.weight_sync import export_weights

        mb = self.config.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
        weights = ray.get(export_weights(self.actor, bucket_bytes=int(mb * 2**20)))
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            save_file({name: t.contiguous() for name, t in weights}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            for f in Path(self.model_path).iterdir():
                if f.is_file() and (f.suffix in (".json", ".jinja", ".txt", ".model") and
                                    not f.name.endswith(".safetensors.index.json") and f.name != "sft_warmup.json"):
                    shutil.copy(f, tmp / f.name)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def step_metrics(self, batch: Optional[dict[str, Any]], timing: dict[str, float]) -> dict[str, float]:
        n_devices = int(cfg_get(self.config, "trainer.nnodes", 1)) * int(cfg_get(self.config, "trainer.n_gpus_per_node", 1))
        if batch is None:  # a skipped step: only its timing
            return {"training/global_step": self.global_steps, "training/epoch": self.train_dataloader.epoch,
                    **{f"timing_s/{k}": v for k, v in timing.items()}}
        return {"training/global_step": self.global_steps, "training/epoch": self.train_dataloader.epoch,
                **compute_data_metrics(batch, self.use_critic), **compute_timing_metrics(batch, timing),
                **compute_throughput_metrics(batch, timing, n_devices)}

    def shutdown(self) -> None:
        """Stop every worker and free the placement groups."""
        if getattr(self, "placement", None) is not None:
            self.placement.shutdown()
            self.placement = None
