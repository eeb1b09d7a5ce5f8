"""PEFT export of a LoRA actor's adapters (issue 29): the Hugging Face PEFT adapter directory.

The trained adapters are written as ``adapter_config.json`` + ``adapter_model.safetensors`` with
PEFT's names (``base_model.model.<hf module>.lora_A.weight`` / ``lora_B.weight``), so
``peft.PeftModel.from_pretrained(hf_base, adapter_dir)`` gives the actor's model. verl's model merger
writes the same directory as ``<hf dir>/lora_adapter`` (``ADAPTER_DIR_NAME``).

Megatron fuses what HF keeps apart: ``linear_qkv`` is HF's ``q_proj``/``k_proj``/``v_proj`` (rows
grouped by query group) and a gated ``linear_fc1`` is ``gate_proj``/``up_proj``. ``B A`` adds to the
weight row by row, so each HF module's adapter is the same ``A`` with that module's rows of ``B``:
``B`` goes through the family's own row transform (``qkv`` / ``gate_up``) exactly as the base weight
does, and ``A`` is copied to every part. The gathering over TP / PP / EP is the bridge's
(``parallel.bridge.HFExporter``) on a weight map derived from the family's (``adapter_weight_map``),
so there is one mapping and one gather, tested once.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["PeftExportUnsupported", "ADAPTER_DIR_NAME", "ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "adapter_weight_map",
           "peft_adapter_tensors", "peft_adapter_config", "write_peft_adapter"]

ADAPTER_DIR_NAME = "lora_adapter"
"""verl's name of the adapter directory inside an exported HF checkpoint."""
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModelForCausalLM`` puts before the HF module names in a saved adapter."""
_TARGET_SUFFIXES = tuple(f".{leaf}.weight" for leaf in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
_NOT_ADAPTER = r"(?!.*\.lora_[AB]\Z)"
"""Matches (at the start) every parameter name that is not an adapter: the bridge leaves those out."""


class PeftExportUnsupported(ValueError):
    """The model's adapters have no PEFT form here (adapters inside MoE experts)."""


def _module(hf_weight: str) -> str:
    if not hf_weight.endswith(".weight"):
        raise ValueError(f"adapter export: HF tensor {hf_weight!r} is not a linear's weight")
    return hf_weight[: -len(".weight")]


def adapter_weight_map(weight_map: Any) -> tuple[Any, dict[str, Any]]:
    """The family's ``WeightMap`` turned into one for the adapters, and the copies ``A`` needs.

    For every rule of a LoRA target's weight (``...linear_qkv.weight`` etc.): ``...lora_B`` gets the
    weight's transform with PEFT's ``lora_B`` names; ``...lora_A`` is a plain copy under the first HF
    module's ``lora_A`` name. The second value maps a fused target's ``lora_A`` rule name to a rule
    whose HF names are every part's ``lora_A`` (q, k, v; gate, up): the first is exported, the
    others hold copies of it.
    """
    from parallel.bridge.rules import WeightRule

    rules, copies = [], {}
    for rule in weight_map.rules:
        if not rule.megatron.endswith(_TARGET_SUFFIXES):
            continue
        stem = rule.megatron[: -len(".weight")]
        modules = [PEFT_PREFIX + _module(name) for name in rule.hf]
        rules.append(WeightRule(f"{stem}.lora_B", tuple(f"{m}.lora_B.weight" for m in modules), rule.transform))
        rules.append(WeightRule(f"{stem}.lora_A", f"{modules[0]}.lora_A.weight"))
        if len(modules) > 1:
            copies[f"{stem}.lora_A"] = WeightRule(f"{stem}.lora_A", tuple(f"{m}.lora_A.weight" for m in modules),
                                                  rule.transform)
    if not rules:
        raise ValueError("adapter export: the weight map has no rule for a LoRA target "
                         f"({[s.lstrip('.') for s in _TARGET_SUFFIXES]})")
    return dataclasses.replace(weight_map, rules=tuple(rules), optional_hf=(), unsupported_hf=(), mtp=None), copies


def peft_adapter_tensors(chunks, weight_map: Any, *, mesh=None, bucket_bytes: int,
                         dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Collective over the model's ranks: every adapter of ``chunks`` under PEFT's names, whole
    (gathered over TP / PP / EP by the bridge) on global rank 0; an empty dict on the others.

    ``PeftExportUnsupported`` (a ``ValueError``, raised on every rank) for adapters inside MoE experts
    (their PEFT form is not built); ``ValueError`` for a model without adapters.
    """
    from parallel.bridge import HFExporter

    adapter_map, copies = adapter_weight_map(weight_map)
    exporter = HFExporter(chunks, adapter_map, mesh=mesh, dtype=dtype, ignore=(_NOT_ADAPTER,))
    experts = [item.global_name for item in exporter.items if item.rule.is_expert]
    if experts:
        raise PeftExportUnsupported(f"adapter export: adapters inside MoE experts ({experts[0]}, ...) have no PEFT export "
                         "yet; leave the experts out (lora.exclude_modules: [experts]) to export the others")
    if not exporter.items:
        raise ValueError("adapter export: the model has no LoRA adapters (lora.rank: 0)")
    out = {name: t.detach().clone() for name, t in exporter.iter_weights(bucket_bytes=bucket_bytes, all_ranks=False)}
    for item in exporter.items:
        if item.rule.megatron in copies:
            first, *others = copies[item.rule.megatron].match(item.global_name)
            out.update({other: out[first].clone() for other in others} if out else {})
    return out


def peft_adapter_config(lora: Any, tensor_names, *, base_model_name_or_path: Optional[str] = None) -> dict:
    """PEFT's ``LoraConfig`` as JSON for adapters named ``tensor_names`` (``peft_adapter_tensors``'s keys).

    ``r`` / ``lora_alpha`` / ``lora_dropout`` are ``lora.rank`` / ``alpha`` / ``dropout`` (PEFT scales
    by ``lora_alpha / r`` too). ``target_modules`` are HF leaf names (``q_proj``, ...) when every module
    of that leaf has an adapter, else the full HF module names (``lora.exclude_modules`` left some out).
    """
    modules = sorted({n[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0] for n in tensor_names})
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
        save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, str(tmp / ADAPTER_WEIGHTS_NAME),
                  metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
