"""The single-controller PPO/GRPO trainer: one driver process calls Ray worker groups.

``RayPPOTrainer.fit()`` is the loop of verl's ``RayPPOTrainer.fit`` (see ARCHITECTURE.md, "One
training step"): prompts -> rollout (n samples each) -> reward -> old log-probs (actor) ->
reference log-probs (only with a KL term) -> values (only with a critic) -> KL-in-reward ->
advantages (``ADV_ESTIMATORS[algorithm.adv_estimator]``, on the driver) -> critic update ->
actor update -> weight sync actor -> rollout -> metrics. Roles are created only when the config
needs them (verl's ``need_critic`` / ``need_reference_policy``).

``config`` is a ``TrainerRunConfig`` or a DictConfig with its (verl's) keys; everything is read
through attribute access / ``cfg_get``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from megatron_rl.algos import ADV_ESTIMATORS, apply_kl_penalty, get_kl_controller
from megatron_rl.algos.utils import cfg_get
from megatron_rl.trainer.metrics import (
    MetricsLogger,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    timer,
)

__all__ = ["RayPPOTrainer", "need_critic", "need_reference_policy", "repeat_interleave_lists"]

VALUE_ESTIMATORS = ("gae",)
# Per-prompt lists of the dataloader batch that follow their prompt's n samples.
_PROMPT_LISTS = ("data_source", "ground_truth", "extra_info", "index", "raw_prompt", "reward_model")


def need_critic(config: Any) -> bool:
    """A critic is trained: ``critic.enable`` if set, else the estimator reads values (GAE)."""
    enable = cfg_get(config, "critic.enable")
    if enable is not None:
        return bool(enable)
    return cfg_get(config, "algorithm.adv_estimator") in VALUE_ESTIMATORS


def need_reference_policy(config: Any) -> bool:
    """A reference policy runs: KL loss in the actor or KL penalty in the reward."""
    return bool(cfg_get(config, "actor_rollout_ref.actor.use_kl_loss", False)
                or cfg_get(config, "algorithm.use_kl_in_reward", False))


def repeat_interleave_lists(batch: dict[str, Any], n: int, keys=_PROMPT_LISTS) -> dict[str, list]:
    """Each per-prompt list in ``batch`` repeated ``n`` times per entry (prompt-major, like vLLM's output)."""
    return {k: [x for x in batch[k] for _ in range(n)] for k in keys if k in batch}


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
                 tokenizer: Any = None, train_dataloader: Any = None, reward_fn: Any = None):
        self.config = config
        self.log_dir = Path(log_dir or cfg_get(config, "trainer.default_local_dir") or "outputs")
        if model_path is None:
            from megatron_rl.trainer.main_job import prepare_policy_model

            model_path = prepare_policy_model(config, self.log_dir)
        self.model_path = str(model_path)
        self.use_critic = need_critic(config)
        self.use_reference = need_reference_policy(config)
        self.n = int(cfg_get(config, "actor_rollout_ref.rollout.n", 1))
        self.temperature = float(cfg_get(config, "actor_rollout_ref.rollout.temperature", 1.0))
        self.adv_fn = ADV_ESTIMATORS[cfg_get(config, "algorithm.adv_estimator")]
        self.kl_ctrl = get_kl_controller(cfg_get(config, "algorithm.kl_ctrl")) if cfg_get(
            config, "algorithm.use_kl_in_reward", False) else None
        self.tokenizer = tokenizer or self._build_tokenizer()
        self.train_dataloader = train_dataloader or self._build_dataloader()
        self.reward_fn = reward_fn or self._build_reward_fn()
        self.global_steps = 0
        self.actor = self.ref = self.critic = self.rollout = None

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

    def _build_reward_fn(self):
        from megatron_rl.data.rewards import RewardFunction

        kw = cfg_get(self.config, "reward.reward_kwargs")
        return RewardFunction(self.tokenizer, cfg_get(self.config, "reward.reward_fn"),
                              overlong_buffer_cfg=cfg_get(kw, "overlong_buffer_cfg"),
                              max_resp_len=cfg_get(kw, "max_resp_len"))

    def init_workers(self) -> None:
        """Create the roles the config needs, each in its own placement group."""
        import ray

        from megatron_rl.workers.ray_workers import MegatronWorkerGroup, create_rollout_worker

        cfg, world = self.config, int(cfg_get(self.config, "trainer.nnodes", 1)) * int(
            cfg_get(self.config, "trainer.n_gpus_per_node", 1))
        roles = 1 + int(self.use_reference) + int(self.use_critic)
        on_gpu = cfg_get(cfg, "trainer.device", "cpu") == "cuda"
        if on_gpu:  # roles (and the rollout) share each GPU, as verl's colocated workers do
            cpus, gpus = 1.0, 1.0 / (roles + 1)
        else:  # fractional CPUs so that every rank of every role can start on a small machine
            cpus, gpus = max(0.01, int(100 * ray.available_resources().get("CPU", 1) / (roles * world + 1)) / 100), 0.0
        common = dict(hf_dir=self.model_path, num_cpus_per_worker=cpus, num_gpus_per_worker=gpus)
        arr = cfg_get(cfg, "actor_rollout_ref")
        actor_meg = cfg_get(arr, "actor.megatron")
        seed = int(cfg_get(actor_meg, "seed", 42))
        self.actor = MegatronWorkerGroup("actor", actor_meg, cfg_get(arr, "actor"), world, seed=seed, **common)
        if self.use_reference:
            self.ref = MegatronWorkerGroup("ref", cfg_get(arr, "ref.megatron"), cfg_get(arr, "actor"), world,
                                           seed=seed, **common)
        if self.use_critic:
            self.critic = MegatronWorkerGroup("critic", cfg_get(cfg, "critic.megatron"), cfg_get(cfg, "critic"),
                                              world, hf_dir=cfg_get(cfg, "critic.model.path") or self.model_path,
                                              num_cpus_per_worker=cpus, num_gpus_per_worker=gpus, seed=seed)
        self.rollout, self._rollout_pg = create_rollout_worker(self.model_path, cfg_get(arr, "rollout"),
                                                               num_cpus=cpus, num_gpus=gpus)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self, total_steps: Optional[int] = None, on_step: Optional[Callable[[dict], None]] = None
            ) -> list[dict[str, float]]:
        """Train for ``total_steps`` (default ``trainer.total_training_steps``); returns the metrics.
        ``on_step(metrics)`` runs after each step is logged (progress bars)."""
        total = int(total_steps or cfg_get(self.config, "trainer.total_training_steps") or len(self.train_dataloader))
        logger = MetricsLogger(self.log_dir, cfg_get(self.config, "trainer.logger", ["console"]), total_steps=total,
                               project=cfg_get(self.config, "trainer.project_name", "megatron_rl"),
                               experiment=cfg_get(self.config, "trainer.experiment_name"))
        history = []
        for _ in range(total):
            self.global_steps += 1
            metrics, timing = {}, {}
            with timer("step", timing):
                prompts = self.train_dataloader.next_batch()
                with timer("gen", timing):
                    batch = self.generate(prompts)
                with timer("reward", timing):
                    metrics.update(self.compute_reward(batch))
                with timer("old_log_prob", timing):
                    metrics.update(self.compute_old_log_prob(batch))
                if self.use_reference:
                    with timer("ref", timing):
                        batch["ref_log_prob"] = self.ref.compute_log_prob(batch, temperature=self.temperature)["log_probs"]
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
                        metrics.update(self.actor.update_policy(batch, temperature=self.temperature))
                    with timer("update_weights", timing):
                        metrics.update(self.sync_weights())
            metrics.update(self.step_metrics(batch, timing))
            logger.log(metrics, step=self.global_steps)
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
        logger.close()
        return history

    # -- the phases -------------------------------------------------------------------------
    def generate(self, prompts: dict[str, Any]) -> dict[str, Any]:
        """Rollout ``n`` samples per prompt; per-prompt lists follow their samples."""
        import ray

        batch = ray.get(self.rollout.generate.remote(
            {"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"]},
            uids=list(prompts["uid"]), n=self.n))
        batch.update(repeat_interleave_lists(prompts, self.n))
        return batch

    def compute_reward(self, batch: dict[str, Any]) -> dict[str, float]:
        out = self.reward_fn(batch)
        batch["token_level_scores"] = out.token_level_scores
        return out.metrics()

    def compute_old_log_prob(self, batch: dict[str, Any]) -> dict[str, float]:
        """Actor log-probs of the sampled tokens (the PPO ratio's denominator) and their entropy."""
        from megatron_rl.algos import agg_loss

        out = self.actor.compute_log_prob(batch, temperature=self.temperature, calculate_entropy=True)
        batch["old_log_probs"] = out["log_probs"]
        mode = cfg_get(self.config, "actor_rollout_ref.actor.loss_agg_mode", "token-mean")
        return {"actor/entropy": float(agg_loss(out["entropys"], batch["response_mask"], mode))}

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
            norm_adv_by_std_in_grpo=bool(cfg_get(algo, "norm_adv_by_std_in_grpo", True)), config=algo)
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """Actor (all ranks gather to rank 0, HF names) -> rollout engine, in place."""
        import ray

        arr = cfg_get(self.config, "actor_rollout_ref")
        mb = float(cfg_get(arr, "rollout.checkpoint_engine.update_weights_bucket_megabytes", 256) or 256)
        weights = self.actor.export_weights(bucket_bytes=int(mb * 2**20))
        stats = ray.get(self.rollout.update_weights.remote(weights))
        return {"weight_sync/bytes": float(stats["bytes"]), "weight_sync/seconds": float(stats["seconds"])}

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
        weights = ray.get(self.actor.export_weights())
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

    def step_metrics(self, batch: dict[str, Any], timing: dict[str, float]) -> dict[str, float]:
        n_devices = int(cfg_get(self.config, "trainer.nnodes", 1)) * int(cfg_get(self.config, "trainer.n_gpus_per_node", 1))
        return {"training/global_step": self.global_steps, "training/epoch": self.train_dataloader.epoch,
                **compute_data_metrics(batch, self.use_critic), **compute_timing_metrics(batch, timing),
                **compute_throughput_metrics(batch, timing, n_devices)}

    def shutdown(self) -> None:
        """Stop every worker and free the placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in (self.actor, self.ref, self.critic):
            if group is not None:
                group.shutdown()
        if self.rollout is not None:
            ray.kill(self.rollout)
            remove_placement_group(self._rollout_pg)
