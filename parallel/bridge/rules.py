"""What a model family declares (``WeightRule``, ``WeightMap``) and how Megatron shards it.

Parameter names are made layout-independent (global layer and expert numbers) by
``global_param_name``; ``resolve_params`` pairs each local parameter with its rule, HF names and
TP shard coordinates; ``full_hf_shapes``, ``qkv_runs`` and ``shard_runs`` describe where the rows
of a TP shard sit in the HF tensors, for loading and exporting alike.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.bridge.mtp import MTPLayers


_TRANSFORM_ARITY = {"copy": 1, "vocab": 1, "qkv": 3, "gate_up": 2}
_FIELDS = ("layer", "expert")


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter <-> HF tensor(s).

    ``megatron`` and ``hf`` may use ``{layer}`` (global, 0-based) and ``{expert}`` (global
    expert index); ``export=False`` marks a copy that is loaded but not exported (the output
    layer of a tied-embedding model on the last pipeline stage).
    """

    megatron: str
    hf: tuple[str, ...]
    transform: str = "copy"
    export: bool = True
    _regex: re.Pattern = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))
        object.__setattr__(self, "hf", tuple(self.hf))
        if self.transform not in _TRANSFORM_ARITY:
            raise ValueError(
                f"WeightRule {self.megatron!r}: transform={self.transform!r} is not allowed; "
                f"choose one of {sorted(_TRANSFORM_ARITY)}"
            )
        if len(self.hf) != _TRANSFORM_ARITY[self.transform]:
            raise ValueError(
                f"WeightRule {self.megatron!r}: transform {self.transform!r} takes "
                f"{_TRANSFORM_ARITY[self.transform]} HF names, got {list(self.hf)}"
            )
        fields = set(re.findall(r"\{(\w+)\}", self.megatron))
        for name in self.hf:
            extra = set(re.findall(r"\{(\w+)\}", name)) - fields
            if extra or not fields <= set(_FIELDS):
                raise ValueError(
                    f"WeightRule {self.megatron!r} -> {name!r}: placeholders must be among "
                    f"{list(_FIELDS)} and appear in the Megatron name"
                )
        pattern = re.escape(self.megatron)
        for field in _FIELDS:
            pattern = pattern.replace(re.escape("{" + field + "}"), f"(?P<{field}>\\d+)")
        object.__setattr__(self, "_regex", re.compile(pattern + r"\Z"))

    @property
    def is_expert(self) -> bool:
        """Expert parameters are split over the expert-tensor-parallel group, not TP."""
        return "{expert}" in self.megatron

    def match(self, global_name: str) -> Optional[tuple[str, ...]]:
        """The HF names for ``global_name``, or None if this rule does not cover it."""
        m = self._regex.match(global_name)
        if m is None:
            return None
        fields = {k: int(v) for k, v in m.groupdict().items()}
        return tuple(name.format(**fields) for name in self.hf)


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """A family's weight rules bound to one model's geometry (what the transforms need)."""

    rules: tuple[WeightRule, ...]
    vocab_size: int
    """Unpadded vocabulary: HF embedding rows."""
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    optional_hf: tuple[str, ...] = ()
    """Regexes of HF tensors a checkpoint may hold that are not loaded (e.g. ``lm_head.weight``
    of a tied-embedding model); any other unknown HF tensor is an error."""
    unsupported_hf: tuple[tuple[str, str], ...] = ()
    """``(regex, reason)`` of HF tensors a real checkpoint holds that this model cannot (e.g.
    DeepSeek-V3's multi-token-prediction layers): loading refuses them with the reason."""
    mtp: Optional[MTPLayers] = None
    """Where the family's hub checkpoints keep multi-token-prediction layers
    (``model.layers.{num_layers + i}``, ``i < num_nextn_predict_layers``): the loader checks them
    and leaves them out of the model; conversion carries them through (``parallel.bridge.mtp``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        seen = [r.megatron for r in self.rules]
        dupes = sorted({m for m in seen if seen.count(m) > 1})
        if dupes:
            raise ValueError(f"WeightMap: Megatron names with more than one rule: {dupes}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"WeightMap: num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.num_query_groups}"
            )

    def resolve(self, global_name: str) -> tuple[WeightRule, tuple[str, ...]]:
        """The rule and HF names for a global Megatron parameter name."""
        for rule in self.rules:
            names = rule.match(global_name)
            if names is not None:
                return rule, names
        raise ValueError(
            f"Megatron parameter {global_name!r} has no rule in the weight map; "
            f"rules cover: {[r.megatron for r in self.rules]}"
        )

    def is_optional(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.optional_hf)

    def unsupported_reason(self, hf_name: str) -> Optional[str]:
        """Why this model cannot hold ``hf_name`` (an ``unsupported_hf`` match), else None."""
        return next((why for p, why in self.unsupported_hf if re.fullmatch(p, hf_name)), None)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)\Z")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)\Z")


_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)\Z")  # TEGroupedMLP


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_param_name(chunk: torch.nn.Module, local_name: str) -> str:
    """The layout-independent name of a parameter of an (unwrapped) GPTModel chunk.

    Layer indices become global 0-based layer numbers (PP/VPP offset from ``layer_number``),
    local expert indices become global expert indices (EP offset from ``local_expert_indices``),
    and TE's grouped-expert names (``experts.linear_fc1.weight3``) take the sequential form
    (``experts.local_experts.3.linear_fc1.weight``).
    """
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    layer = chunk.decoder.layers[int(m.group(1))]
    rest = m.group(2)
    e = _LOCAL_EXPERT.match(rest)
    if e is not None:
        rest = f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(e.group(1))]}.{e.group(2)}"
    g = _GROUPED_EXPERT.match(rest)
    if g is not None:
        expert = layer.mlp.local_expert_indices[int(g.group(3))]
        rest = f"mlp.experts.local_experts.{expert}.{g.group(1)}.{g.group(2)}"
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"


@dataclasses.dataclass
class ParamShard:
    """One local parameter: its global name, rule, HF names and TP shard coordinates."""

    global_name: str
    rule: WeightRule
    hf_names: tuple[str, ...]
    tensor: torch.Tensor
    shard: int
    num_shards: int
    partition_dim: Optional[int]


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _tp_groups(mesh) -> tuple[Any, Any]:
    """(tensor-parallel group, expert-tensor-parallel group) from ``mesh`` or Megatron's state."""
    if mesh is not None:
        return mesh.tp_group, mesh.etp_group
    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    return None, None


def resolve_params(chunks, weight_map: WeightMap, mesh, ignore: Sequence[str]) -> tuple[list[ParamShard], list[str]]:
    """This rank's parameters with rules and shard coordinates; plus the HF names of the ones
    ``ignore`` (regexes matched at the start of global names) leaves out.

    Buffers a rule matches (Megatron's router ``expert_bias``) are included like parameters.
    TP-split parameters carry Megatron's ``tensor_model_parallel``/``partition_dim``
    attributes; expert parameters are split over the expert-tensor-parallel group.
    """
    tp_group, etp_group = _tp_groups(mesh)
    params, ignored_hf, errors = [], [], []
    for chunk in chunks:
        chunk = _unwrap(chunk)
        # Buffers count only where a rule names them (a router's expert bias): the others are
        # derived state (RoPE tables, token counters).
        tensors = [(n, p, False) for n, p in chunk.named_parameters()] + [
            (n, b, True) for n, b in chunk.named_buffers()
        ]
        for local_name, p, is_buffer in tensors:
            name = global_param_name(chunk, local_name)
            skip = any(re.match(pat, name) for pat in ignore)
            try:
                rule, hf_names = weight_map.resolve(name)
            except ValueError as exc:
                if not skip and not is_buffer:
                    errors.append(str(exc))
                continue
            if skip:
                ignored_hf.extend(hf_names)
                continue
            if getattr(p, "tensor_model_parallel", False):
                group = etp_group if rule.is_expert else tp_group
                shard, num, dim = _rank(group), _size(group), int(p.partition_dim)
            else:
                shard, num, dim = 0, 1, None
            params.append(ParamShard(name, rule, hf_names, p, shard, num, dim))
    if errors:
        raise ValueError("; ".join(errors))
    return params, ignored_hf


def full_hf_shapes(
    rule: WeightRule, num_shards: int, partition_dim: Optional[int], local_shape: Sequence[int], wm: WeightMap
) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors a parameter with this local shard shape corresponds to."""
    full = list(local_shape)
    if partition_dim is not None:
        full[partition_dim] *= num_shards
    rest = full[1:]
    if rule.transform == "copy":
        return [tuple(full)]
    if rule.transform == "vocab":
        # Padding only adds rows: a parameter with fewer rows than the vocabulary cannot hold it.
        return [(wm.vocab_size if full[0] >= wm.vocab_size else full[0], *rest)]
    if rule.transform == "qkv":
        q_rows = wm.num_attention_heads * wm.head_dim
        kv_rows = wm.num_query_groups * wm.head_dim
        if full[0] != q_rows + 2 * kv_rows:
            raise ValueError(
                f"{rule.megatron}: the model's QKV projection has {full[0]} rows, the weight map's "
                f"geometry ({wm.num_attention_heads} heads, {wm.num_query_groups} groups, head_dim "
                f"{wm.head_dim}) gives {q_rows + 2 * kv_rows}; build the weight map from this model's "
                f"config"
            )
        return [(q_rows, *rest), (kv_rows, *rest), (kv_rows, *rest)]
    return [(full[0] // 2, *rest)] * 2  # gate_up


def qkv_runs(start: int, stop: int, wm: WeightMap) -> Iterator[tuple[int, int, int, int]]:
    """Rows [start, stop) of the grouped QKV layout as runs ``(which, hf_row, row, length)``.

    ``which`` is 0/1/2 for q/k/v; ``hf_row`` the first row in that HF tensor; ``row`` the first
    row in the grouped layout. A TP shard holds whole query groups, or a part of one group when
    TP exceeds the number of groups (Megatron allows both).
    """
    d = wm.head_dim
    q_per_group = wm.num_attention_heads // wm.num_query_groups * d
    per_group = q_per_group + 2 * d
    group = start // per_group
    while group * per_group < stop:
        base = group * per_group
        for which, offset, length, hf_base in (
            (0, 0, q_per_group, group * q_per_group),
            (1, q_per_group, d, group * d),
            (2, q_per_group + d, d, group * d),
        ):
            lo, hi = max(start, base + offset), min(stop, base + offset + length)
            if lo < hi:
                yield which, hf_base + lo - base - offset, lo, hi - lo
        group += 1


@dataclasses.dataclass(frozen=True)
class Run:
    """Rows [src_a, src_b) of one TP shard and where they land in the HF output tensors."""

    src_a: int
    src_b: int
    which: int
    dst_row: int
    cols: Optional[tuple[int, int]] = None

    def dest(self, outs: list[torch.Tensor], a: int, b: int) -> torch.Tensor:
        view = outs[self.which][self.dst_row + a - self.src_a : self.dst_row + b - self.src_a]
        return view if self.cols is None else view[:, self.cols[0] : self.cols[1]]


def shard_runs(transform: str, partition_dim: Optional[int], shape: Sequence[int], k: int, wm: WeightMap) -> list[Run]:
    """How TP shard ``k`` (local ``shape``) of a parameter maps onto its HF tensors, as row runs."""
    t, rows = transform, shape[0]
    if t == "copy":
        if partition_dim == 1:
            return [Run(0, rows, 0, 0, (k * shape[1], (k + 1) * shape[1]))]
        return [Run(0, rows, 0, k * rows)]
    if t == "vocab":
        stop = min(rows, wm.vocab_size - k * rows)
        return [Run(0, stop, 0, k * rows)] if stop > 0 else []
    if t == "gate_up":
        half = rows // 2
        return [Run(0, half, 0, k * half), Run(half, rows, 1, k * half)]
    return [
        Run(row - k * rows, row - k * rows + length, which, hf_row)
        for which, hf_row, row, length in qkv_runs(k * rows, (k + 1) * rows, wm)
    ]


def check_layout(
    parallel_config: Any, world_size: int, model_config: Any, transformer_overrides: Optional[Mapping[str, Any]] = None
) -> dict[str, Optional[int]]:
    """Check that ``parallel_config`` (a ``ParallelConfig`` or mapping) fits ``model_config``
    (``num_layers``, ``num_attention_heads``, ``num_query_groups``, ``num_moe_experts``) on
    ``world_size`` ranks, with an uneven pipeline split from ``transformer_overrides``
    (``num_layers_in_first/last_pipeline_stage``); returns the group sizes, raises ``ValueError``
    naming the numbers."""
    from parallel.config import ParallelConfig, uneven_pipeline_fields

    return ParallelConfig.from_dict(parallel_config).validate(
        world_size,
        num_layers=model_config.num_layers,
        num_attention_heads=model_config.num_attention_heads,
        num_query_groups=model_config.num_query_groups or model_config.num_attention_heads,
        num_experts=getattr(model_config, "num_moe_experts", None),
        **uneven_pipeline_fields(transformer_overrides),
    )
