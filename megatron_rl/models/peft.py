"""The Hugging Face PEFT adapter directory: names, ``adapter_config.json``, atomic writing (issue 29).

A LoRA adapter on disk, as ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` read it:
``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's names
(``base_model.model.<hf module>.lora_A.weight`` / ``lora_B.weight``). Pure file format (no Megatron,
no vLLM): the export gathers the tensors (``megatron_rl.engine.lora_peft``), the rollout loads them
(``megatron_rl.rollout.vllm_lora``), the actor starts from them (``engine.lora_peft.load_peft_adapter``;
``read_peft_adapter_config`` checks the directory before any worker starts).

Megatron's fused linears (``linear_qkv``, a gated ``linear_fc1``) hold one ``A`` for several HF modules
(q/k/v, gate/up); a compact adapter keeps that ``A`` once under the first module's name and lists the
others in ``shared`` (``expand_shared``), so a weight sync moves each tensor once.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

__all__ = [
    "ADAPTER_DIR_NAME",
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "PEFT_PREFIX",
    "peft_adapter_config",
    "expand_shared",
    "write_peft_adapter",
    "read_peft_adapter_config",
]

ADAPTER_DIR_NAME = "lora_adapter"
"""verl's name of the adapter directory inside an exported HF checkpoint."""
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModelForCausalLM`` puts before the HF module names in a saved adapter."""


def expand_shared(
    tensors: Mapping[str, torch.Tensor], shared: Mapping[str, tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    """A compact adapter made whole: every ``shared[name]`` entry gets ``tensors[name]`` (the same
    tensor object: they are only written)."""
    out = dict(tensors)
    for name, others in shared.items():
        if name not in out:
            raise ValueError(f"expand_shared: {name!r} is shared but not among the adapter's tensors")
        out.update({other: out[name] for other in others})
    return out


def peft_adapter_config(lora: Any, tensor_names, *, base_model_name_or_path: Optional[str] = None) -> dict:
    """PEFT's ``LoraConfig`` as JSON for adapters named ``tensor_names`` (``peft_adapter_tensors``'s keys).

    ``r`` / ``lora_alpha`` / ``lora_dropout`` are ``lora.rank`` / ``alpha`` / ``dropout`` (PEFT scales
    by ``lora_alpha / r`` too). ``target_modules`` are HF leaf names (``q_proj``, ...) when every module
    of that leaf has an adapter, else the full HF module names (``lora.exclude_modules`` left some out).
    """
    modules = sorted({n[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] for n in tensor_names})
    if not modules:
        raise ValueError("adapter export: no adapter tensors")
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules}) if not lora.exclude_modules else modules
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(lora.rank),
        "lora_alpha": float(lora.alpha),
        "lora_dropout": float(lora.dropout),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
    }


def write_peft_adapter(tensors: dict[str, torch.Tensor], config: dict, out_dir: str | Path) -> Path:
    """Write ``tensors`` and ``config`` as a PEFT adapter directory at ``out_dir``. Atomic: a temporary
    sibling directory is renamed into place; ``FileExistsError`` if ``out_dir`` exists."""
    from safetensors.torch import save_file

    final = Path(out_dir).resolve()
    if final.exists():
        raise FileExistsError(f"write_peft_adapter: {final} exists")
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        seen: set[int] = set()  # safetensors refuses two names on one storage (expand_shared's copies)
        unique = {}
        for n, t in sorted(tensors.items()):
            unique[n] = t.contiguous().clone() if id(t) in seen else t.contiguous()
            seen.add(id(t))
        save_file(unique, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_peft_adapter_config(
    adapter_dir: str | Path, lora: Any, key: str = "actor_rollout_ref.model.lora.adapter_path"
) -> dict:
    """``adapter_dir``'s ``adapter_config.json``, checked against ``lora`` (a ``LoRAConfig``) before anything
    is loaded: a LoRA adapter (``peft_type: LORA``) without DoRA, rsLoRA, biases or extra saved modules, whose
    ``r`` and ``lora_alpha`` are ``lora.rank`` / ``lora.alpha`` (the engine builds its adapters from those).
    ``FileNotFoundError`` / ``ValueError`` naming ``key`` and the mismatching fields."""
    path = Path(adapter_dir)
    for name in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"{key}={str(adapter_dir)!r}: {path / name} does not exist (a PEFT adapter "
                f"directory holds {ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME})"
            )
    try:
        config = json.loads((path / ADAPTER_CONFIG_NAME).read_text())
    except ValueError as exc:
        raise ValueError(f"{key}={str(adapter_dir)!r}: {ADAPTER_CONFIG_NAME} is not JSON: {exc}") from None
    wrong = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        wrong.append(f"peft_type={config.get('peft_type')!r} (only LORA is built)")
    for field, allowed in (
        ("use_dora", False),
        ("use_rslora", False),
        ("bias", "none"),
        ("modules_to_save", None),
        ("fan_in_fan_out", False),
    ):
        if config.get(field, allowed) not in (allowed, [] if allowed is None else allowed):
            wrong.append(f"{field}={config.get(field)!r} (allowed: {allowed!r})")
    if int(config.get("r", -1)) != lora.rank:
        wrong.append(f"r={config.get('r')!r} but actor_rollout_ref.model.lora.rank={lora.rank}")
    if float(config.get("lora_alpha", -1)) != float(lora.alpha):
        wrong.append(f"lora_alpha={config.get('lora_alpha')!r} but actor_rollout_ref.model.lora.alpha={lora.alpha}")
    if wrong:
        raise ValueError(
            f"{key}={str(adapter_dir)!r}: its {ADAPTER_CONFIG_NAME} does not match the LoRA settings: "
            + "; ".join(wrong)
        )
    return config
