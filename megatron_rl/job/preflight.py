"""Fail fast: everything ``megatron-rl train`` can check is checked before Ray or a worker starts.

``preflight(config, run_dir)`` runs, in this order, and each failure is a ``ValueError`` naming the
key the user set (exit 2: nothing trained, nothing in the run directory changed):

* the run directory (``trainer.default_local_dir`` is a directory or can be one);
* model paths (``actor_rollout_ref.model.path``, ``tokenizer_path``, the critic's, the reward
  model's, the teacher's): each exists and holds an HF ``config.json`` and weights;
* the checkpoint to resume from (``megatron_rl.trainer.step_checkpoints.select_checkpoint``: the manifest
  verified, damaged ones passed over with ``trainer.resume_fallback``) and whether this
  configuration may resume it: the same model shape and data order, the parts it trains present;
  a changed parallel layout is allowed (dist checkpoints reshard) and said;
* data files (``data.train_files`` / ``val_files``): exist, readable, non-empty, the required
  columns, UTF-8 JSON, no empty prompts (``megatron_rl.data.datasets.inspect_data_file``, naming
  file and row), enough prompts for one batch, and a rule reward for every ``data_source``;
* the reward: ``reward.reward_fn`` is registered, ``custom_reward_function`` compiles, imports and
  defines its function (a syntax error names file and line);
* logger packages, and sampling vLLM would refuse (greedy sampling with ``n > 1``);
* the GPU stack (``check_gpu_stack``): ``trainer.device=cuda`` needs a torch that sees a GPU (a
  CUDA 13 torch on a CUDA 12 driver sees none, and the run would silently take its CPU paths);
  a role that asks for TransformerEngine (``attention_backend: te``, or ``context_parallel_size``
  > 1) needs TE to import -- its import error is shown, never a quiet fallback to the local
  spec -- and context parallelism needs bfloat16 / float16 parameters (TE's CP attention).

It returns the resume ``Selection`` (``path`` None: a fresh start).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_rl.config import RunConfig
from megatron_rl.trainer.step_checkpoints import CONFIG_COPY, Selection, select_checkpoint

__all__ = [
    "preflight",
    "check_model_paths",
    "check_data",
    "check_reward",
    "check_loggers",
    "check_sampling",
    "check_resume",
    "check_gpu_stack",
]

_SHAPE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "num_moe_experts",
    "moe_ffn_hidden_size",
)
_HF_SHAPE = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "vocab_size": "vocab_size",
    "num_experts": "num_moe_experts",
}
_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "context_parallel_size",
)
_START_OVER = (
    "use another trainer.default_local_dir, or trainer.resume_mode=disable to start over here (the "
    "checkpoints are kept)"
)
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def preflight(config: RunConfig, run_dir: str | Path, *, log: Callable[[str], Any] = print) -> Selection:
    """Run every check of the module docstring; return the checkpoint to resume from."""
    from megatron_rl.algos.needs import resolve_run

    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"trainer.default_local_dir={str(run_dir)!r} is a file, not a directory")
    needs = resolve_run(config)
    check_model_paths(config, needs)
    choice = check_resume(config, run_dir, needs, log=log)
    check_data(config)
    check_reward(config)
    check_loggers(config)
    check_sampling(config)
    check_gpu_stack(config, needs)
    return choice


# ----------------------------------------------------------------------------- GPU stack
def _megatron_roles(config: RunConfig, needs: Any) -> list[tuple[str, Any, Any]]:
    """``(section, megatron config, model source or None)`` of every Megatron role this run builds."""
    arr = config.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor.megatron, arr.model)]
    if needs.reference:
        roles.append(("actor_rollout_ref.ref", arr.ref.megatron, arr.model))
    if needs.critic:
        roles.append(("critic", config.critic.megatron, config.critic.model))
    if needs.reward_model:
        roles.append(("reward.reward_model", config.reward.reward_model.megatron, None))
    if needs.teacher:
        roles.append(
            (
                "distillation.teacher_model",
                config.distillation.teacher_model.megatron,
                config.distillation.teacher_model,
            )
        )
    return roles


def _role_model_setting(source: Any, key: str, default: Any) -> Any:
    """``key`` of a role's model as the workers will build it: the inline config's, the HF override's, else ``default``."""
    if source is None:
        return default
    if key in getattr(source, "override_config", {}):
        return source.override_config[key]
    inline = getattr(source, "config", None)
    return getattr(inline, key) if inline is not None else default


def check_gpu_stack(
    config: RunConfig, needs: Any, *, cuda_available: Optional[bool] = None, te_error: Any = "probe"
) -> None:
    """The installed torch / TransformerEngine can run what the config asks for (module docstring).

    ``cuda_available`` / ``te_error`` replace the probes of this process (None: TE imports).
    """
    import torch

    from megatron_rl.models.gpt import te_import_error

    if config.trainer.device == "cuda":
        available = torch.cuda.is_available() if cuda_available is None else cuda_available
        if not available:
            built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
            raise ValueError(
                f"trainer.device='cuda' but torch {torch.__version__} ({built}) sees no GPU "
                "in this process: a torch built for a newer CUDA than the driver supports sees none "
                "(`nvidia-smi` shows the driver's CUDA version; README: GPU install), or "
                "CUDA_VISIBLE_DEVICES hides them; use trainer.device='cpu' for a CPU run"
            )
    for where, megatron, source in _megatron_roles(config, needs):
        backend = _role_model_setting(source, "attention_backend", "auto")
        cp = megatron.context_parallel_size
        asks = ([f"{where}.model attention_backend='te'"] if backend == "te" else []) + (
            [f"{where}.megatron.context_parallel_size={cp}"] if cp > 1 else []
        )
        if cp > 1:
            dtype = megatron.dtype or _role_model_setting(source, "params_dtype", "float32")
            if dtype == "float32":
                raise ValueError(
                    f"{where}.megatron.context_parallel_size={cp} needs bfloat16 or float16 parameters "
                    f"(this role trains in {dtype!r}): "
                    "TransformerEngine's flash and fused attention do not run float32 and its unfused "
                    f"attention is disabled under context parallelism; set {where}.megatron.dtype=bfloat16"
                )
        if asks:
            error = te_import_error() if te_error == "probe" else te_error
            if error is not None:
                raise ValueError(
                    f"{' and '.join(asks)} needs TransformerEngine, which does not import here ({error}); "
                    "install it as the README's GPU install says (its torch extension must be built "
                    "against the installed torch: --no-build-isolation)"
                )


# ----------------------------------------------------------------------------- models
def _check_hf_dir(key: str, value: Optional[str]) -> None:
    if value is None:
        return
    path = Path(value).expanduser()
    shown = f"{value!r}" + (f" ({path})" if str(path) != str(value) else "")
    if not path.exists():
        raise ValueError(
            f"{key}={shown} does not exist: it must be a local HF checkpoint directory (config.json + "
            f"*.safetensors); download it first, e.g. `huggingface-cli download <org>/<model> "
            f"--local-dir {value}`"
        )
    if not path.is_dir():
        raise ValueError(f"{key}={shown} is not a directory; it must be an HF checkpoint directory")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{key}={shown} holds no config.json: not an HF checkpoint directory")
    try:
        json.loads(config.read_text())
    except ValueError as exc:
        raise ValueError(f"{key}={shown}: {config} is not valid JSON ({exc})") from None
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{key}={shown} holds no *.safetensors weights")


def check_model_paths(config: RunConfig, needs: Any) -> None:
    """Every model directory the run loads exists and holds an HF config and weights."""
    arr = config.actor_rollout_ref
    _check_hf_dir("actor_rollout_ref.model.path", arr.model.path)
    tok = arr.model.tokenizer_path
    if tok is not None and not Path(tok).expanduser().is_dir():
        raise ValueError(f"actor_rollout_ref.model.tokenizer_path={tok!r} is not a directory")
    if needs.critic:
        _check_hf_dir("critic.model.path", config.critic.model.path)
    if needs.reward_model:
        _check_hf_dir("reward.reward_model.model_path", config.reward.reward_model.model_path)
    if needs.teacher:
        _check_hf_dir("distillation.teacher_model.model_path", config.distillation.teacher_model.model_path)


# ----------------------------------------------------------------------------- data and reward
def _files(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, Path)):
        return [value]
    return [str(v) for v in value]


def check_data(config: RunConfig) -> None:
    """The prompt files (or the built-in task) can give the run its batches (module docstring)."""
    from megatron_rl.data.datasets import TOY_TASKS, column_values, inspect_data_file
    from megatron_rl.data.rewards import DATA_SOURCE_TO_REWARD, REWARD_FNS

    data = config.data
    columns = (data.prompt_key, data.reward_fn_key, "reward_model")
    batch_key = "data.gen_batch_size" if data.gen_batch_size else "data.train_batch_size"
    batch = data.gen_batch_size or data.train_batch_size
    scored_by_source = config.reward.reward_fn is None and not config.reward.custom_reward_function.path
    if data.task is not None:
        if data.task not in TOY_TASKS:
            raise ValueError(f"data.task={data.task!r} is not a built-in task; built-in tasks: {sorted(TOY_TASKS)}")
        rows = int(data.task_kwargs.get("num_samples", 1024))
        if 0 < data.train_max_samples < rows:
            rows = data.train_max_samples
        if batch > rows:
            raise ValueError(
                f"{batch_key}={batch} is larger than the task's {rows} prompts (data.task_kwargs."
                "num_samples / data.train_max_samples); no batch could be drawn"
            )
        return
    for key, value in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        files = _files(value)
        if value is not None and not files:
            raise ValueError(f"{key}=[] names no file; give at least one .parquet/.jsonl path")
        rows = 0
        for path in files:
            try:
                rows += inspect_data_file(path, columns, prompt_key=data.prompt_key)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
            if scored_by_source:  # reward.reward_fn=null: each row's data_source picks the rule reward
                known = set(DATA_SOURCE_TO_REWARD) | set(REWARD_FNS)
                unknown = sorted({str(s) for s in column_values(path, data.reward_fn_key)} - known)
                if unknown:
                    raise ValueError(
                        f"{key}: data file {path!r} has {data.reward_fn_key}={unknown[0]!r}, for which there "
                        f"is no rule reward (reward.reward_fn=null picks it by data.reward_fn_key); set "
                        f"reward.reward_fn or reward.custom_reward_function.path; known data sources: "
                        f"{sorted(known)}"
                    )
        limit = data.train_max_samples if key == "data.train_files" else -1
        usable = min(rows, limit) if limit > 0 else rows
        if key == "data.train_files" and batch > usable and not data.filter_overlong_prompts:
            raise ValueError(
                f"{batch_key}={batch} is larger than the {usable} prompts of data.train_files "
                f"{files}; no batch could be drawn"
            )


def check_reward(config: RunConfig) -> None:
    """``reward.reward_fn`` is registered; a custom reward file compiles (a syntax error names file and
    line), imports (what it raises is named with its line) and defines its function."""
    from megatron_rl.data.rewards import REWARD_FNS, load_custom_reward_fn

    reward = config.reward
    if reward.reward_fn is not None and reward.reward_fn not in REWARD_FNS:
        raise ValueError(
            f"reward.reward_fn={reward.reward_fn!r} is not a registered reward; registered: "
            f"{sorted(REWARD_FNS)} (or set reward.custom_reward_function.path)"
        )
    custom = reward.custom_reward_function
    if custom.path:
        load_custom_reward_fn(custom.path, custom.name)


def check_loggers(config: RunConfig) -> None:
    """Every ``trainer.logger`` entry has its package installed."""
    for name in config.trainer.logger:
        package = _PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"trainer.logger includes {name!r} but the {package} package is not installed "
                f"(pip install {package}, or drop it from trainer.logger)"
            )


def check_sampling(config: RunConfig) -> None:
    """No sampling vLLM refuses at the first step: greedy decoding (temperature 0 or do_sample False)
    with more than one sample per prompt."""
    rollout = config.actor_rollout_ref.rollout
    for where, s in (
        ("actor_rollout_ref.rollout", rollout),
        ("actor_rollout_ref.rollout.val_kwargs", rollout.val_kwargs),
    ):
        greedy = s.temperature == 0 or not s.do_sample
        if greedy and s.n > 1:
            why = f"{where}.temperature=0" if s.temperature == 0 else f"{where}.do_sample=False"
            raise ValueError(
                f"{why} (greedy decoding) with {where}.n={s.n}: every sample of a prompt would be the same "
                f"(vLLM refuses n > 1 under greedy sampling); set {where}.temperature > 0 with "
                f"do_sample=True, or {where}.n=1"
            )


# ----------------------------------------------------------------------------- resuming
def _saved_config(path: Path) -> Optional[dict]:
    f = path / CONFIG_COPY
    if not f.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(f), resolve=False)


def _hf_shape(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text())
    return {ours: raw[hf] for hf, ours in _HF_SHAPE.items() if hf in raw}


def _model_shape(model: dict) -> Optional[dict]:
    """The shape of a saved or current ``model`` section: an inline config's, else its checkpoint's."""
    inline = model.get("config")
    if inline:
        shape = {k: inline.get(k) for k in _SHAPE}
        if shape.get("num_query_groups") is None:
            shape["num_query_groups"] = shape.get("num_attention_heads")
        return shape
    return _hf_shape(model.get("path"))


def _check_model(key: str, new: dict, saved: Optional[dict], state_path: Optional[str], path: Path) -> None:
    new_shape = _model_shape(new)
    old_shape = _model_shape(saved) if saved is not None else _hf_shape(state_path)
    if not new_shape or not old_shape:
        return
    for name in sorted(set(new_shape) & set(old_shape)):
        a, b = new_shape[name], old_shape[name]
        if name == "vocab_size" and new.get("config"):
            continue  # an inline model's vocabulary is the trained tokenizer's, <= config.vocab_size
        if a is not None and b is not None and a != b:
            where = f"{key}.config.{name}" if new.get("config") else f"{key}.path"
            raise ValueError(
                f"{where}: the model has {name}={a} but checkpoint {path} was trained with {name}={b}; a "
                f"checkpoint resumes only into the model it was saved from -- {_START_OVER}"
            )


def check_resume(config: RunConfig, run_dir: Path, needs: Any, *, log: Callable[[str], Any] = print) -> Selection:
    """The checkpoint to resume from, verified, and ``ValueError`` unless this configuration can
    resume it (the same model shape and data order, every part it trains present)."""
    tcfg = config.trainer
    choice = select_checkpoint(run_dir, tcfg.resume_mode, tcfg.resume_from_path, fallback=tcfg.resume_fallback)
    if choice.skipped:
        log(f"resume: {choice.describe()}")
    if choice.path is None:
        return choice
    path, state = choice.path, choice.state()
    saved = _saved_config(path)
    data = config.data
    _check_model(
        "actor_rollout_ref.model",
        config.actor_rollout_ref.model.to_dict(),
        None if saved is None else saved["actor_rollout_ref"]["model"],
        state.get("model_path"),
        path,
    )
    if needs.critic and not (path / "critic").is_dir():
        raise ValueError(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} trains a critic but checkpoint "
            f"{path} has none (it was saved by a run without one) -- {_START_OVER}"
        )
    loader = state.get("dataloader") or {}
    batch_key = "data.gen_batch_size" if data.gen_batch_size else "data.train_batch_size"
    current = {
        batch_key: (data.gen_batch_size or data.train_batch_size, loader.get("batch_size")),
        "data.shuffle": (data.shuffle, loader.get("shuffle")),
        "data.seed": (int(data.seed or 0), loader.get("seed")),
    }
    for key, (new, old) in current.items():
        if old is not None and new != old:
            raise ValueError(
                f"{key}={new} but checkpoint {path} was saved with {old}: resuming would replay a "
                f"different data order; set {key}={old} to resume -- or {_START_OVER}"
            )
    if saved is not None:
        for key in ("train_files", "task", "task_kwargs", "train_max_samples", "filter_overlong_prompts"):
            old, new = saved.get("data", {}).get(key), getattr(data, key)
            if old != new and not (key == "task_kwargs" and old is None and new == {}):
                raise ValueError(
                    f"data.{key}={new!r} but checkpoint {path} was trained with {old!r}: resuming would "
                    f"replay another dataset -- set it back to resume, or {_START_OVER}"
                )
        old_layout = saved["actor_rollout_ref"]["actor"].get("megatron", {})
        new_layout = config.actor_rollout_ref.actor.megatron
        changed = [
            f"{k} {old_layout.get(k)} -> {getattr(new_layout, k)}"
            for k in _LAYOUT
            if k in old_layout and old_layout[k] != getattr(new_layout, k)
        ]
        if changed:
            log(
                f"resume: actor layout changed ({', '.join(changed)}); the model and optimizer state reshard from "
                f"{path.name}, RNG states are restored only at the saving world size"
            )
    return choice
