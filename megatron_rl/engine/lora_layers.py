"""LoRA adapters on Megatron-Core's tensor-parallel linears (issue 29, layer 1).

Megatron-Core 0.16.1 ships no PEFT module, so this is a small one. ``y = W x + scale * B (A x)``
with ``scale = alpha / rank`` and the layout of the base linear respected:

- column-parallel (``linear_qkv``, ``linear_fc1``): ``B`` is split like the output
  (``[out/tp, r]``), ``A`` is whole (``[r, in]``). Under sequence parallelism the input is
  gathered along the sequence first, as the base linear does.
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` is split like the input (``[r, in/tp]``),
  ``B`` is whole (``[out, r]``); ``A x`` is summed over TP (reduce-scattered along the sequence
  under sequence parallelism) before ``B``.

A replicated adapter weight whose gradient is only a partial sum on each TP rank (``A`` of a
column-parallel linear; ``B`` of a row-parallel linear under sequence parallelism) has its
gradient all-reduced over TP by a hook, so every TP rank holds the full gradient and the update
equals the single-rank one. Base weights get ``requires_grad=False``; only the adapters reach
the optimizer. Initialisation follows verl 0.9.1's defaults (``lora_A_init_method: xavier``,
``lora_B_init_method: zero``) and is drawn on the full shape from a seeded generator and then
sharded, so every layout starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
ROW_TARGETS = ("linear_proj", "linear_fc2")
TARGET_MODULES = COLUMN_TARGETS + ROW_TARGETS
INIT_METHODS = ("xavier", "normal", "kaiming", "zero")


@dataclass(frozen=True)
class LoRASettings:
    """The adapter settings one linear needs (the ``model.lora`` config maps onto this)."""

    rank: int
    """Adapter rank r (> 0)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input (``dropout_position: pre``) or output (``post``)."""
    dropout_position: str = "pre"
    """``pre``: dropout on x before A; ``post``: dropout on the adapter's output."""
    lora_A_init_method: str = "xavier"
    """Initialisation of A: one of ``INIT_METHODS``."""
    lora_B_init_method: str = "zero"
    """Initialisation of B: one of ``INIT_METHODS``."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora.rank: {self.rank!r} is not allowed; a positive integer")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: {self.dropout!r} is not allowed; 0 <= dropout < 1")
        if self.dropout_position not in ("pre", "post"):
            raise ValueError(f"lora.dropout_position: {self.dropout_position!r} is not allowed; pre or post")
        for name in ("lora_A_init_method", "lora_B_init_method"):
            if getattr(self, name) not in INIT_METHODS:
                raise ValueError(f"lora.{name}: {getattr(self, name)!r} is not allowed; one of {INIT_METHODS}")

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``B A x``."""
        return self.alpha / self.rank


def _init_full(shape: tuple[int, int], method: str, generator: torch.Generator) -> torch.Tensor:
    """The full (unsharded) adapter weight, drawn on CPU in float32 so every layout draws the same."""
    w = torch.empty(shape, dtype=torch.float32)
    if method == "zero":
        return w.zero_()
    if method == "xavier":
        bound = (6.0 / (shape[0] + shape[1])) ** 0.5
        return w.uniform_(-bound, bound, generator=generator)
    if method == "kaiming":
        bound = (1.0 / shape[1]) ** 0.5  # kaiming_uniform with a = sqrt(5), as torch.nn.Linear
        return w.uniform_(-bound, bound, generator=generator)
    return w.normal_(0.0, 0.02, generator=generator)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group`` (for a weight replicated
    over TP whose per-rank gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, weight, group):  # noqa: D102
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LoRALinear(nn.Module):
    """A Megatron ``ColumnParallelLinear``/``RowParallelLinear`` plus a layout-aware LoRA adapter.

    Same call and return as the base (``(output, bias)``), so it replaces the base in place.
    """

    def __init__(
        self,
        base: nn.Module,
        parallel_mode: str,
        settings: LoRASettings,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        seed: int = 0,
        dtype: Optional[torch.dtype] = None,
        gated: bool = False,
    ) -> None:
        super().__init__()
        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode: {parallel_mode!r} is not allowed; column or row")
        # The base is held outside the module tree and its own parameters (``weight``, ``bias``,
        # a fused ``layer_norm_weight``) are registered here under their names, so the wrapped
        # model's parameter names are the base model's plus ``lora_A``/``lora_B``: the bridge's
        # HF table (load, export, weight sync) keeps working unchanged.
        if type(base).__name__.startswith("TE") or not hasattr(base, "input_size"):
            # TE's LayerNormColumnParallelLinear normalises inside the linear: an adapter beside it would
            # see the un-normalised input. Not built yet (GPU, TE spec).
            raise ValueError(
                f"LoRA on {type(base).__name__} (TransformerEngine layer spec) is not built; "
                "LoRA needs Megatron's local linears (model.attention_backend: sdpa or local)"
            )
        if any(True for _ in base.buffers()):
            raise ValueError(f"{type(base).__name__} has buffers; LoRA wraps buffer-free linears only")
        object.__setattr__(self, "_base", base)
        for pname, param in base.named_parameters(recurse=False):
            self.register_parameter(pname, param)
        self.parallel_mode, self.settings = parallel_mode, settings
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
        self.tp_rank = dist.get_rank(tp_group) if self.tp_size > 1 else 0
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        for p in base.parameters():
            p.requires_grad_(False)
        in_full, out_full = base.input_size, base.output_size
        r = settings.rank
        if r > min(in_full, out_full):
            raise ValueError(f"lora.rank: {r} is larger than the target's dimensions ({out_full} x {in_full})")
        gen = torch.Generator().manual_seed(seed)
        a_full = _init_full((r, in_full), settings.lora_A_init_method, gen)
        b_full = _init_full((out_full, r), settings.lora_B_init_method, gen)
        # A gated MLP's linear_fc1 (SwiGLU) holds [gate; up] on every TP rank: B's rows split the same way.
        self.gated = gated and parallel_mode == "column"
        if self.gated:
            b_full = torch.cat([half.chunk(self.tp_size, dim=0)[self.tp_rank] for half in b_full.chunk(2, dim=0)])
        elif parallel_mode == "column":
            b_full = b_full.chunk(self.tp_size, dim=0)[self.tp_rank]
        else:
            a_full = a_full.chunk(self.tp_size, dim=1)[self.tp_rank]
        dtype = dtype or base.weight.dtype
        device = base.weight.device
        self.lora_A = nn.Parameter(a_full.to(device=device, dtype=dtype).contiguous())  # [r, in] or [r, in/tp]
        self.lora_B = nn.Parameter(b_full.to(device=device, dtype=dtype).contiguous())  # [out/tp, r] or [out, r]
        # Megatron DDP/optimizer read these: the split dim marks a TP-sharded weight.
        self.lora_A.tensor_model_parallel = parallel_mode == "row"
        self.lora_A.partition_dim = 1 if parallel_mode == "row" else -1
        self.lora_B.tensor_model_parallel = parallel_mode == "column"
        self.lora_B.partition_dim = 0 if parallel_mode == "column" else -1
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.enabled = True

    @property
    def base(self) -> nn.Module:
        """The wrapped Megatron linear (not a submodule: its parameters are this module's)."""
        return self._base

    def _reduced(self, weight: torch.Tensor, partial: bool) -> torch.Tensor:
        return _AllReduceGrad.apply(weight, self.tp_group) if partial and self.tp_size > 1 else weight

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A x`` in the base output's layout (sharded like the base's output)."""
        from megatron.core.tensor_parallel import mappings

        s = self.settings
        x = x.to(self.lora_A.dtype)
        if s.dropout_position == "pre":
            x = self.dropout(x)
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)  # [s, b, in]
            elif self.tp_size > 1:
                x = mappings.copy_to_tensor_model_parallel_region(x, group=self.tp_group)
            h = x @ self._reduced(self.lora_A, True).t()  # [s, b, r], A's grad is a partial sum over TP
            y = h @ self.lora_B.t()  # [s, b, out/tp]
        else:
            h = x @ self.lora_A.t()  # [s, b, r], partial over TP
            if self.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)  # [s/tp, b, r]
            elif self.tp_size > 1:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            y = h @ self._reduced(self.lora_B, self.sequence_parallel).t()  # [s(/tp), b, out]
        if s.dropout_position == "post":
            y = self.dropout(y)
        return y * s.scale

    def forward(self, x: torch.Tensor, *args, **kwargs):
        """The base's ``(output, bias)`` with the adapter added to the output (unless disabled)."""
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        return out + self.adapter(x).to(out.dtype), bias

    def get_extra_state(self):
        """The base's extra state (Megatron's linears keep ``_extra_state`` keys), so the state dict
        keys stay the base model's."""
        return self.base.get_extra_state()

    def set_extra_state(self, state) -> None:  # noqa: D102
        self.base.set_extra_state(state)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron distributed-checkpoint entries: the base linear's own (under the base's names, TP
        axes as Megatron lays them out) plus ``lora_A``/``lora_B`` sharded like their layout (B on
        axis 0 of a column-parallel linear, A on axis 1 of a row-parallel one), so a checkpoint saved
        at one TP size loads at another."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = self.base.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        axis = {"lora_B": 0} if self.parallel_mode == "column" else {"lora_A": 1}
        if self.tp_size == 1:
            axis = {}
        group = self.tp_group if self.tp_group is not None else getattr(self.base, "tp_group", None)
        adapters = make_sharded_tensors_for_checkpoint(
            {"lora_A": self.lora_A, "lora_B": self.lora_B},
            prefix,
            axis,
            sharded_offsets,
            tp_group=group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.gated:  # saved as [gate; up] like the base weight (Megatron's MLP does this for weight/bias only)
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B"
            adapters[key] = apply_swiglu_sharded_factory(
                adapters[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
            )
        out.update(adapters)
        return out

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + scale * B A`` (for the TP-sharded side, the local product is
        already the local shard; the whole factor is identical on every rank)."""
        if self.parallel_mode == "column":
            delta = self.lora_B.float() @ self.lora_A.float()  # [out/tp, in]
        else:
            delta = self.lora_B.float() @ self.lora_A.float()  # [out, in/tp]
        return (self.base.weight.float() + self.settings.scale * delta).to(self.base.weight.dtype)


def apply_lora(
    model: nn.Module,
    settings: LoRASettings,
    *,
    target_modules=TARGET_MODULES,
    exclude_modules=(),
    tp_group=None,
    sequence_parallel: bool = False,
    seed: int = 0,
    dtype: Optional[torch.dtype] = None,
    expert_tp_group=None,
) -> list[str]:
    """Replace every targeted linear of ``model`` with a ``LoRALinear``; freeze all base weights.

    Returns the names of the wrapped modules. A target module name the model does not have is an
    error naming the name and the allowed ones. An MoE expert's linear (``is_expert``) gets its
    adapter over ``expert_tp_group`` (expert tensor parallelism > 1 is not built: refused) and its
    adapter weights are marked ``allreduce=False``, so Megatron's DDP reduces their gradients over
    the expert-data-parallel group like the experts' own weights.
    """
    etp_size = dist.get_world_size(expert_tp_group) if expert_tp_group is not None and dist.is_initialized() else 1
    unknown = [t for t in target_modules if t not in TARGET_MODULES]
    if unknown:
        raise ValueError(f"lora.target_modules: {unknown} not allowed; each one of {TARGET_MODULES}")
    for p in model.parameters():
        p.requires_grad_(False)
    found, wrapped = set(), []
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in target_modules and not isinstance(m, LoRALinear)
    ]
    for name, module in targets:
        leaf = name.rsplit(".", 1)[-1]
        if any(e == leaf or e in name for e in exclude_modules):
            continue
        found.add(leaf)
        mode = "column" if leaf in COLUMN_TARGETS else "row"
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        expert = bool(getattr(module, "is_expert", False))
        if expert and etp_size > 1:
            raise ValueError(
                f"lora.target_modules: {leaf!r} inside MoE experts ({name}) with "
                f"expert_tensor_parallel_size={etp_size} is not built; use 1 or exclude_modules=[experts]"
            )
        gated = leaf == "linear_fc1" and bool(getattr(getattr(module, "config", None), "gated_linear_unit", False))
        lora = LoRALinear(
            module,
            mode,
            settings,
            tp_group=None if expert else tp_group,
            sequence_parallel=sequence_parallel and not expert,
            seed=seed + zlib.crc32(global_module_name(model, name).encode()),
            dtype=dtype,
            gated=gated,
        )
        if expert:
            lora.lora_A.allreduce = lora.lora_B.allreduce = False
        setattr(parent, leaf, lora)
        wrapped.append(name)
    missing = [t for t in target_modules if t not in found]
    if missing and not exclude_modules:
        raise ValueError(
            f"lora.target_modules: {missing} not found in the model; it has "
            f"{sorted({n.rsplit('.', 1)[-1] for n, _ in targets})}"
        )
    return wrapped


def global_module_name(model: nn.Module, name: str) -> str:
    """``name`` with layout-free indices: a decoder layer's index becomes its global ``layer_number``
    (pipeline / virtual-pipeline stages hold local indices), a local expert's its global expert index
    (expert parallelism). Adapters are drawn from a seed of this name, so every layout starts from the
    same adapters."""
    parts = name.split(".")
    out = []
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            container = model.get_submodule(".".join(parts[:i]))
            child = container[int(part)]
            if parts[i - 1] == "layers" and hasattr(child, "layer_number"):
                part = f"L{child.layer_number}"
            elif parts[i - 1] == "local_experts" and i > 1:
                owner = model.get_submodule(".".join(parts[: i - 1]))
                group = getattr(owner, "ep_group", None)
                ep_rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
                part = f"E{ep_rank * getattr(owner, 'num_local_experts', len(container)) + int(part)}"
        out.append(part)
    return ".".join(out)


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every adapter of ``model`` on or off (off = the base model, used as the reference)."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.enabled = enabled


def lora_modules(chunks) -> list[LoRALinear]:
    """Every ``LoRALinear`` in ``chunks`` (a module or a list of model chunks, DDP-wrapped or not)."""
    chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Inside the block the model is its base (every adapter off): the reference policy of a LoRA
    actor (verl builds no separate reference model then). The previous switches come back after."""
    modules = lora_modules(chunks)
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, on in zip(modules, before):
            m.enabled = on


@contextlib.contextmanager
def merged_adapters(chunks):
    """Inside the block every wrapped base weight holds ``W + scale * B A`` and the adapters are off,
    so the model computes what it computed before and its base parameters are what an HF export of
    the merged model needs (weight sync with ``lora.merge: true``). The base weights are restored
    bit for bit afterwards (from a copy, not by subtracting, which would round)."""
    modules = lora_modules(chunks)
    saved = []
    try:
        with torch.no_grad():
            for m in modules:
                saved.append((m, m.base.weight.detach().clone(), m.enabled))
                m.base.weight.copy_(m.merged_weight())
                m.enabled = False
        yield
    finally:
        with torch.no_grad():
            for m, weight, on in saved:
                m.base.weight.copy_(weight)
                m.enabled = on


LORA_PARAM_PATTERN = r".*\.lora_[AB]$"
"""Regex of the adapters' parameter names (left out of an HF export of the merged model)."""
