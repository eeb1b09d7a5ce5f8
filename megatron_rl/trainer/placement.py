"""Placement: which roles a run creates, what each one's ranks build, and where they run.

``role_specs(config, needs, ...)`` turns the typed run config and the run's needs
(``megatron_rl.algos.needs.RunNeeds``) into one ``WorkerSpec`` per Megatron role -- the only
place that maps config sections onto roles. ``Placement`` starts the worker groups and the
rollout worker with the resources of ``trainer.device``: on GPUs the roles and the rollout share
each device (verl's colocated workers); on CPU fractional CPUs let every rank of every role start
on a small machine.
"""

from __future__ import annotations

from typing import Optional

from megatron_rl.algos.needs import RunNeeds
from megatron_rl.algos.rollout_correction import bypass_policy_loss_config
from megatron_rl.config import ActorConfig, TrainerRunConfig
from megatron_rl.models.tiny import megatron_overrides
from megatron_rl.workers.dispatch import ShardCache
from megatron_rl.workers.spec import WorkerSpec

__all__ = ["role_specs", "actor_config", "Placement"]


def _with_horizon(role_config, total_steps: int):
    """``role_config`` whose LR schedule spans the run: ``optim.total_training_steps`` set to
    ``total_steps`` unless the config gives its own (verl's trainer does the same)."""
    if role_config.optim.total_training_steps > 0:
        return role_config
    return role_config.replace(optim=role_config.optim.replace(total_training_steps=total_steps))


def actor_config(config: TrainerRunConfig, total_steps: int):
    """The actor's config: the run's LR horizon; in rollout-correction bypass mode its policy loss
    becomes ``bypass_mode`` with the correction settings (verl's ``apply_bypass_mode``)."""
    actor, rc = _with_horizon(config.actor_rollout_ref.actor, total_steps), config.algorithm.rollout_correction
    if rc is None or not rc.bypass_mode:
        return actor
    return actor.replace(policy_loss=bypass_policy_loss_config(actor.policy_loss, rc))


def _model_overrides(megatron, source=None, inline=None) -> dict:
    """What a role's workers set on top of the checkpoint's architecture: an inline model's
    Megatron-side options, then the source's ``model.override_config``, then the role's
    ``megatron.dtype`` as ``params_dtype``."""
    inline = inline if inline is not None else (source.config if source is not None else None)
    out = {**(megatron_overrides(inline) if inline is not None else {}),
           **(source.override_config if source is not None else {})}
    if megatron.dtype is not None:
        out["params_dtype"] = megatron.dtype
    return out


def role_specs(config: TrainerRunConfig, needs: RunNeeds, *, model_path: str, total_steps: int,
               teacher_path: Optional[str] = None) -> dict[str, WorkerSpec]:
    """``{role: WorkerSpec}`` for the roles ``needs`` asks for (``actor`` always). ``model_path`` is the
    policy's HF directory (for an inline model, the materialised one); ``total_steps`` the LR horizon."""
    arr = config.actor_rollout_ref
    specs = {"actor": WorkerSpec("actor", arr.actor.megatron, actor_config(config, total_steps), hf_dir=model_path,
                                 model_overrides=_model_overrides(arr.actor.megatron, arr.model))}
    if needs.reference:
        specs["ref"] = WorkerSpec("ref", arr.ref.megatron, arr.actor, hf_dir=model_path,
                                  model_overrides=_model_overrides(arr.ref.megatron, arr.model))
    if needs.critic:
        critic = config.critic
        if critic.model.path is None and (critic.model.config != arr.model.config
                                          or critic.model.family != arr.model.family):
            raise ValueError("critic.model: an inline critic is the policy's architecture (its value head on the "
                             "materialised policy); set critic.model.path for another critic model")
        specs["critic"] = WorkerSpec("critic", critic.megatron, _with_horizon(critic, total_steps),
                                     hf_dir=critic.model.path or model_path,
                                     model_overrides=_model_overrides(critic.megatron, critic.model))
    if needs.reward_model:
        rm = config.reward.reward_model
        specs["reward"] = WorkerSpec("reward", rm.megatron, rm, hf_dir=rm.model_path,
                                     model_overrides=_model_overrides(rm.megatron))
    if needs.teacher:
        teacher = config.distillation.teacher_model
        micro = teacher.log_prob_micro_batch_size_per_gpu or arr.actor.ppo_micro_batch_size_per_gpu
        specs["teacher"] = WorkerSpec("teacher", teacher.megatron,
                                      ActorConfig(ppo_micro_batch_size_per_gpu=micro,
                                                  logprob_chunk_size=arr.actor.logprob_chunk_size),
                                      hf_dir=teacher_path,
                                      model_overrides=_model_overrides(teacher.megatron, inline=teacher.config))
    return specs


class Placement:
    """The worker groups of a run (``groups[role]``) and its rollout worker, started together."""

    def __init__(self, config: TrainerRunConfig, specs: dict[str, WorkerSpec], *, model_path: str):
        import ray

        from megatron_rl.workers.group import MegatronWorkerGroup
        from megatron_rl.workers.rollout_worker import create_rollout_worker

        world = config.trainer.world_size
        if config.trainer.device == "cuda":  # roles (and the rollout) share each GPU, as verl's colocated workers do
            cpus, gpus = 1.0, 1.0 / (len(specs) + 1)
        else:  # fractional CPUs so that every rank of every role can start on a small machine
            cpus, gpus = max(0.01, int(100 * ray.available_resources().get("CPU", 1) / (len(specs) * world + 1)) / 100), 0.0
        self.shards = ShardCache()
        self.groups: dict[str, MegatronWorkerGroup] = {}
        try:
            for role, spec in specs.items():
                self.groups[role] = MegatronWorkerGroup(spec, world, num_cpus_per_worker=cpus, num_gpus_per_worker=gpus,
                                                        shards=self.shards)
            self.rollout, self._rollout_pg = create_rollout_worker(model_path, config.actor_rollout_ref.rollout,
                                                                   num_cpus=cpus, num_gpus=gpus)
        except BaseException:
            self.shutdown()
            raise

    def get(self, role: str):
        """The group of ``role``, or None when the run has none."""
        return self.groups.get(role)

    def shutdown(self) -> None:
        """Stop every worker and free the placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
        if getattr(self, "rollout", None) is not None:
            ray.kill(self.rollout)
            remove_placement_group(self._rollout_pg)
            self.rollout = None
