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

``load_peft_adapter`` is the way back (verl's ``lora.adapter_path``): a PEFT adapter directory (this
export's, or ``peft``'s with the same structure) into the actor's ``lora_A``/``lora_B``, through the
bridge's loader on the same adapter weight map, every rank reading only its shards. A fused target's
``A`` must be one tensor for all its HF modules (q/k/v; gate/up), as Megatron holds one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron_rl.models.peft import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_DIR_NAME,
    ADAPTER_WEIGHTS_NAME,
    PEFT_PREFIX,
    expand_shared,
    peft_adapter_config,
    read_peft_adapter_config,
    write_peft_adapter,
)

__all__ = [
    "PeftExportUnsupported",
    "ADAPTER_DIR_NAME",
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "adapter_weight_map",
    "peft_adapter_parts",
    "peft_adapter_tensors",
    "peft_adapter_config",
    "expand_shared",
    "write_peft_adapter",
    "load_peft_adapter",
]

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
            copies[f"{stem}.lora_A"] = WeightRule(
                f"{stem}.lora_A", tuple(f"{m}.lora_A.weight" for m in modules), rule.transform
            )
    if not rules:
        raise ValueError(
            "adapter export: the weight map has no rule for a LoRA target "
            f"({[s.lstrip('.') for s in _TARGET_SUFFIXES]})"
        )
    return dataclasses.replace(weight_map, rules=tuple(rules), optional_hf=(), unsupported_hf=(), mtp=None), copies


def peft_adapter_parts(
    chunks, weight_map: Any, *, mesh=None, bucket_bytes: int, dtype: Optional[torch.dtype] = None
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]]]:
    """Collective over the model's ranks: the compact adapter on global rank 0 -- every adapter of
    ``chunks`` once under PEFT's names, whole (gathered over TP / PP / EP by the bridge), and
    ``shared`` (a fused target's ``A`` name -> the other HF modules' ``A`` names, which hold the same
    tensor; ``megatron_rl.models.peft.expand_shared``); empty dicts on the other ranks.

    ``PeftExportUnsupported`` (a ``ValueError``, raised on every rank) for adapters inside MoE experts
    (their PEFT form is not built); ``ValueError`` for a model without adapters.
    """
    from parallel.bridge import HFExporter

    adapter_map, copies = adapter_weight_map(weight_map)
    exporter = HFExporter(chunks, adapter_map, mesh=mesh, dtype=dtype, ignore=(_NOT_ADAPTER,))
    experts = [item.global_name for item in exporter.items if item.rule.is_expert]
    if experts:
        raise PeftExportUnsupported(
            f"adapter export: adapters inside MoE experts ({experts[0]}, ...) have no PEFT "
            "export yet; leave the experts out (lora.exclude_modules: [experts]) to export "
            "the others"
        )
    if not exporter.items:
        raise ValueError("adapter export: the model has no LoRA adapters (lora.rank: 0)")
    out = {name: t.detach().clone() for name, t in exporter.iter_weights(bucket_bytes=bucket_bytes, all_ranks=False)}
    shared = {}
    if out:
        for item in exporter.items:
            if item.rule.megatron in copies:
                first, *others = copies[item.rule.megatron].match(item.global_name)
                shared[first] = tuple(others)
    return out, shared


def peft_adapter_tensors(
    chunks, weight_map: Any, *, mesh=None, bucket_bytes: int, dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """``peft_adapter_parts`` made whole (``expand_shared``: each HF module's ``A`` its own copy):
    what PEFT's ``adapter_model.safetensors`` holds, on global rank 0; an empty dict elsewhere."""
    tensors, shared = peft_adapter_parts(chunks, weight_map, mesh=mesh, bucket_bytes=bucket_bytes, dtype=dtype)
    return {name: t.clone() for name, t in expand_shared(tensors, shared).items()}


def _template_regex(template: str):
    import re

    pattern = re.escape(template)
    for field in ("layer", "expert"):
        pattern = pattern.replace(re.escape("{" + field + "}"), f"(?P<{field}>\\d+)")
    return re.compile(pattern + r"\Z")


def load_peft_adapter(
    chunks,
    weight_map: Any,
    adapter_dir,
    lora: Any,
    *,
    mesh=None,
    key: str = "actor_rollout_ref.model.lora.adapter_path",
):
    """Collective over the model's ranks: load the PEFT adapter directory ``adapter_dir`` into ``chunks``'
    LoRA adapters (``lora``: the ``LoRAConfig`` they were built with; its ``rank`` / ``alpha`` must be the
    adapter's). Returns the bridge's ``LoadReport``.

    ``ValueError`` (every rank alike, naming ``key``) for a config that does not match, a fused target whose
    HF modules carry different ``A`` tensors, adapter tensors no adapter of the model takes (other targets)
    and adapters of the model the directory lacks; ``PeftExportUnsupported`` for adapters in MoE experts.
    """
    import shutil
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from parallel.bridge import HFExporter, load_hf_checkpoint

    read_peft_adapter_config(adapter_dir, lora, key)
    adapter_map, copies = adapter_weight_map(weight_map)
    experts = [
        item.global_name
        for item in HFExporter(chunks, adapter_map, mesh=mesh, ignore=(_NOT_ADAPTER,)).items
        if item.rule.is_expert
    ]
    if experts:
        raise PeftExportUnsupported(
            f"{key}: adapters inside MoE experts ({experts[0]}, ...) have no PEFT form yet; "
            "leave the experts out (lora.exclude_modules: [experts])"
        )
    tensors = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS_NAME))
    for rule in copies.values():  # a fused target's A: one tensor under each HF module's name, kept once
        first, *others = rule.hf
        regex = _template_regex(first)
        for name in [n for n in tensors if regex.match(n)]:
            fields = {k: int(v) for k, v in regex.match(name).groupdict().items()}
            for other in (o.format(**fields) for o in others):
                if other in tensors and not torch.equal(tensors.pop(other), tensors[name]):
                    raise ValueError(
                        f"{key}={str(adapter_dir)!r}: {other} differs from {name}; Megatron's fused "
                        f"{rule.megatron.rsplit('.', 2)[-2]} holds one A for all its HF modules (an "
                        "adapter whose q/k/v or gate/up A differ cannot be loaded into it)"
                    )
    staging = Path(tempfile.mkdtemp(prefix="peft_adapter_"))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        try:
            return load_hf_checkpoint(chunks, adapter_map, staging, mesh=mesh, ignore=(_NOT_ADAPTER,))
        except ValueError as exc:  # name the user's file, not the staging copy
            message = str(exc).replace(str(staging / "model.safetensors"), ADAPTER_WEIGHTS_NAME)
            raise ValueError(
                f"{key}={str(adapter_dir)!r}: {message.replace(str(staging), ADAPTER_WEIGHTS_NAME)}"
            ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
