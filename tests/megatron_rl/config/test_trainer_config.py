"""RunConfig, YAML recipes and key=value overrides: loading, inheritance, derived keys,
strict keys with suggestions, registry names, batch/layout arithmetic, needs_* logic."""

import warnings
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from megatron_rl.algos import ADV_ESTIMATORS, POLICY_LOSSES
from megatron_rl.algos.needs import resolve_run
from megatron_rl.config import ActorConfig, RunConfig, compose, dump_config, list_recipes, load_config
from megatron_rl.config.loader import find_recipe
from parallel.config import ParallelConfig

ALGOS = ["dapo", "dr_grpo", "grpo", "gspo", "opd", "ppo", "reinforce_plus_plus", "remax", "rloo"]
GPU = [f"gpu/qwen3_30b_a3b_{name}" for name in ALGOS]
GPU_SCALE = [f"gpu/{model}_{algo}" for model in ("llama3_1_70b", "qwen3_235b_a22b") for algo in ("dapo", "grpo")]
# tests/megatron_rl/config/test_frontier_recipes.py plans them (DeepSeek-V3 671B, GLM-4.5-Air, GLM-4.5 355B)
GPU_SCALE += [f"gpu/{model}_grpo" for model in ("deepseek_v3_671b", "glm4_5_air", "glm4_5_355b")]
AGENT = ["tool_agent"]  # tests/megatron_rl/rollout/agent/test_tool_agent_recipe.py runs it
MOE = ["grpo_moe"]  # tests/megatron_rl/trainer/test_recipes.py runs it (EP=2, router replay R2)
ASYNC = ["grpo_async"]  # tests/megatron_rl/trainer/test_async_trainer.py runs it (separate_async)
LORA = ["grpo_lora"]  # tests/megatron_rl/trainer/test_lora_trainer.py runs it (adapters on a frozen base)
LORA += ["gpu/qwen3_30b_a3b_grpo_lora"]  # tests/megatron_rl/test_planner.py plans it (one node; full FT does not fit)

# recipe -> (adv_estimator, loss_mode, loss_agg_mode, needs_critic, needs_reference, needs_teacher)
EXPECTED = {
    "grpo": ("grpo", "vanilla", "token-mean", False, False, False),
    "dr_grpo": ("grpo", "vanilla", "seq-mean-token-sum-norm", False, False, False),
    "dapo": ("grpo", "vanilla", "token-mean", False, False, False),
    "gspo": ("grpo", "gspo", "seq-mean-token-mean", False, False, False),
    "ppo": ("gae", "vanilla", "token-mean", True, False, False),
    "rloo": ("rloo", "vanilla", "token-mean", False, True, False),
    "reinforce_plus_plus": ("reinforce_plus_plus", "vanilla", "token-mean", False, True, False),
    "remax": ("remax", "vanilla", "token-mean", False, True, False),
    "opd": ("grpo", "vanilla", "token-mean", False, False, True),
}


def _error(recipe, overrides=()):
    """The ValueError of loading ``recipe`` + ``overrides`` and resolving it against the registries."""
    with pytest.raises(ValueError) as info:
        resolve_run(load_config(recipe, list(overrides)))
    return str(info.value)


# ----------------------------------------------------------------------------- recipes
def test_recipe_list_is_complete():
    assert list_recipes() == sorted(ALGOS + GPU + GPU_SCALE + AGENT + MOE + ASYNC + LORA)


@pytest.mark.parametrize("name", ALGOS + GPU)
def test_every_recipe_loads_validates_and_round_trips(name, tmp_path):
    cfg = load_config(name)
    algo = name.rpartition("qwen3_30b_a3b_")[2] if name.startswith("gpu/") else name
    estimator, loss_mode, agg, critic, ref, teacher = EXPECTED[algo]
    ref = ref or name == "gpu/qwen3_30b_a3b_grpo"  # verl's GPU GRPO keeps a low_var_kl loss (0.001)
    arr = cfg.actor_rollout_ref
    assert (cfg.algorithm.adv_estimator, arr.actor.policy_loss.loss_mode, arr.actor.loss_agg_mode) == (
        estimator,
        loss_mode,
        agg,
    )
    needs = resolve_run(cfg)
    assert (needs.critic, needs.reference, needs.teacher, needs.reward_model) == (critic, ref, teacher, False)
    # Derived keys are filled from their sources.
    assert arr.actor.rollout_n == cfg.critic.rollout_n == arr.rollout.n
    assert (arr.rollout.prompt_length, arr.rollout.response_length) == (
        cfg.data.max_prompt_length,
        cfg.data.max_response_length,
    )
    assert cfg.reward.reward_kwargs.max_resp_len == cfg.data.max_response_length
    assert arr.ref.megatron.parallel() == arr.actor.megatron.parallel()
    if name.startswith("gpu/"):
        assert (cfg.trainer.device, cfg.trainer.world_size) == ("cuda", 16)
        assert arr.model.path == "~/models/Qwen3-30B-A3B" and arr.model.config is None
        mp = arr.actor.megatron.parallel()
        assert (
            mp.tensor_model_parallel_size,
            mp.pipeline_model_parallel_size,
            mp.expert_model_parallel_size,
            mp.expert_tensor_parallel_size,
        ) == (4, 2, 8, 1)
        assert arr.actor.megatron.dtype == arr.rollout.dtype == "bfloat16"
        assert arr.rollout.tensor_model_parallel_size == 4
    else:
        assert (cfg.trainer.device, cfg.trainer.world_size) == ("cpu", 1)
        assert arr.model.family == "qwen3" and arr.model.config.head_dim == 32
        assert arr.actor.megatron.parallel().tensor_model_parallel_size == 1
        assert (arr.rollout.name, arr.rollout.dtype, arr.actor.megatron.dtype) == ("vllm", "float32", "float32")
    if critic:
        assert cfg.critic.model == arr.model  # the value model defaults to the policy's
    # The resolved config written to a run directory loads back to the same config.
    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_variants_extend_their_base_recipe():
    for name in ALGOS + GPU:
        base = yaml.safe_load(find_recipe(name).read_text()).get("base")
        if name in ("grpo", "gpu/qwen3_30b_a3b_grpo"):
            assert base is None
        else:
            assert base == ("gpu/qwen3_30b_a3b_grpo" if name.startswith("gpu/") else "grpo"), name


def test_default_recipe_is_the_cpu_grpo_toy():
    cfg = load_config()
    assert cfg == load_config("grpo")
    assert (cfg.data.task, cfg.reward.reward_fn, cfg.algorithm.adv_estimator) == ("toy_reverse", "toy_reverse", "grpo")
    assert isinstance(cfg.actor_rollout_ref.actor, ActorConfig)  # the engine takes it as it is
    assert cfg.actor_rollout_ref.actor.megatron.parallel() == ParallelConfig()


def test_algorithm_specific_settings():
    dapo = load_config("dapo")
    assert (dapo.actor_rollout_ref.actor.clip_ratio_low, dapo.actor_rollout_ref.actor.clip_ratio_high) == (0.2, 0.28)
    assert (dapo.algorithm.filter_groups.enable, dapo.algorithm.filter_groups.metric) == (True, "score")
    buf = dapo.reward.reward_kwargs.overlong_buffer_cfg
    assert (buf.enable, buf.len, buf.penalty_factor, dapo.data.gen_batch_size) == (True, 4, 1.0, 64)
    assert (dapo.algorithm.filter_groups.max_num_gen_batches, dapo.trainer.total_training_steps) == (10, 75)
    assert load_config("dr_grpo").algorithm.norm_adv_by_std_in_grpo is False
    assert load_config("reinforce_plus_plus").actor_rollout_ref.actor.kl_loss_type == "mse"
    opd = load_config("opd").distillation
    assert (opd.enabled, opd.distillation_loss.loss_mode, opd.distillation_loss.use_policy_gradient) == (
        True,
        "k1",
        True,
    )
    gpu_ppo = load_config("gpu/qwen3_30b_a3b_ppo")
    assert (gpu_ppo.critic.optim.lr, gpu_ppo.actor_rollout_ref.actor.optim.lr) == (1e-5, 1e-6)
    assert gpu_ppo.critic.megatron.parallel() == gpu_ppo.actor_rollout_ref.actor.megatron.parallel()


# ----------------------------------------------------------------------------- overrides
def test_overrides_apply_and_keep_types():
    cfg = load_config(
        "grpo",
        [
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "algorithm.adv_estimator=rloo",
            "trainer.logger=[console,tensorboard]",
            "actor_rollout_ref.actor.optim.clip_grad=2",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=20",
        ],
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5 and cfg.algorithm.adv_estimator == "rloo"
    assert cfg.trainer.logger == ["console", "tensorboard"]
    clip = cfg.actor_rollout_ref.actor.optim.clip_grad
    assert clip == 2.0 and isinstance(clip, float)  # an int where a float is declared becomes a float
    assert cfg.actor_rollout_ref.rollout.engine_kwargs == {"vllm": {"max_logprobs": 20}}
    # Later overrides win; a mapping value sets a whole section.
    cfg = load_config(
        "grpo",
        [
            "algorithm.adv_estimator=rloo",
            "algorithm.adv_estimator=remax",
            "algorithm.filter_groups={enable: true, metric: score}",
        ],
    )
    assert cfg.algorithm.adv_estimator == "remax" and cfg.algorithm.filter_groups.metric == "score"


def test_overrides_propagate_to_derived_keys():
    cfg = load_config(
        "grpo",
        [
            "actor_rollout_ref.rollout.n=4",
            "data.max_prompt_length=32",
            "data.max_response_length=24",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        ],
    )
    arr = cfg.actor_rollout_ref
    assert (arr.actor.rollout_n, cfg.critic.rollout_n) == (4, 4)
    assert (arr.rollout.prompt_length, arr.rollout.response_length, cfg.reward.reward_kwargs.max_resp_len) == (
        32,
        24,
        24,
    )
    assert arr.ref.megatron.tensor_model_parallel_size == 2
    # An explicit value that contradicts its source is an error, not silently replaced.
    assert _error("grpo", ["actor_rollout_ref.rollout.prompt_length=32"]) == (
        "actor_rollout_ref.rollout.prompt_length=32 disagrees with data.max_prompt_length=64; leave "
        "actor_rollout_ref.rollout.prompt_length out (it is derived from data.max_prompt_length)"
    )


def test_unknown_key_in_override_names_the_nearest_keys():
    assert _error("grpo", ["actor_rollout_ref.actor.optim.lrr=1e-5"]) == (
        "unknown config key 'actor_rollout_ref.actor.optim.lrr' in override "
        "'actor_rollout_ref.actor.optim.lrr=1e-5'; nearest valid keys: 'actor_rollout_ref.actor.optim.lr'"
    )
    # A key put in the wrong section: the same name elsewhere in the tree is suggested.
    assert _error("grpo", ["actor_rollout_ref.actor.tensor_model_parallel_size=2"]) == (
        "unknown config key 'actor_rollout_ref.actor.tensor_model_parallel_size' in override "
        "'actor_rollout_ref.actor.tensor_model_parallel_size=2'; nearest valid keys: "
        "'actor_rollout_ref.actor.megatron.tensor_model_parallel_size', "
        "'actor_rollout_ref.rollout.tensor_model_parallel_size', "
        "'actor_rollout_ref.ref.megatron.tensor_model_parallel_size'"
    )
    # verl's older top-level reward_model.enable is read as reward.reward_model.enable (issue 28), whose check speaks
    assert _error("grpo", ["reward_model.enable=true"]) == (
        "reward.reward_model.enable=True needs reward.reward_model.model_path"
    )
    assert _error("grpo", ["algorithm.filter_groups={enable: true, metrc: acc}"]) == (
        "unknown config key 'algorithm.filter_groups.metrc' in override "
        "'algorithm.filter_groups={enable: true, metrc: acc}'; nearest valid keys: 'algorithm.filter_groups.metric'"
    )
    assert _error("grpo", ["trainer.zzz=1"]).startswith(
        "unknown config key 'trainer.zzz' in override 'trainer.zzz=1'; valid keys under 'trainer': ['balance_batch', "
    )


def test_bad_override_values_and_forms():
    assert _error("grpo", ["trainer.total_epochs=abc"]) == (
        "trainer.total_epochs='abc' has the wrong type; expected int (in override 'trainer.total_epochs=abc')"
    )
    assert _error("grpo", ["actor_rollout_ref.actor.optim.lr.x=1"]) == (
        "config key 'actor_rollout_ref.actor.optim.lr' is a value, not a section; "
        "'actor_rollout_ref.actor.optim.lr.x' in override 'actor_rollout_ref.actor.optim.lr.x=1' cannot be set"
    )
    assert _error("grpo", ["trainer.total_epochs"]) == (
        "override 'trainer.total_epochs' must look like key=value (e.g. algorithm.adv_estimator=rloo)"
    )
    # Hydra's ~key deletes (issue 15); a key the configuration does not have cannot be deleted.
    assert _error("grpo", ["~trainer.no_such_key"]) == (
        "cannot delete 'trainer.no_such_key' (in override '~trainer.no_such_key'): the configuration has no such key"
    )
    # A section's own validation error carries the full dotted path of the field.
    assert _error("grpo", ["actor_rollout_ref.actor.loss_agg_mode=mean"]) == (
        "actor_rollout_ref.actor.loss_agg_mode='mean' is not allowed; choose one of ['token-mean', 'token-sum', "
        "'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm']"
    )
    assert _error("grpo", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0"]) == (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0 is not allowed; it must be an int >= 1"
    )


def test_unknown_key_in_yaml_names_file_and_suggestion(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("base: grpo\nactor_rollout_ref:\n  actor:\n    clip_ratio_hihg: 0.3\n")
    assert _error(recipe) == (
        f"unknown config key 'actor_rollout_ref.actor.clip_ratio_hihg' in {recipe.resolve()}; nearest valid keys: "
        "'actor_rollout_ref.actor.clip_ratio_high', 'actor_rollout_ref.actor.clip_ratio_c', "
        "'actor_rollout_ref.actor.clip_ratio'"
    )
    with pytest.raises(ValueError) as info:
        RunConfig.from_dict({"data": {"tsk": "toy"}})
    assert str(info.value) == "unknown config key 'data.tsk'; nearest valid keys: 'data.task'"


def test_unknown_recipe_lists_the_built_in_ones():
    assert _error("grpx") == (
        f"unknown recipe 'grpx': not a file and not a built-in recipe; built-in recipes: "
        f"{sorted(ALGOS + GPU + GPU_SCALE + AGENT + MOE + ASYNC + LORA)}; did you mean 'grpo' or 'dr_grpo' or 'gspo'?"
    )


# ----------------------------------------------------------------------------- names and numbers
def test_unknown_algorithm_names_list_the_registry():
    assert _error("grpo", ["algorithm.adv_estimator=grpoo"]).startswith(
        f"algorithm.adv_estimator='grpoo' is not a registered advantage estimator; choose one of "
        f"{sorted(ADV_ESTIMATORS)}; did you mean 'grpo'"
    )
    assert _error("grpo", ["actor_rollout_ref.actor.policy_loss.loss_mode=gsop"]) == (
        f"actor_rollout_ref.actor.policy_loss.loss_mode='gsop' is not a registered policy loss; choose one of "
        f"{sorted(POLICY_LOSSES)}; did you mean 'gspo'?"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.train_batch_size=24"],
            "data.train_batch_size * rollout.n = 24*8 = 192 is not divisible by "
            "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n = 16*8 = 128",
        ),
        (
            ["data.train_batch_size=4"],
            "data.train_batch_size=4 must be >= actor_rollout_ref.actor.ppo_mini_batch_size=16",
        ),
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=24", "trainer.n_gpus_per_node=2"],
            "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n = 16*8 = 128 is not divisible by "
            "data-parallel size * actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2*24 = 48",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=48"],
            "critic.ppo_mini_batch_size * rollout.n = 16*8 = 128 is not divisible by "
            "data-parallel size * critic.ppo_micro_batch_size_per_gpu = 1*48 = 48",
        ),
        (
            ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
            "actor_rollout_ref.actor.megatron: world_size=1 is not divisible by tensor_model_parallel_size * "
            "pipeline_model_parallel_size * context_parallel_size = 2*1*1 = 2 (world_size=1 = trainer.nnodes * "
            "trainer.n_gpus_per_node = 1*1)",
        ),
        (
            ["trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8"],
            "actor_rollout_ref.actor.megatron: num_attention_heads=4 is not divisible by tensor_model_parallel_size=8 "
            "(world_size=8 = trainer.nnodes * trainer.n_gpus_per_node = 1*8)",
        ),
        (
            ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4 does not divide world_size=2 "
            "(trainer.nnodes * trainer.n_gpus_per_node = 1*2)",
        ),
        (
            ["data.max_response_length=500"],
            "data.max_prompt_length + data.max_response_length = 564 exceeds "
            "actor_rollout_ref.model.config.max_position_embeddings=512",
        ),
    ],
)
def test_batch_and_layout_errors_name_the_numbers(overrides, message):
    assert _error("grpo", overrides) == message


def test_dynamic_bsz_skips_the_micro_batch_split_as_verl_does():
    """Under use_dynamic_bsz token budgets form the micro-batches: a micro-batch size that does not divide a
    rank's share is accepted (verl skips the check); the mini-batch must still split over the DP ranks."""
    micro = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=24", "trainer.n_gpus_per_node=2"]
    dynamic = "actor_rollout_ref.actor.use_dynamic_bsz=true"
    assert "is not divisible by data-parallel size" in _error("grpo", micro)
    assert load_config("grpo", [*micro, dynamic]).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 24
    critic = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=48"]
    assert "critic.ppo_mini_batch_size * rollout.n" in _error("grpo", critic)
    needs = resolve_run(load_config("grpo", [*critic, dynamic]))  # the critic's use_dynamic_bsz: the actor's
    assert needs.critic
    assert "critic.ppo_mini_batch_size * rollout.n" in _error(
        "grpo", [*critic, dynamic, "critic.use_dynamic_bsz=false"]
    )
    assert _error("grpo", [dynamic, "trainer.n_gpus_per_node=3"]) == (
        "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n = 16*8 = 128 is not divisible by the data-parallel "
        "size 3 of actor_rollout_ref.actor"
    )


def test_gpu_layout_that_does_not_fit_the_cluster():
    assert _error("gpu/qwen3_30b_a3b_grpo", ["trainer.nnodes=1"]) == (
        "actor_rollout_ref.actor.megatron: expert_model_parallel_size * expert_tensor_parallel_size = 8*1 = 8 "
        "does not divide the 4 ranks of a pipeline stage (world_size=8 / pipeline_model_parallel_size=2) "
        "(world_size=8 = trainer.nnodes * trainer.n_gpus_per_node = 1*8)"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["critic.enable=false", "algorithm.adv_estimator=gae"],
            "algorithm.adv_estimator='gae' needs a critic, but critic.enable=False",
        ),
        (
            ["algorithm.filter_groups.enable=true"],
            "algorithm.filter_groups.enable=True needs algorithm.filter_groups.metric (e.g. 'acc' or 'score')",
        ),
        (
            ["algorithm.filter_groups={enable: true, metric: acc}", "actor_rollout_ref.rollout.n=1"],
            "algorithm.filter_groups.enable=True needs actor_rollout_ref.rollout.n >= 2 (a group of one is never "
            "informative), got 1",
        ),
        (
            ["actor_rollout_ref.model.path=/ckpt"],
            "actor_rollout_ref.model: set exactly one of actor_rollout_ref.model.path (an HF checkpoint directory) and "
            "actor_rollout_ref.model.config (an inline ModelConfig); got both",
        ),
        (
            ["actor_rollout_ref.model.family=null"],
            "actor_rollout_ref.model.family must name the HF family an inline model is exported as for vLLM "
            "(e.g. 'qwen3') when actor_rollout_ref.model.config is set",
        ),
        (
            ["reward.reward_kwargs.overlong_buffer_cfg={enable: true, len: 32, penalty_factor: 1.0}"],
            "reward.reward_kwargs.overlong_buffer_cfg.len=32 must be <= reward.reward_kwargs.max_resp_len=16 "
            "(= data.max_response_length unless set)",
        ),
        (["trainer.resume_mode=resume_path"], "trainer.resume_mode='resume_path' needs trainer.resume_from_path"),
        (["data.task=null"], "data: set data.train_files (parquet/jsonl paths) or data.task (a built-in task name)"),
    ],
)
def test_cross_section_errors(overrides, message):
    assert _error("grpo", overrides) == message


# ----------------------------------------------------------------------------- what the run needs
@pytest.mark.parametrize(
    "overrides, critic, reference, reward_model",
    [
        ([], False, False, False),
        (["algorithm.adv_estimator=gae"], True, False, False),
        (["critic.enable=true"], True, False, False),
        (["algorithm.adv_estimator=gae", "critic.enable=true"], True, False, False),
        (["actor_rollout_ref.actor.use_kl_loss=true"], False, True, False),
        (["algorithm.use_kl_in_reward=true"], False, True, False),
        (["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true"], False, True, False),
        (["reward.reward_model.enable=true", "reward.reward_model.model_path=/rm"], False, False, True),
    ],
)
def test_needs_critic_reference_reward_model(overrides, critic, reference, reward_model):
    needs = resolve_run(load_config("grpo", overrides))
    assert (needs.critic, needs.reference, needs.reward_model) == (critic, reference, reward_model)


# ----------------------------------------------------------------------------- inheritance
def test_base_inheritance_chain(tmp_path):
    (tmp_path / "parent.yaml").write_text(
        "base: grpo\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: 3.0e-4\n"
        "trainer:\n  total_training_steps: 7\n  experiment_name: parent\n"
    )
    (tmp_path / "child.yaml").write_text(
        "base: parent.yaml\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: 5.0e-4\n  rollout:\n    n: 4\n"
        "trainer:\n  experiment_name: ${trainer.project_name}_child\n"
    )
    child = load_config(tmp_path / "child.yaml")
    assert child.actor_rollout_ref.actor.optim.lr == 5e-4  # the child wins
    assert child.actor_rollout_ref.actor.optim.clip_grad == 1.0  # grpo's, two levels up
    assert child.trainer.total_training_steps == 7  # the parent's
    assert child.actor_rollout_ref.rollout.n == child.actor_rollout_ref.actor.rollout_n == 4
    assert child.trainer.experiment_name == "megatron_rl_child"  # interpolation after merging
    assert child.trainer.default_local_dir == "outputs/megatron_rl_child"  # grpo's, interpolated after merging
    assert child.actor_rollout_ref.model == load_config("grpo").actor_rollout_ref.model
    # Overrides apply on top of the whole chain.
    assert (
        load_config(tmp_path / "child.yaml", ["actor_rollout_ref.actor.optim.lr=1e-3"]).actor_rollout_ref.actor.optim.lr
        == 1e-3
    )


def test_base_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    a, b = (tmp_path / "a.yaml").resolve(), (tmp_path / "b.yaml").resolve()
    assert _error(a) == f"recipe inheritance cycle: {a} -> {b} -> {a}"
    (tmp_path / "c.yaml").write_text("base: grpoo\n")
    assert _error(tmp_path / "c.yaml").startswith(
        f"base 'grpoo' of recipe {(tmp_path / 'c.yaml').resolve()}: unknown recipe 'grpoo'"
    )


def test_from_dict_accepts_dictconfig():
    data = compose("dapo")
    assert RunConfig.from_dict(OmegaConf.create(data)) == load_config("dapo")
    assert Path(find_recipe("gpu/qwen3_30b_a3b_grpo")).name == "qwen3_30b_a3b_grpo.yaml"


# A 5-layer model over PP=2: no even split; verl's override_transformer_config places 3 + 2 (or 1 + 4).
_UNEVEN_MODEL = (
    "{num_layers: 5, hidden_size: 1024, ffn_hidden_size: 4096, num_attention_heads: 8, num_query_groups: 8, "
    "kv_channels: 128, vocab_size: 8192, max_position_embeddings: 512}"
)
_UNEVEN_VERL = [
    "actor_rollout_ref.model.path=null",
    f"+actor_rollout_ref.model.config={_UNEVEN_MODEL}",
    "+actor_rollout_ref.model.family=qwen3",
    "data.train_files=train.parquet",
    "data.max_prompt_length=64",
    "data.max_response_length=64",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
]


@pytest.mark.parametrize("first, stage_layers", [(3, (3, 2)), (1, (1, 4))])
def test_verl_command_line_with_uneven_stages_plans_that_split(first, stage_layers):
    """verl's +...override_transformer_config.num_layers_in_first_pipeline_stage reaches the layout check of an
    inline model (5 layers over PP=2 would be refused) and the planner: the most loaded stage's parameters,
    counted by hand, follow the split."""
    from megatron_rl.config.loader import find_verl_config
    from megatron_rl.planner import plan_run

    uneven = f"+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage={first}"
    verl = str(find_verl_config("ppo_megatron_trainer"))
    with pytest.raises(ValueError, match=r"num_layers=5 is not divisible by pipeline_model_parallel_size=2"):
        load_config(verl, _UNEVEN_VERL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_run(load_config(verl, [*_UNEVEN_VERL, uneven]))
    h, f, vocab = 1024, 4096, 8192
    layer = h * 3 * 8 * 128 + 8 * 128 * h + 3 * h * f + 2 * h  # fused QKV, output projection, SwiGLU, two norms
    stages = (
        vocab * h + stage_layers[0] * layer,
        stage_layers[1] * layer + h + vocab * h,
    )  # + embedding | + norm, head
    assert plan.roles["actor"].params_dense == max(stages)
    assert plan.fits


# ----------------------------------------------------------------------------- LoRA (issue 29)
def test_grpo_lora_recipe_resolves_lora_and_the_reference_is_the_actor():
    from megatron_rl.trainer.placement import actor_lora, reference_in_actor

    assert not resolve_run(load_config("grpo_lora")).reference  # the recipe has no KL loss, as grpo
    cfg = load_config("grpo_lora", ["actor_rollout_ref.actor.use_kl_loss=true"])  # verl's LoRA example's
    needs = resolve_run(cfg)
    lora = actor_lora(cfg)
    assert (lora.rank, lora.alpha, lora.merge, lora.target_modules) == (  # merge: false: adapters-only sync
        16,
        32.0,
        False,
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    )
    assert needs.reference and reference_in_actor(cfg, needs)  # the KL loss's reference: the base model
    dumped = RunConfig.from_dict(cfg.to_dict())
    assert dumped == cfg and actor_lora(dumped) == lora


def test_verl_flat_lora_keys_map_onto_the_lora_section():
    from megatron_rl.trainer.placement import actor_lora

    m = "actor_rollout_ref.model"
    cfg = load_config(
        "grpo",
        [
            f"{m}.lora_rank=8",
            f"{m}.lora_alpha=4",
            f"{m}.target_modules=[linear_qkv, linear_fc2]",
            f"{m}.exclude_modules=[linear_proj]",
        ],
    )
    lora = actor_lora(cfg)
    assert (lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules, lora.merge) == (
        8,
        4.0,
        ["linear_qkv", "linear_fc2"],
        ["linear_proj"],
        True,
    )  # the flat form has no merge key
    assert actor_lora(load_config("grpo", [f"{m}.lora_rank=8"])).target_modules == [
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    ]  # verl's all-linear
    assert not actor_lora(load_config("grpo")).enabled  # verl's default: rank 0, LoRA off


LORA_ON = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.merge=true"]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.type=dora"],
            "actor_rollout_ref.model.lora.type='dora' is not allowed; choose one of ['lora']",
        ),
        (
            [*LORA_ON, "actor_rollout_ref.model.lora.target_modules=[q_proj]"],
            "actor_rollout_ref.model.lora.target_modules: ['q_proj'] not allowed; each one of ['linear_qkv', ",
        ),
        (
            [
                "actor_rollout_ref.model.lora_rank=4",
                "actor_rollout_ref.model.lora.rank=8",
                "actor_rollout_ref.model.lora.merge=true",
            ],
            "actor_rollout_ref.model.lora_rank=4 and model.lora.rank=8 are both set",
        ),
        (
            ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=0"],
            "actor_rollout_ref.model.lora_alpha: 0.0 is not allowed; a number > 0",
        ),
    ],
)
def test_bad_lora_settings_are_refused_by_key_when_the_config_is_built(overrides, says):
    with pytest.raises(ValueError) as err:
        load_config("grpo", overrides)
    assert says in str(err.value)


def test_lora_merge_false_is_verls_default_and_builds():
    """``lora.merge`` left out is verl's ``false``: the adapters alone go into vLLM's LoRA, whose engine
    gets ``enable_lora`` with a slot rank vLLM accepts (4 -> 8)."""
    from megatron_rl.config.lora_config import vllm_lora_engine_kwargs
    from megatron_rl.trainer.placement import actor_lora

    lora = actor_lora(load_config("grpo", ["actor_rollout_ref.model.lora.rank=4"]))
    assert (lora.rank, lora.merge) == (4, False)
    assert vllm_lora_engine_kwargs(lora) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert vllm_lora_engine_kwargs(actor_lora(load_config("grpo", LORA_ON))) == {}  # merged sync: no vLLM LoRA
    with pytest.raises(
        ValueError, match="lora.rank: 600 is not allowed with lora.merge=false; vLLM holds adapters of rank <= 512"
    ):
        vllm_lora_engine_kwargs(actor_lora(load_config("grpo", ["actor_rollout_ref.model.lora.rank=600"])))


def _tiny_hf_dir(cfg, tmp_path):
    """The recipe's inline model's HF ``config.json`` (the architecture the main job materialises)."""
    from transformers import Qwen3Config

    from megatron_rl.models.tiny import hf_config_kwargs

    Qwen3Config(
        **hf_config_kwargs(cfg.actor_rollout_ref.model.config, "qwen3"), architectures=["Qwen3ForCausalLM"]
    ).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    "overrides, says",
    [
        # hidden 128, 4 heads x 32 with 2 KV groups: linear_proj is 128 x 128, linear_qkv 256 x 128
        (
            ["actor_rollout_ref.model.lora.rank=200"],
            "actor_rollout_ref.model.lora.rank=200 is larger than linear_qkv's dimensions (256 x 128); allowed: 1..128",
        ),
        # PPO: the critic copies the actor's model section (LoRA included) but LoRA on a critic is not built
        (["algorithm.adv_estimator=gae"], "critic.model.lora.rank=16 is refused: LoRA on the critic is not built"),
    ],
)
def test_lora_misfits_are_refused_before_any_worker_starts(overrides, says, tmp_path):
    from megatron_rl.trainer.placement import role_specs

    cfg = load_config("grpo_lora", overrides)
    with pytest.raises(ValueError) as err:
        role_specs(cfg, resolve_run(cfg), model_path=_tiny_hf_dir(cfg, tmp_path), total_steps=1)
    assert says in str(err.value)


def test_lora_actor_gets_its_adapters_and_no_reference_worker(tmp_path):
    from megatron_rl.trainer.placement import role_specs

    cfg = load_config("grpo_lora")
    specs = role_specs(cfg, resolve_run(cfg), model_path=_tiny_hf_dir(cfg, tmp_path), total_steps=1)
    assert sorted(specs) == ["actor"] and specs["actor"].lora.rank == 16
    # the same run without LoRA keeps its reference worker (the KL loss needs one)
    full = load_config("grpo_lora", ["actor_rollout_ref.model.lora.rank=0", "actor_rollout_ref.actor.use_kl_loss=true"])
    specs = role_specs(full, resolve_run(full), model_path="/unused", total_steps=1)
    assert sorted(specs) == ["actor", "ref"] and specs["actor"].lora is None
    # a PPO critic with its own model section and lora.rank 0 trains every parameter beside a LoRA actor
    hf_dir = _tiny_hf_dir(cfg, tmp_path / "critic")
    ppo = load_config(
        "grpo_lora", ["algorithm.adv_estimator=gae", f"critic.model.path={hf_dir}", "critic.model.lora.rank=0"]
    )
    specs = role_specs(ppo, resolve_run(ppo), model_path=hf_dir, total_steps=1)
    assert sorted(specs) == ["actor", "critic"] and specs["critic"].lora is None


def test_lora_adapter_only_sync_warns_that_the_transport_keys_do_nothing(tmp_path):
    """With ``lora.merge: false`` the adapters go through Ray's object store: the transport's backend set
    away from its default warns by name; left at the defaults, nothing warns; ``shm_dir`` (where the engine
    writes the adapter) and the merged sync act."""
    from megatron_rl.config.compat import InertKeyWarning
    from megatron_rl.trainer.placement import role_specs

    def sync_warnings(overrides):
        cfg = load_config("grpo_lora", overrides)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            role_specs(cfg, resolve_run(cfg), model_path=_tiny_hf_dir(cfg, tmp_path), total_steps=1)
        return [
            str(w.message)
            for w in caught
            if issubclass(w.category, InertKeyWarning) and "checkpoint_engine" in str(w.message)
        ]

    said = sync_warnings(["actor_rollout_ref.rollout.checkpoint_engine.backend=shm"])
    assert said == [
        "actor_rollout_ref.rollout.checkpoint_engine.backend='shm' has no effect with "
        "actor_rollout_ref.model.lora.merge=false: the adapters reach vLLM's LoRA through Ray's "
        "object store, not through the weight-sync transport"
    ]
    assert sync_warnings([]) == []
    assert sync_warnings(["actor_rollout_ref.rollout.checkpoint_engine.shm_dir=/tmp"]) == []  # the adapter's dir
    assert (
        sync_warnings(
            ["actor_rollout_ref.rollout.checkpoint_engine.backend=shm", "actor_rollout_ref.model.lora.merge=true"]
        )
        == []
    )
