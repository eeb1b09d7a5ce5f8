"""The single-controller PPO/GRPO trainer: one driver process calls Ray worker groups.

``RayPPOTrainer.fit()`` is the loop of verl's ``RayPPOTrainer.fit`` (docs/architecture.md, "One
training step"), on one screen: the rollout phase (``RolloutPhase``: generation, rewards, DAPO
rounds, ReMax's baseline) -> DP balance -> old log-probs (actor; rollout correction) -> reference
log-probs -> teacher log-probs -> values -> KL-in-reward and advantages (the estimator's registry entry,
on the driver) -> critic update -> actor update -> weight sync. Which roles exist is decided
once by ``megatron_rl.algos.needs.resolve_run`` (the estimator's declared needs and the config's
switches); the side concerns -- validation, checkpoints, the metrics log, skipped steps -- are
callbacks that own their own frequencies (``megatron_rl.trainer.callbacks``): the loop only calls hooks
(``on_fit_start``, ``on_validation_end``, ``on_checkpoint``, ``on_step_end``, ``on_fit_end``), which run
the trainer's callbacks and the user's own (``trainer.callbacks``) by their order.

The trainer takes a typed ``RunConfig`` and an HF model directory to start from (the
main job, ``megatron_rl.job``, prepares inline toy models and SFT warm-ups).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from megatron_rl.algos import ADV_ESTIMATORS, agg_loss, apply_kl_penalty, get_kl_controller
from megatron_rl.algos.multi_trajectory import compute_advantage_for_multi_trajectories
from megatron_rl.algos.needs import resolve_run, with_plugins
from megatron_rl.algos.rollout_correction import (
    compute_rollout_corr_metrics_from_logprobs,
    compute_rollout_correction_and_rejection_mask,
    rollout_correction_kwargs,
)
from megatron_rl.config import RunConfig
from megatron_rl.config.distillation import TOPK_LOSS_MODES
from megatron_rl.data.batch import Batch
from megatron_rl.engine.router_replay import ROUTED_EXPERTS, check_run_router_replay, save_routing
from megatron_rl.rollout.agent.session_batch import agent_batch_keys
from megatron_rl.rollout.agent.final_answer import FinalAnswerReward
from megatron_rl.rollout.agent.runner import check_agent_config
from megatron_rl.trainer.async_loop import AsyncBatches, async_run_config, check_async_trainer
from megatron_rl.trainer.batch_source import BatchSource, SyncBatches
from megatron_rl.trainer.builders import build_reward_fn, build_tokenizer, build_train_dataloader, build_val_dataloader
from megatron_rl.trainer.callbacks import (
    Checkpointer,
    GenerationDump,
    MetricsLog,
    SkipGuard,
    StepFunction,
    Validator,
    load_callbacks,
)
from megatron_rl.trainer.failures import worker_failure
from megatron_rl.trainer.metrics import (
    METRICS_ROW,
    MetricsLogger,
    drop_rows_after,
    restore_row,
    step_metrics,
)
from megatron_rl.trainer.placement import reference_in_actor
from megatron_rl.trainer.schedule import RolloutSleepUnsupported, step_schedule
from megatron_rl.trainer.watchdog import guard_fit, phase as timer  # timed phases the hang watchdog sees

__all__ = ["RayPPOTrainer", "active_rollout_correction"]


def active_rollout_correction(rc):
    """``algorithm.rollout_correction`` when it does anything (bypass mode, IS weights or rejection), else None."""
    return rc if rc is not None and (rc.bypass_mode or rc.rollout_is or rc.rollout_rs) else None


class RayPPOTrainer:
    """Drives the actor / reference / critic / reward-model / teacher groups and the rollout worker.

    Args:
        config: the run (a ``RunConfig``, or a mapping with its keys).
        model_path: HF directory the policy (and, unless ``critic.model.path``, the critic) starts from;
            default ``actor_rollout_ref.model.path`` (an inline model is prepared by the main job:
            ``megatron_rl.job.main_job.build_trainer``).
        log_dir: run directory: ``metrics.jsonl`` and checkpoints (default ``trainer.default_local_dir``).
        teacher_path: HF directory of the distillation teacher (with ``distillation.enabled``).
        tokenizer / train_dataloader / reward_fn: replace what the config would build.
    Ray must be up; ``init_workers()`` starts the workers, ``fit()`` trains, ``shutdown()`` stops.
    """

    def __init__(
        self,
        config: Any,
        *,
        model_path: Optional[str | Path] = None,
        log_dir: Optional[str | Path] = None,
        teacher_path: Optional[str | Path] = None,
        tokenizer: Any = None,
        train_dataloader: Any = None,
        reward_fn: Any = None,
    ):
        self.config = config if isinstance(config, RunConfig) else RunConfig.from_dict(config)
        self.config = async_run_config(self.config)  # trainer.v1 separate_async forces bypass mode
        self.needs = resolve_run(self.config)
        self.config = with_plugins(self.config)  # losses registered in the driver's script travel to the workers
        if self.needs.teacher and teacher_path is None:
            raise ValueError("distillation.enabled=True needs the teacher's HF directory (teacher_path)")
        if model_path is None:
            if self.config.actor_rollout_ref.model.path is None:
                raise ValueError(
                    "an inline actor_rollout_ref.model.config is materialised by the main job; build the "
                    "trainer with megatron_rl.job.main_job.build_trainer or pass model_path"
                )
            model_path = Path(self.config.actor_rollout_ref.model.path).expanduser()
        self.log_dir = Path(log_dir or self.config.trainer.default_local_dir)
        self.model_path, self.teacher_path = str(model_path), None if teacher_path is None else str(teacher_path)
        algo, dist = self.config.algorithm, self.config.distillation
        self.temperature = self.config.actor_rollout_ref.rollout.temperature
        self.adv_fn = ADV_ESTIMATORS[algo.adv_estimator]
        self.kl_ctrl = get_kl_controller(algo.kl_ctrl) if algo.use_kl_in_reward else None
        self.rollout_correction = active_rollout_correction(algo.rollout_correction)
        self.distillation_loss = dist.distillation_loss if dist.enabled else None
        self.tokenizer = tokenizer or build_tokenizer(self.config, self.model_path)
        self.train_dataloader = train_dataloader or build_train_dataloader(self.config, self.tokenizer, self.log_dir)
        self.val_dataloader = build_val_dataloader(self.config, self.tokenizer, self.log_dir)
        self.reward_fn = reward_fn or build_reward_fn(self.config, self.tokenizer)
        self.multi_turn = self.config.actor_rollout_ref.rollout.multi_turn.enable
        if self.multi_turn:  # agent sessions: an unknown agent loop or a bad tool config fails before any worker
            check_agent_config(self.config.actor_rollout_ref.rollout)
        tcfg = self.config.trainer
        self.total_steps = tcfg.total_training_steps or tcfg.total_epochs * len(self.train_dataloader)
        check_async_trainer(self.config, self.needs, self.total_steps)  # before any worker starts
        if tcfg.val_only and self.val_dataloader is None:
            raise ValueError("trainer.val_only=True needs a validation set: set data.val_files (or data.task)")
        # the colocated phases (offload / rollout sleep); bad offload settings fail here, before any worker
        # A LoRA actor is its own reference (adapters off): no reference role, no reference phase.
        self.ref_in_actor = reference_in_actor(self.config, self.needs)
        role_needs = dataclasses.replace(self.needs, reference=False) if self.ref_in_actor else self.needs
        self.schedule = step_schedule(self.config, role_needs)
        self._check_router_replay()
        self.callbacks = load_callbacks(tcfg.callbacks)  # the user's own (trainer.callbacks), before any worker
        for message in self.schedule.warnings:
            warnings.warn(message, RolloutSleepUnsupported, stacklevel=2)
        self.global_steps = 0
        self.last_step = self.total_steps  # the step fit() trains to (its total_steps argument)
        self.resume_state: Optional[dict] = None  # the trainer state of the checkpoint resumed from
        self.batches: Optional[BatchSource] = None  # fit()'s batch source (megatron_rl.trainer.batch_source)
        self.weight_version = 0  # weight pushes into the rollout engine (its rollouts carry the version they used)
        self.placement = self.weight_sync = self.phases = None
        self.actor = self.ref = self.critic = self.rm = self.teacher = self.rollout = None

    def _check_router_replay(self) -> None:
        """Router replay (``*.megatron.router_replay``) that cannot work fails here, before any worker."""
        from megatron_rl.models.families import get_family, load_hf_config
        from megatron_rl.rollout.routed_experts import ROUTED_EXPERTS_KWARG, routed_experts_unsupported

        arr = self.config.actor_rollout_ref
        actor, ref = arr.actor.megatron.router_replay, arr.ref.megatron.router_replay
        self.router_replay, self.ref_router_replay = actor, (ref if self.needs.reference else None)
        modes = (actor.mode, ref.mode if self.needs.reference else "disabled")
        if modes == ("disabled", "disabled"):
            return
        hf = load_hf_config(self.model_path)
        is_moe = get_family(hf).model_config(hf).is_moe
        lacks = routed_experts_unsupported() if "R3" in modes else None
        if lacks is None and "R3" in modes and self.multi_turn:
            lacks = "agent sessions (rollout.multi_turn) do not carry the routed experts of their turns"
        check_run_router_replay(
            actor.mode, ref.mode if self.needs.reference else None, is_moe=is_moe, rollout_lacks=lacks
        )
        if "R3" in modes:  # the rollout engine returns the experts it routed every token to
            kwargs = arr.rollout.engine_kwargs
            vllm = {**(kwargs.get("vllm") or {}), ROUTED_EXPERTS_KWARG: True}
            self.config = self.config.with_values({"actor_rollout_ref.rollout.engine_kwargs": {**kwargs, "vllm": vllm}})

    def init_workers(self) -> None:
        """Start the roles the run needs (each in its own placement group) and the phases over them."""
        from megatron_rl.trainer.phases import PhaseRunner
        from megatron_rl.trainer.placement import Placement, actor_lora, role_specs
        from megatron_rl.trainer.rollout_phase import RolloutPhase
        from megatron_rl.workers.weight_sync import WeightSync

        specs = role_specs(
            self.config,
            self.needs,
            model_path=self.model_path,
            total_steps=self.total_steps,
            teacher_path=self.teacher_path,
        )
        self.placement = Placement(self.config, specs, model_path=self.model_path)
        self.actor, self.ref, self.critic, self.rm, self.teacher = (
            self.placement.get(role) for role in ("actor", "ref", "critic", "reward", "teacher")
        )
        self.rollout = self.placement.rollout  # replica 0's actor; generation goes through placement.router
        router = self.placement.router
        self.phases = PhaseRunner(self.schedule, self.placement.groups, router)
        if self.placement.started_asleep:  # GPU: the engines started before the roles and were put to sleep
            self.phases.state["rollout"] = ()
        rollout_cfg = self.config.actor_rollout_ref.rollout  # an fp8 engine gets its blocks quantised by the actor
        lora = actor_lora(self.config)  # lora.merge: false -> only the adapters go into vLLM's LoRA
        self.weight_sync = WeightSync(
            self.actor,
            router.actors,
            rollout_cfg.checkpoint_engine,
            quantization=rollout_cfg.quantization,
            adapter_only=lora.enabled and not lora.merge,
        )
        reward_fn = (
            FinalAnswerReward(self.reward_fn) if self.multi_turn else self.reward_fn
        )  # agent sessions: final answers
        self.rollout_phase = RolloutPhase(
            self.config,
            self.needs,
            router,
            self.train_dataloader,
            reward_fn,
            self.rm,
            dump=GenerationDump.create(self.config.trainer.rollout_data_dir),
            stage=self.phases.stage,
        )
        self.validator = Validator(
            self.config.trainer,
            self.val_dataloader,
            self.rollout_phase.generate,
            reward_fn,
            dump=GenerationDump.create(self.config.trainer.validation_data_dir),
        )
        self.checkpointer = Checkpointer(
            self.log_dir, self.config.trainer, {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}
        )
        self.callbacks.add(self.validator, self.checkpointer)  # they run at each step's end, by their order

    # -- the loop ---------------------------------------------------------------------------
    @guard_fit  # trainer.phase_timeout_s and SIGTERM/SIGINT (trainer.save_on_preemption): trainer.watchdog
    def fit(
        self, total_steps: Optional[int] = None, on_step: Optional[Callable[[dict], None]] = None
    ) -> list[dict[str, float]]:
        """Train until step ``total_steps`` (default ``trainer.total_training_steps``, else
        ``trainer.total_epochs`` passes over the prompts), resuming from the latest checkpoint when
        ``trainer.resume_mode`` allows; returns this call's metrics. ``on_step(metrics)`` runs after
        each step is logged (progress bars). With ``trainer.val_only`` it validates once and returns."""
        tcfg = self.config.trainer
        self.last_step = int(total_steps or self.total_steps)
        fresh = self.resume() is None and self.global_steps == 0
        if fresh and self.config.actor_rollout_ref.rollout.load_format == "dummy":
            self.sync_weights()  # the engine was built with random weights: the first sync fills it
        logger = MetricsLogger(
            self.log_dir,
            tcfg.logger,
            total_steps=self.last_step,
            project=tcfg.project_name,
            experiment=tcfg.experiment_name,
        )
        per_fit = [MetricsLog(logger), SkipGuard(tcfg)] + ([StepFunction(on_step)] if on_step is not None else [])
        with self.callbacks.during(*per_fit) as hooks:
            hooks.call("on_fit_start", self, self.global_steps)
            row: dict[str, float] = {}
            hooks.call("before_training", self, self.global_steps, row)  # trainer.val_before_train, val_only
            if tcfg.val_only:
                hooks.call("on_fit_end", self, [row])
                return [row]
            history = []
            # the step's batch: generated by the step itself (sync) or taken from the buffer a rollouter
            # fills ahead (trainer.v1.trainer_mode colocate_async / separate_async); the step is the same
            self.batches = AsyncBatches(self) if tcfg.v1.is_async else SyncBatches(self.rollout_phase)
            with self.batches as source:
                while self.global_steps < self.last_step:
                    self.global_steps += 1
                    step, metrics, timing = self.global_steps, {}, {}
                    wall_start = time.time()
                    with timer("step", timing), worker_failure(step, self.log_dir):
                        batch = source.next_batch(step, metrics, timing)  # None: the rewards failed
                        if batch is not None:
                            self.train_step(batch, metrics, timing)
                            source.trained(step)
                    source.end_metrics(metrics, wall_start)
                    self.end_step(batch, metrics, timing, step=step)
                    history.append(metrics)
                    self.placement.shards.clear()  # this step's batch leaves the object store
            self.phases.restore()  # every model whole again for exports and callers after fit
            hooks.call("on_fit_end", self, history)
        return history

    # -- one step after the rollout -------------------------------------------------------------
    def end_step(self, batch: Optional[Batch], metrics: dict, timing: dict, *, step: int) -> None:
        """The end of step ``step`` (of any batch source): its step and memory metrics, then every
        callback's ``on_step_end`` by order -- validation and checkpoint when due, the user's callbacks,
        the metrics log, ``fit``'s ``on_step``, the skip guard (``megatron_rl.trainer.callbacks``)."""
        metrics.update(
            step_metrics(
                batch,
                timing,
                step=step,
                epoch=self.train_dataloader.epoch,
                use_critic=self.critic is not None,
                n_devices=self.config.trainer.world_size,
            )
        )
        metrics.update(self.phases.memory_metrics())
        self.callbacks.call("on_step_end", self, step, metrics)

    def train_step(self, batch: Batch, metrics: dict, timing: dict) -> None:
        """Everything after scoring: log-probs, advantages, updates, weight sync."""
        if self.config.trainer.balance_batch:  # even token counts over the actor's DP ranks
            from megatron_rl.trainer.balance import balance_batch

            metrics.update(balance_batch(batch, self.actor.dp_size))
        stage = self.phases.stage  # one name per stage: timing_s/<name>, its memory phase, the watchdog
        with stage("old_log_prob", timing, metrics):
            metrics.update(self.compute_old_log_prob(batch))
        if self.ref is not None:
            with stage("ref", timing, metrics):
                micro = self.config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
                replay = {"routing": "replay"} if self.ref_router_replay.enabled else {}  # R2: the actor's record
                batch["ref_log_prob"] = self.ref.compute_log_prob(
                    batch, temperature=self.temperature, micro_batch_size=micro, **replay
                )["log_probs"]
        elif self.ref_in_actor:  # LoRA: the actor with its adapters off is the reference (no phase of its own)
            with stage("ref", timing, metrics):
                micro = self.config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
                batch["ref_log_prob"] = self.actor.collect(
                    "compute_ref_log_prob", batch, temperature=self.temperature, micro_batch_size=micro
                )["log_probs"]
        if self.teacher is not None:
            with stage("teacher", timing, metrics):
                self.compute_teacher_log_probs(batch)
        if self.critic is not None:
            with stage("values", timing, metrics):
                batch["values"] = self.critic.compute_values(batch)["values"]
        with stage("adv", timing):
            metrics.update(self.compute_advantage(batch))
        if self.critic is not None:
            with stage("update_critic", timing, metrics):
                metrics.update(self.critic.update_critic(batch))
        if self.global_steps > self.config.trainer.critic_warmup:
            with stage("update_actor", timing, metrics):
                distill = {} if self.distillation_loss is None else {"distillation_loss": self.distillation_loss}
                if self.router_replay.enabled:
                    distill["routing_source"] = "rollout" if self.router_replay.mode == "R3" else "old"
                metrics.update(self.actor.update_policy(batch, temperature=self.temperature, **distill))
            with stage("update_weights", timing, metrics):
                metrics.update(self.sync_weights())
        if ROUTED_EXPERTS in batch:  # [b, s, layers, topk] ids: freed with the step
            batch.pop([ROUTED_EXPERTS])

    def compute_old_log_prob(self, batch: Batch) -> dict[str, float]:
        """Actor log-probs of the sampled tokens (the PPO ratio's denominator) and their entropy;
        then rollout correction: bypass mode takes vLLM's log-probs as the old ones (the loss
        corrects against them and reports ``rollout_corr/*``), decoupled mode adds IS weights / the
        rejection mask. Bypass mode runs no actor pass (verl's ``apply_bypass_mode``) unless the step needs
        one of its products: ``sum_pi_squared`` or router replay's routing (``RunNeeds.old_log_prob``)."""
        rc = self.rollout_correction
        if rc is not None and "rollout_log_probs" not in batch:
            raise ValueError(
                "algorithm.rollout_correction needs the rollout's log-probs; set "
                "actor_rollout_ref.rollout.calculate_log_probs=True"
            )
        if rc is not None and rc.bypass_mode and not self.needs.old_log_prob:
            batch["old_log_probs"] = batch["rollout_log_probs"]
            return {}
        # sum_v pi_v^2 from the same fused pass: an estimator that declared the need (the optimal token
        # baseline), or verl's actor.calculate_sum_pi_squared.
        spsq = self.needs.estimator.sum_pi_squared or self.config.actor_rollout_ref.actor.calculate_sum_pi_squared
        out = self.actor.compute_log_prob(
            batch,
            temperature=self.temperature,
            calculate_entropy=True,
            **({"calculate_sum_pi_squared": True} if spsq else {}),
            **self._old_log_prob_routing(batch),
        )
        metrics = self._routing_metrics(batch, out)
        if spsq:
            batch["sum_pi_squared"] = out["sum_pi_squared"]
        mode = self.config.actor_rollout_ref.actor.loss_agg_mode
        metrics["actor/entropy"] = float(agg_loss(out["entropys"], batch["response_mask"], mode))
        if rc is not None and rc.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]
            metrics.update(
                compute_rollout_corr_metrics_from_logprobs(
                    out["log_probs"], batch["rollout_log_probs"], batch["response_mask"]
                )
            )
            return metrics
        batch["old_log_probs"] = out["log_probs"]
        if rc is not None:
            weights, mask, corr = compute_rollout_correction_and_rejection_mask(
                batch["old_log_probs"],
                batch["rollout_log_probs"],
                batch["response_mask"],
                **rollout_correction_kwargs(rc),
            )
            batch["response_mask"] = mask  # rejected tokens leave every later phase (verl's semantics)
            if weights is not None:  # a DataProto holding rollout_is_weights, as verl returns it
                batch["rollout_is_weights"] = weights.batch["rollout_is_weights"]
            metrics.update(corr)
        return metrics

    def _old_log_prob_routing(self, batch: Batch) -> dict[str, str]:
        """How the old-log-prob pass routes: R2 records, R3 replays the rollout's experts (refused
        before workers start until the rollout returns them), else as the routers pick."""
        rr = self.router_replay
        return {"routing": "record" if rr.mode == "R2" else "replay"} if rr.enabled else {}

    def _routing_metrics(self, batch: Batch, out: dict) -> dict[str, float]:
        """Take the old-log-prob pass's routing into the batch (R2), save it (``record_file``) and, when
        the pass replayed the rollout's (R3), how often the actor's routers agreed with it."""
        rr, metrics = self.router_replay, {}
        if ROUTED_EXPERTS in out:
            batch[ROUTED_EXPERTS] = out[ROUTED_EXPERTS]
        if "router_agreement" in out and rr.mode == "R3":
            metrics["actor/router_agreement/rollout_vs_old"] = float(out["router_agreement"].float().mean())
        if rr.enabled and rr.record_file is not None:
            save_routing(rr.record_file, self.global_steps, batch)
        return metrics

    def compute_teacher_log_probs(self, batch: Batch) -> None:
        """The teacher's side of the distillation loss: its top-k (``forward_kl_topk``) or its
        log-probs of the sampled tokens."""
        loss = self.distillation_loss
        if loss.loss_mode in TOPK_LOSS_MODES:
            out = self.teacher.compute_topk_log_probs(batch, k=loss.topk, temperature=self.temperature)
            batch["teacher_topk_log_probs"], batch["teacher_topk_ids"] = out["topk_log_probs"], out["topk_ids"]
        else:
            batch["teacher_log_probs"] = self.teacher.compute_log_prob(batch, temperature=self.temperature)["log_probs"]

    def compute_advantage(self, batch: Batch) -> dict[str, float]:
        """KL-in-reward (optional), then the configured estimator, on the driver."""
        algo, metrics = self.config.algorithm, {}
        if self.kl_ctrl is not None:
            batch["token_level_rewards"], metrics = apply_kl_penalty(
                batch["token_level_scores"],
                batch["old_log_probs"],
                batch["ref_log_prob"],
                batch["response_mask"],
                self.kl_ctrl,
                algo.kl_penalty,
            )
        else:
            batch["token_level_rewards"] = batch["token_level_scores"]
        extra = {"reward_baselines": batch["reward_baselines"]} if self.needs.baseline else {}
        if self.needs.estimator.reward_fields:  # e.g. GDPO's components, named by algorithm.gdpo_reward_keys
            extra["non_tensor_batch"] = batch.non_tensor_batch
        if self.needs.estimator.sum_pi_squared:  # the optimal token baseline's path variance (verl's kwargs)
            extra.update(
                sum_pi_squared=batch["sum_pi_squared"],
                old_log_probs=batch["old_log_probs"],
                rollout_is_weights=batch.get("rollout_is_weights"),
            )
        if self.multi_turn:  # agent sessions: group statistics over each session's final sample (verl's rule)
            batch["advantages"], batch["returns"] = compute_advantage_for_multi_trajectories(
                batch["token_level_rewards"],
                batch["response_mask"],
                agent_batch_keys(batch),
                algo.adv_estimator,
                gamma=algo.gamma,
                lam=algo.lam,
                norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
                config=algo,
                values=batch.get("values"),
                **extra,
            )
            return metrics
        batch["advantages"], batch["returns"] = self.adv_fn(
            token_level_rewards=batch["token_level_rewards"],
            response_mask=batch["response_mask"],
            index=np.array(list(batch["uid"]), dtype=object),
            values=batch.get("values"),
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
            config=algo,
            **extra,
        )
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """Actor -> rollout engine, in place, through the transport ``checkpoint_engine.backend`` names."""
        stats = self.weight_sync.sync()  # every replica acknowledged (else RuntimeError: the step stops)
        self.weight_version += 1
        return {"weight_sync/bytes": float(stats["bytes"]), "weight_sync/seconds": float(stats["seconds"])}

    # -- checkpoint / resume -----------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """Driver-side state a resume needs (the workers save their own), with what the batch source
        adds (an asynchronous one: the prompt position to rewind to, ``AsyncBatches.state``)."""
        return {
            "global_steps": self.global_steps,
            "dataloader": self.train_dataloader.state_dict(),
            "kl_coef": None if self.kl_ctrl is None else float(self.kl_ctrl.value),
            "model_path": self.model_path,
            **(self.batches.state() if self.batches is not None else {}),
        }

    def resume(self) -> Optional[Path]:
        """Load the checkpoint ``trainer.resume_mode`` selects (None: fresh start): worker states,
        step, data position, KL coefficient; push the restored actor into the rollout engine and
        drop metrics.jsonl lines of steps after the checkpoint (they will be re-run)."""
        found = None if self.global_steps > 0 else self.checkpointer.resume()
        if found is None:
            return None
        path, state = found
        self.resume_state = state  # the async loop reads its queue's resume point from it
        self.train_dataloader.load_state_dict(state["dataloader"])
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = float(state["kl_coef"])
        self.global_steps = int(state["global_steps"])
        self.sync_weights()
        drop_rows_after(self.log_dir / "metrics.jsonl", self.global_steps)
        if restore_row(self.log_dir / "metrics.jsonl", state.get(METRICS_ROW)):
            print(f"step {self.global_steps}'s metrics row restored from {path} (killed before it was logged)")
        print(f"resumed from {path} at step {self.global_steps}", flush=True)
        return path

    def save_hf_checkpoint(self, out_dir: str | Path) -> Path:
        """The actor as an HF checkpoint at ``out_dir`` (``megatron_rl.trainer.hf_export``)."""
        from megatron_rl.trainer.hf_export import save_hf_checkpoint

        mb = self.config.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
        return save_hf_checkpoint(self.actor, self.model_path, out_dir, bucket_bytes=int(mb * 2**20))

    def shutdown(self) -> None:
        """Stop every worker and free the placement groups."""
        if self.placement is not None:
            self.placement.shutdown()
            self.placement = None
