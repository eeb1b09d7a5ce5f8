"""Multi-token-prediction (MTP) layers of DeepSeek-V3 / GLM-4.5 HF checkpoints, carried as side data.

Hub checkpoints of these families hold ``num_nextn_predict_layers`` MTP layers after the decoder:
``model.layers.{num_layers + i}.`` with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
optionally their own ``embed_tokens`` / ``shared_head.head``, and a full decoder block shaped like
the last decoder layer. The Megatron model does not build them (MTP training is not implemented),
so the loader checks they are complete and well-shaped and leaves them untouched; conversion and
the trainer's HF export carry them through bit for bit (``read_mtp_tensors`` / ``write_mtp_file``).
A checkpoint that declares MTP layers but holds none of their tensors (what transformers'
``save_pretrained`` writes) has nothing to carry.

Pipeline layouts: carried as side data, the MTP layers are never placed on a pipeline stage, so
conversion and training take every PP / VPP layout. What would place them is refused by
``check_mtp_layout`` before a model is built: Megatron-Core builds an MTP block (on the last stage,
with its own replica of the word embedding tied to the first stage's) only when
``mtp_num_layers`` is set, and a ``pipeline_model_parallel_layout`` may name MTP stages (``m``);
here neither has an MTP block to build, and both would break the model (Megatron would split the
last stage's hidden states for MTP layers that do not exist, cf. NeMo-RL#2471 for the shared
embedding it would also place on the last stage).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "MTPLayers",
    "MTP_FILE",
    "MTP_SHARD",
    "MTP_TRANSFORMER_FIELDS",
    "add_mtp_shard",
    "check_mtp_layout",
    "copy_mtp_tensors",
    "num_mtp_layers",
    "read_mtp_tensors",
    "source_mtp_tensors",
    "stream_tensors",
    "write_mtp_file",
]

MTP_FILE = "mtp/mtp.safetensors"
"""Where a Megatron checkpoint written by ``convert_hf_to_mcore`` keeps the MTP tensors."""
MTP_SHARD = "model-mtp.safetensors"
"""The safetensors file an HF export adds for the MTP tensors (listed in the index)."""

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_OWN_OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")


def num_mtp_layers(hf_dir: str | os.PathLike) -> int:
    """``num_nextn_predict_layers`` of ``hf_dir``'s config.json (0 when absent)."""
    config = Path(hf_dir) / "config.json"
    if not config.is_file():
        return 0
    value = json.loads(config.read_text()).get("num_nextn_predict_layers") or 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{config}: num_nextn_predict_layers={value!r} is not allowed; use an integer >= 0")
    return value


MTP_TRANSFORMER_FIELDS = ("mtp_num_layers", "mtp_loss_scaling_factor")
"""``TransformerConfig`` fields that build (or only act with) Megatron-Core's MTP block."""


def _layout_mtp_stages(layout) -> list[int]:
    """Stages (0-based, in order: pipeline x virtual) of a ``pipeline_model_parallel_layout`` -- a
    string (``"Et|tmL"``) or per-stage lists -- that hold an MTP layer (``m`` / ``"mtp"``)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    stages = PipelineParallelLayerLayout.parse_str_to_list(layout) if isinstance(layout, str) else layout
    if not isinstance(stages, (list, tuple)):
        return []
    return [
        i
        for i, stage in enumerate(stages)
        if any(
            t == LayerType.mtp or str(t) in ("m", "mtp")
            for t in (stage if isinstance(stage, (list, tuple)) else [stage])
        )
    ]


def check_mtp_layout(parallel, overrides=None, *, key: str = "megatron.override_transformer_config") -> None:
    """Refuse (ValueError naming the key, its value and what is allowed) a layout that would place
    MTP layers: ``overrides`` (``TransformerConfig`` fields, verl's ``megatron.override_transformer_config``)
    setting ``mtp_num_layers`` / ``mtp_loss_scaling_factor``, or a ``pipeline_model_parallel_layout``
    with MTP (``m``) stages. ``parallel`` (a ``ParallelConfig``) is named in the message. Every
    PP / VPP layout without them is allowed: the checkpoint's MTP layers are side data (module docstring)."""
    overrides = dict(overrides or {})
    pp = parallel.pipeline_model_parallel_size
    for name in MTP_TRANSFORMER_FIELDS:
        value = overrides.get(name)
        if value is not None and not (name == "mtp_num_layers" and value == 0):
            effect = (
                f"at pipeline_model_parallel_size={pp} Megatron-Core would expect the block and a replica of the "
                f"shared word embedding on the last stage and split that stage's hidden states for MTP layers "
                f"that have no weights"
                if name == "mtp_num_layers"
                else "it acts only on that block"
            )
            raise ValueError(
                f"{key}.{name}={value!r} is not allowed: the Megatron model builds no multi-token-prediction block "
                f"(MTP training, actor_rollout_ref.model.mtp.*, is not implemented; a checkpoint's MTP layers are "
                f"loaded, checked and exported as side data at any layout); {effect}. Allowed: leave {name} unset"
            )
    layout = overrides.get("pipeline_model_parallel_layout")
    stages = _layout_mtp_stages(layout) if layout is not None else []
    if stages:
        raise ValueError(
            f"{key}.pipeline_model_parallel_layout={layout!r} places MTP layers ('m') on pipeline stage(s) {stages} "
            f"of pipeline_model_parallel_size={pp}: the model builds no multi-token-prediction block, so no stage can "
            f"hold MTP layers or the word-embedding replica they share. Allowed: a layout of embedding ('E'), "
            f"decoder ('t') and loss ('L') stages only, or no pipeline_model_parallel_layout"
        )


@dataclasses.dataclass(frozen=True)
class MTPLayers:
    """Where a family's MTP layers sit and what shapes they must have (bound to one model)."""

    num_layers: int
    """Decoder layers: MTP layer ``i`` is ``model.layers.{num_layers + i}``."""
    hidden_size: int
    vocab_size: int

    def names(self, reader, count: int) -> list[str]:
        """The tensors of ``reader`` under the first ``count`` MTP layers."""
        layers = "|".join(str(self.num_layers + i) for i in range(count))
        if not layers:
            return []
        pattern = re.compile(rf"model\.layers\.(?:{layers})\..+")
        return sorted(n for n in reader.keys() if pattern.fullmatch(n))

    def check(self, reader, count: int) -> list[str]:
        """Errors (each naming the tensor) for incomplete or mis-shaped MTP layers; [] when the
        checkpoint holds none of them or all of them, as expected."""
        present = set(self.names(reader, count))
        if not present:
            return []
        template = f"model.layers.{self.num_layers - 1}."
        block = {n[len(template) :]: tuple(reader.shape(n)) for n in reader.keys() if n.startswith(template)}
        h, v = self.hidden_size, self.vocab_size
        own = {
            "enorm.weight": (h,),
            "hnorm.weight": (h,),
            "eh_proj.weight": (h, 2 * h),
            "shared_head.norm.weight": (h,),
        }
        optional = {"embed_tokens.weight": (v, h), "shared_head.head.weight": (v, h)}
        errors: list[str] = []
        for i in range(count):
            prefix = f"model.layers.{self.num_layers + i}."
            expected = {**block, **own}
            for suffix, shape in {**expected, **optional}.items():
                name = prefix + suffix
                if name not in present:
                    if suffix in expected:
                        errors.append(
                            f"MTP tensor {name!r} is missing (MTP layer {i} of num_nextn_predict_layers="
                            f"{count} needs it, shape {list(shape)})"
                        )
                    continue
                got = tuple(reader.shape(name))
                if got != shape:
                    errors.append(f"MTP tensor {name!r} has shape {list(got)} but {list(shape)} is expected")
            unknown = sorted(
                n
                for n in present
                if n.startswith(prefix) and n[len(prefix) :] not in expected and n[len(prefix) :] not in optional
            )
            errors.extend(
                f"MTP tensor {n!r} is not part of an MTP layer (the last decoder layer has no {n[len(prefix) :]!r})"
                for n in unknown
            )
        return errors


def stream_tensors(path: str | os.PathLike, infos: list, read: Callable[[str], torch.Tensor]) -> Path:
    """Write the tensors ``infos`` (``HFTensorInfo``s) to one safetensors file at ``path``, read one
    at a time by ``read(name)`` (one tensor in memory, not the whole MTP layer); atomic."""
    from parallel.bridge.hf_files import SafetensorsStreamWriter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        writer = SafetensorsStreamWriter(tmp, infos)
        try:
            for info in infos:
                writer.write(info.name, read(info.name))
        finally:
            writer.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def copy_mtp_tensors(reader, names: Sequence[str], path: str | os.PathLike) -> Path:
    """Stream the (checked) MTP tensors ``names`` of ``reader`` bit for bit into the safetensors
    file ``path`` (FP8 ones as the reader dequantises them)."""
    from parallel.bridge.hf_files import HFTensorInfo

    infos = [HFTensorInfo(n, tuple(reader.shape(n)), reader.dtype(n)) for n in sorted(names)]
    return stream_tensors(path, infos, reader.read)


def read_mtp_tensors(reader, mtp: Optional[MTPLayers], hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All MTP tensors of ``reader`` (checked first: ValueError naming each bad tensor)."""
    count = num_mtp_layers(hf_dir)
    if mtp is None or count == 0:
        return {}
    errors = mtp.check(reader, count)
    if errors:
        raise ValueError(f"{hf_dir}: bad multi-token-prediction layers: " + "; ".join(errors))
    return {n: reader.read(n) for n in mtp.names(reader, count)}


def write_mtp_file(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` as one safetensors file at ``path``, atomically (temporary + rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def add_mtp_shard(hf_dir: str | os.PathLike, source: str | os.PathLike | dict[str, torch.Tensor]) -> list[str]:
    """Add the MTP tensors ``source`` (a safetensors file, copied tensor by tensor, or a dict) to the
    HF checkpoint being written in ``hf_dir`` as ``MTP_SHARD``, listed in
    ``model.safetensors.index.json`` (written from the single ``model.safetensors`` if there is
    none); returns their names."""
    from safetensors import safe_open

    from parallel.bridge.hf_files import INDEX_FILE, SINGLE_FILE, ST_DTYPES, HFTensorInfo

    hf_dir = Path(hf_dir)
    if isinstance(source, dict):
        write_mtp_file(hf_dir / MTP_SHARD, source)
        infos = [HFTensorInfo(n, tuple(t.shape), t.dtype) for n, t in source.items()]
    else:
        dtypes = {v: k for k, v in ST_DTYPES.items()}
        with safe_open(str(source), "pt") as f:
            infos = [
                HFTensorInfo(n, tuple(f.get_slice(n).get_shape()), dtypes[f.get_slice(n).get_dtype()])
                for n in sorted(f.keys())
            ]
            stream_tensors(hf_dir / MTP_SHARD, infos, f.get_tensor)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
    else:
        with safe_open(str(hf_dir / SINGLE_FILE), "pt") as f:
            names = list(f.keys())
        # total_size: the file's size, an upper bound of its tensors' bytes (the header is included)
        data = {
            "metadata": {"total_size": os.path.getsize(hf_dir / SINGLE_FILE)},
            "weight_map": {n: SINGLE_FILE for n in names},
        }
    clash = sorted({i.name for i in infos} & set(data["weight_map"]))
    if clash:
        raise ValueError(f"{hf_dir}: MTP tensors {clash[:5]} are already in the exported model")
    data["weight_map"].update({i.name: MTP_SHARD for i in infos})
    if "total_size" in data.get("metadata", {}):
        data["metadata"]["total_size"] += sum(i.nbytes for i in infos)
    tmp = index.parent / f".{index.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, index)
    return [i.name for i in infos]


def source_mtp_tensors(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The MTP tensors of the HF checkpoint ``hf_dir`` (checked; FP8 ones dequantised), read by its
    config.json alone (``num_hidden_layers``, ``num_nextn_predict_layers``); {} when it has none
    (or no safetensors at all)."""
    from parallel.bridge.fp8 import open_dequantizing
    from parallel.bridge.hf_files import INDEX_FILE, SINGLE_FILE, HFCheckpointReader

    count = num_mtp_layers(hf_dir)
    if not count or not any((Path(hf_dir) / f).is_file() for f in (INDEX_FILE, SINGLE_FILE)):
        return {}
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    mtp = MTPLayers(int(config["num_hidden_layers"]), int(config["hidden_size"]), int(config["vocab_size"]))
    with open_dequantizing(HFCheckpointReader(hf_dir), hf_dir) as reader:
        return read_mtp_tensors(reader, mtp, hf_dir)
