"""The role-agnostic Megatron engine: one model on this rank, run through Megatron's schedule.

``MegatronEngine`` owns this rank's model chunks (an LM head or a scalar head), their Megatron
optimizer and learning-rate schedule when trainable, and runs batches through
``get_forward_backward_func()``, so the same code serves one CPU process and TP x PP x VPP x EP
x CP layouts on many GPUs. It is built from a ``parallel.mesh.Mesh`` and reduces over the mesh's
groups; it knows no roles and no losses. Callers bring the math as closures over a typed
``ModelOutput`` (``megatron_rl.engine.batch_layout``):

* ``forward(batch, fn, micro_batch_size=... | max_token_len=...)``: forward only;
  ``fn(micro_batch, output)`` returns per-row tensors, put back into the batch's order and handed
  to every pipeline stage.
* ``train_step(mini_batch, loss_fn, micro_batch_size=... | max_token_len=...)``: one optimizer
  step; ``loss_fn(micro_batch, output, step)`` returns the micro-batch's share of the loss
  (normalised by the global counts in ``step``, a ``StepInfo``, and scaled by ``dp_size`` because
  DDP averages gradients over DP) and its ``LossMetrics``. The loss therefore does not depend on
  how the samples are cut into micro-batches.

An MoE engine built with ``routing_replay`` records its routers' top-k experts in ``forward``
(``routing="record"``: a ``routed_experts`` field) and replays a batch's in ``forward`` /
``train_step`` (``megatron_rl.engine.router_replay``, verl's router replay R2 / R3).

Micro-batches hold ``micro_batch_size`` samples, or as many as a token budget ``max_token_len``
allows (verl's ``use_dynamic_bsz``; ``megatron_rl.engine.batching``). With ``remove_padding``
(verl's ``use_remove_padding``, the default) each micro-batch runs as one packed THD sequence
(``megatron_rl.engine.packing``); otherwise its rows are padded to the longest one.

Batches use verl's field names (``input_ids``, ``attention_mask``, ``responses``, and
``response_mask`` for the token counts of a training step) and hold this data-parallel rank's
share of the global batch. verl's ``workers/engine/base.py`` (``train_batch(data, loss_function)``)
is the model; the roles that use it live in ``megatron_rl.roles``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_rl.config import OptimConfig
from megatron_rl.config.lora_config import check_lora_fits
from megatron_rl.config.model import ModelConfig
from megatron_rl.engine.batching import MicroBatchPlan, fixed_micro_batches, token_budget_micro_batches
from megatron_rl.engine.device import to_device, to_host
from megatron_rl.engine.batch_layout import ModelOutput, prepare_inputs
from megatron_rl.engine.lora_layers import (
    LORA_PARAM_PATTERN,
    LoRASettings,
    adapters_disabled,
    apply_lora,
    merged_adapters,
)
from megatron_rl.engine.step_info import LossMetrics, StepInfo, reduce_metrics
from megatron_rl.engine.ddp_optimizer import build_optimizer, wrap_ddp
from megatron_rl.engine.packing import pack_micro_batch, packed_length, row_lengths
from megatron_rl.engine.offload import CATEGORIES, OffloadStore, resident_bytes
from megatron_rl.engine.router_replay import ROUTED_EXPERTS, RoutingReplay, RoutingSession
from megatron_rl.models.attention import check_packing_support
from megatron_rl.models.gpt import (
    HEADS,
    build_model,
    build_transformer_config,
    hidden_states_output,
    require_te,
    te_available,
)

__all__ = ["MegatronEngine", "HEADS", "ForwardFn", "LossFn", "ModelOutput", "StepInfo", "LossMetrics"]

Batch = Mapping[str, torch.Tensor]
ForwardFn = Callable[[dict, ModelOutput], dict]
"""``fn(micro_batch, output) -> {name: [b, ...] tensor}`` of ``MegatronEngine.forward``."""
LossFn = Callable[[dict, ModelOutput, StepInfo], tuple]
"""``loss_fn(micro_batch, output, step) -> (loss, LossMetrics)`` of ``MegatronEngine.train_step``."""

# HEADS (models.gpt): ``lm``, the vocab-parallel output layer (``ModelOutput.hidden_states`` +
# ``output_weight``); ``scalar``, one value per token (``ModelOutput.values``: critic, reward model).


class MegatronEngine:
    """Model chunks (+ optimizer and schedule when trainable) of one model on this rank.

    Args:
        model_cfg: the architecture.
        mesh: this rank's process groups (``parallel.mesh.init_mesh``); ``mesh.config`` is the layout.
        head: ``"lm"`` or ``"scalar"`` (see ``HEADS``).
        trainable: build DDP, optimizer and LR schedule (else the weights are frozen, eval mode).
        optim: the optimizer and schedule of a trainable engine.
        transformer_overrides: extra ``TransformerConfig`` fields (verl's
            ``megatron.override_transformer_config``, e.g. ``recompute_granularity: full``).
        sequence_parallel: shard norm/dropout activations over TP (``megatron.sequence_parallel``).
        remove_padding: run every micro-batch as one packed THD sequence (``megatron.use_remove_padding``,
            verl's default True); False pads rows to the micro-batch's longest.
        distributed_optimizer: a trainable engine's Adam state sharded over DP (Megatron's
            ``DistributedOptimizer``, ``megatron.use_distributed_optimizer``).
        routing_replay: build the MoE routers with Megatron's ``RouterReplay``
            (``moe_enable_routing_replay``), so ``forward`` can record their top-k experts and
            ``forward`` / ``train_step`` replay them (``megatron_rl.engine.router_replay``); an MoE
            model only.
        name: what this model is called in messages (e.g. the role that owns it).
        lora: ``megatron_rl.config.lora_config.LoRAConfig`` with ``rank > 0`` (``*.model.lora``): the built
            chunks get LoRA adapters on ``lora.target_modules`` (``megatron_rl.engine.lora_layers``) before
            DDP wraps them; every base weight is frozen, so DDP's gradient buffers and the optimizer
            hold the adapters only. ``adapters_disabled()`` turns the model back into its base (the
            reference policy). A trainable engine only.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        mesh: Any,
        *,
        head: str = "lm",
        trainable: bool = False,
        optim: Optional[OptimConfig] = None,
        transformer_overrides: Optional[Mapping[str, Any]] = None,
        sequence_parallel: bool = False,
        remove_padding: bool = True,
        distributed_optimizer: bool = False,
        routing_replay: bool = False,
        name: str = "model",
        lora: Optional[Any] = None,
    ):
        from megatron.core.transformer import TransformerConfig

        if head not in HEADS:
            raise ValueError(f"head={head!r} is not allowed; choose one of {list(HEADS)}")
        if trainable and optim is None:
            raise ValueError(f"the {name!r} engine is trainable but has no optim config")
        check_context_parallel(model_cfg, mesh.config.context_parallel_size)  # before anything is allocated
        if remove_padding:
            check_packing_support(
                model_cfg.attention_backend,
                context_parallel_size=mesh.config.context_parallel_size,
                te_importable=te_available(),
            )
        self.remove_padding = remove_padding
        overrides = dict(transformer_overrides or {})
        if routing_replay:
            if not model_cfg.is_moe:
                raise ValueError(f"router replay on the {name!r} engine needs an MoE model (num_moe_experts is unset)")
            overrides["moe_enable_routing_replay"] = True
        known = {f.name for f in dataclasses.fields(TransformerConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"megatron.override_transformer_config has unknown TransformerConfig field(s) {unknown}")
        from parallel.bridge.mtp import check_mtp_layout
        from parallel.config import pipeline_stage_layers, uneven_pipeline_fields

        check_mtp_layout(mesh.config, overrides)  # MTP fields / layout stages: refused before the model is built
        uneven = uneven_pipeline_fields(overrides)
        if uneven:  # named errors instead of Megatron's asserts mid-build
            pipeline_stage_layers(
                model_cfg.num_layers,
                mesh.config.pipeline_model_parallel_size,
                mesh.config.virtual_pipeline_model_parallel_size,
                **uneven,
            )
        self.name, self.head, self.trainable = name, head, trainable
        self.model_cfg, self.mesh = model_cfg, mesh
        self.tf_config = build_transformer_config(
            model_cfg, mesh.config, sequence_parallel=sequence_parallel, **overrides
        )
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:  # refused before the model is built
            if not trainable:
                raise ValueError(
                    f"the {name!r} engine is frozen; LoRA adapters go on a trainable engine "
                    "(the reference of a LoRA actor is the actor with adapters off)"
                )
            check_lora_fits(self.lora, model_cfg)
        chunks = build_model(model_cfg, self.tf_config, head=head)
        if self.lora is not None:
            self.lora_modules = add_lora(
                chunks, self.lora, mesh, model_cfg.dtype, sequence_parallel=self.tf_config.sequence_parallel
            )
        self.cp_size = mesh.size("cp")
        # Pure DP: the CP ranks of one DP replica hold the same samples, so token counts and
        # metrics reduce over DP only (Megatron's DDP reduces gradients over DP x CP itself).
        self.dp_size = mesh.size("dp")
        # Collectives on small host values still need device tensors under NCCL.
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.optimizer = self.scheduler = None
        self.distributed_optimizer = bool(distributed_optimizer and trainable)
        self._offload = OffloadStore()
        if trainable:
            self.model = wrap_ddp(chunks, self.tf_config, distributed_optimizer=distributed_optimizer)
            self.optimizer, self.scheduler = build_optimizer(
                self.model, self.tf_config, optim, distributed_optimizer=distributed_optimizer
            )
        else:
            self.model = chunks
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
        self.routing = (
            RoutingReplay(
                self.model,
                num_layers=model_cfg.num_layers,
                num_experts=model_cfg.num_moe_experts,
                topk=model_cfg.moe_router_topk,
            )
            if routing_replay
            else None
        )
        self.routing_agreement: dict[str, float] = {}
        """After a call that replayed routing: the fractions of router decisions agreeing with the
        replayed ids, ``used`` (what the routers used) and ``natural`` (what they would have picked)."""

    @property
    def bridge_ignore(self) -> tuple[str, ...]:
        """Regexes of parameter names the HF bridge must leave out (load, export, weight sync): the
        LoRA adapters, which have no HF name (``merged_weights`` folds them into the base's)."""
        return (LORA_PARAM_PATTERN,) if self.lora is not None else ()

    def merged_weights(self):
        """Context manager: inside it the base weights hold ``W + scale * B A`` and the adapters are off
        (an HF export of the merged model, ``lora.merge: true``); restored bit for bit after. A no-op
        without LoRA."""
        return merged_adapters(self.model) if self.lora is not None else contextlib.nullcontext()

    def adapters_disabled(self):
        """Context manager: inside it the model is its base (``megatron_rl.engine.lora_layers``); a no-op
        without LoRA. The reference policy of a LoRA actor is this engine inside it."""
        return adapters_disabled(self.model)

    # -- the two entry points -----------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        batch: Batch,
        fn: ForwardFn,
        *,
        micro_batch_size: Optional[int] = None,
        max_token_len: Optional[int] = None,
        budget_key: str = "max_token_len",
        routing: Optional[str] = None,
    ) -> dict[str, torch.Tensor]:
        """Forward only: ``fn(micro_batch, output)``'s per-row tensors in the batch's order, on every
        pipeline stage (``fn`` runs on the last one).

        Micro-batches hold ``micro_batch_size`` rows, or, with ``max_token_len``, as many as that
        token budget allows (collective over DP; ``budget_key`` names the budget in errors).
        ``routing`` (an engine built with ``routing_replay``): ``"record"`` adds the routers' choices
        as ``routed_experts [b, s, layers, topk]``; ``"replay"`` routes by ``batch["routed_experts"]``.
        """
        self._check_resident("params")
        for chunk in self.model:
            chunk.eval()

        def loss_func(mb, output):
            result = fn(mb, output)
            return torch.zeros((), device=self.device), result

        plan = self.plan_micro_batches(
            batch, micro_batch_size=micro_batch_size, max_token_len=max_token_len, budget_key=budget_key
        )
        micro_batches = plan.split(batch)
        session = self._routing_session(routing, batch, plan, micro_batches, forward_only=True)
        outputs = self._run(micro_batches, loss_func, forward_only=True, session=session)
        result = None
        if self.mesh.is_last_pp_stage:  # per-row results go back to host memory (the driver's)
            result = to_host({k: plan.restore(torch.cat([o[k] for o in outputs])) for k in outputs[0]})
        result = self._broadcast_from_last_stage(result)
        if session is not None:
            recorded, self.routing_agreement = session.close()
            if recorded is not None:
                result[ROUTED_EXPERTS] = recorded
        return result

    def train_step(
        self,
        mini_batch: Batch,
        loss_fn: LossFn,
        *,
        micro_batch_size: Optional[int] = None,
        max_token_len: Optional[int] = None,
        budget_key: str = "max_token_len",
        routing: Optional[str] = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; the global metrics.

        Zeroes the gradients, all-reduces the mini-batch's response-token and sequence counts over
        DP (``StepInfo``), runs forward + backward of every micro-batch (``micro_batch_size`` rows,
        or a ``max_token_len`` token budget as in ``forward``) through the schedule, steps the
        optimizer (and the LR schedule when the step was taken) and reduces ``loss_fn``'s
        ``LossMetrics`` over micro-batches and DP ranks. Adds ``grad_norm`` and ``lr``.
        ``routing="replay"`` routes every micro-batch (and its activation recompute) by
        ``mini_batch["routed_experts"]`` and adds ``router_agreement/used`` / ``router_agreement/natural``;
        it is the default of an engine built with ``routing_replay`` when the mini-batch has that field.
        """
        if routing is None and self.routing is not None and ROUTED_EXPERTS in mini_batch:
            routing = "replay"
        self.ensure_trainable()
        self._check_resident(*CATEGORIES)
        for chunk in self.model:
            chunk.train()
        plan = self.plan_micro_batches(
            mini_batch, micro_batch_size=micro_batch_size, max_token_len=max_token_len, budget_key=budget_key
        )
        micro_batches = plan.split(mini_batch)
        masks = mini_batch["response_mask"]
        counts = torch.tensor(
            [float(masks.sum()), float((masks.sum(-1) > 0).sum())], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(counts, group=self.mesh.dp_group)
        step = StepInfo(
            num_micro_batches=len(micro_batches),
            dp_size=self.dp_size,
            batch_num_tokens=int(counts[0]),
            global_batch_size=int(counts[1]),
        )
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_func(mb, output):
            loss, metrics = loss_fn(mb, output, step)
            # The schedule divides every micro-batch's loss by the micro-batch count; the closure's
            # loss is already its share of the global loss.
            return loss * step.num_micro_batches, metrics

        session = self._routing_session(routing, mini_batch, plan, micro_batches, forward_only=False)
        outputs = self._run(micro_batches, loss_func, forward_only=False, session=session)
        if session is not None:
            _, self.routing_agreement = session.close()
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        metrics = None
        if self.mesh.is_last_pp_stage:
            metrics = reduce_metrics(
                outputs,
                total_tokens=float(counts[0]),
                dp_group=self.mesh.dp_group,
                dp_size=self.dp_size,
                device=self.device,
            )
        metrics = self._broadcast_from_last_stage(metrics)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        if session is not None:
            metrics.update({f"router_agreement/{k}": v for k, v in self.routing_agreement.items()})
        return metrics

    def _routing_session(
        self,
        routing: Optional[str],
        batch: Batch,
        plan: MicroBatchPlan,
        micro_batches: list[dict],
        *,
        forward_only: bool,
    ) -> Optional[RoutingSession]:
        """The call's router recording / replay (``routing`` None: the routers pick as they do)."""
        self.routing_agreement = {}
        if routing is None:
            return None
        if self.routing is None:
            raise ValueError(f"routing={routing!r}: the {self.name!r} engine was built without routing_replay")
        return RoutingSession(
            self.routing,
            routing,
            micro_batches=micro_batches,
            sample_index=plan.indices,
            batch_size=int(batch["input_ids"].shape[0]),
            seq_len=int(batch["input_ids"].shape[1]),
            mesh=self.mesh,
            sequence_parallel=bool(self.tf_config.sequence_parallel),
            forward_only=forward_only,
        )

    def ensure_trainable(self) -> None:
        """ValueError unless this engine was built trainable (it has an optimizer)."""
        if not self.trainable:
            raise ValueError(f"the {self.name!r} engine is not trainable")

    # -- micro-batches ----------------------------------------------------------------------------
    @property
    def sequence_multiple(self) -> int:
        """What sequence parallelism needs a sequence length to be a multiple of (TP, else 1)."""
        return self.tf_config.tensor_model_parallel_size if self.tf_config.sequence_parallel else 1

    @property
    def token_alignment(self) -> int:
        """Tokens a packed sequence is a multiple of: ``sequence_multiple`` times ``2 * CP`` under CP."""
        return self.sequence_multiple * (2 * self.cp_size if self.cp_size > 1 else 1)

    def plan_micro_batches(
        self,
        batch: Batch,
        *,
        micro_batch_size: Optional[int] = None,
        max_token_len: Optional[int] = None,
        budget_key: str = "max_token_len",
    ) -> MicroBatchPlan:
        """The micro-batches of ``batch`` on this rank: ``micro_batch_size`` rows each, or within the
        token budget ``max_token_len`` (every DP rank the same count; a multiple of the pipeline
        size under the interleaved schedule). ValueError naming ``budget_key`` for a budget that
        is not a multiple of ``token_alignment`` or shorter than a sample."""
        n = int(batch["input_ids"].shape[0])
        if max_token_len is None:
            if micro_batch_size is None:
                raise ValueError(f"the {self.name!r} engine needs micro_batch_size or max_token_len")
            return fixed_micro_batches(n, micro_batch_size)
        vpp, pp = len(self.model), self.tf_config.pipeline_model_parallel_size
        if vpp > 1 and not self.remove_padding:
            raise ValueError(
                f"{budget_key}: token-budget micro-batches under the interleaved pipeline schedule "
                "(virtual_pipeline_model_parallel_size > 1) need megatron.use_remove_padding=True: "
                "padded micro-batches of different row counts cannot share one activation shape"
            )
        align = self.token_alignment if self.remove_padding else 1
        if max_token_len % align:
            raise ValueError(
                f"{budget_key}={max_token_len} is not a multiple of {align}, the packed-sequence "
                "alignment (tensor_model_parallel_size under sequence parallelism x 2 * "
                "context_parallel_size); packed micro-batches would exceed it"
            )
        lengths = row_lengths(batch["attention_mask"], self.cp_size)
        return token_budget_micro_batches(
            lengths,
            max_token_len,
            dp_group=self.mesh.dp_group,
            multiple_of=pp if vpp > 1 else 1,
            budget_key=budget_key,
            device=self.device,
        )

    # -- the schedule -------------------------------------------------------------------------
    def _run(
        self,
        micro_batches: list[dict],
        loss_func: Callable,
        *,
        forward_only: bool,
        session: Optional[RoutingSession] = None,
    ) -> list:
        """Run the micro-batches through the schedule; ``loss_func``'s second outputs (last stage only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        num_micro = len(micro_batches)
        vpp = len(self.model)
        pp = self.tf_config.pipeline_model_parallel_size
        if vpp > 1 and num_micro % pp:
            raise ValueError(
                f"interleaved pipeline (virtual_pipeline_model_parallel_size={vpp}) needs the number of "
                f"micro-batches ({num_micro}) to be a multiple of pipeline_model_parallel_size={pp}"
            )
        if self.remove_padding:
            # One activation shape [t, 1, h] per micro-batch; the interleaved schedule needs one for all.
            seq_length = max(
                packed_length(mb["attention_mask"], tp_multiple=self.sequence_multiple, cp_size=self.cp_size)
                for mb in micro_batches
            )
            rows = 1
        else:
            seq_length = max(int(mb["attention_mask"].sum(-1).max().item()) for mb in micro_batches)
            rows = max(int(mb["input_ids"].shape[0]) for mb in micro_batches)
        step = partial(self._forward_step, loss_func=loss_func, pad_to=seq_length if vpp > 1 else 0, session=session)
        iterators = [iter(enumerate(micro_batches)) for _ in range(vpp)]
        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iterators if vpp > 1 else iterators[0],
            model=self.model if vpp > 1 else self.model[0],
            num_microbatches=num_micro,
            seq_length=seq_length,
            micro_batch_size=rows,
            forward_only=forward_only,
        )

    def _forward_step(
        self, data_iterator, model, *, loss_func: Callable, pad_to: int = 0, session: Optional[RoutingSession] = None
    ):
        """Megatron ``forward_step_func``: run one micro-batch; the last stage gets ``loss_func``."""
        index, mb = next(data_iterator)
        multiple = self.sequence_multiple
        packed = None
        if self.remove_padding:
            ids, pos, packed, layout = pack_micro_batch(
                mb, pad_to=pad_to, tp_multiple=multiple, cp_group=self.mesh.cp_group
            )
        else:
            ids, pos, layout = prepare_inputs(mb, pad_to=pad_to, multiple=multiple, cp_group=self.mesh.cp_group)
        # The one place a role's inputs reach its device (megatron_rl.engine.device): the micro-batch
        # the closures read, the model inputs, cu_seqlens and the layout's indices, prepared on the host.
        mb, ids, pos, packed, layout = to_device((mb, ids, pos, packed, layout), self.device)
        if session is not None:
            session.before_forward(model, index, mb, layout)
        if self.head == "lm":
            # The output layer hands back the hidden states; the closure projects only the
            # positions it needs (full logits are never materialised).
            with hidden_states_output(model) as handle:
                output = model(ids, pos, attention_mask=None, packed_seq_params=packed)
        else:
            output, handle = model(ids, pos, attention_mask=None, packed_seq_params=packed), None
        if session is not None:
            session.after_forward(model, index, mb, layout)

        def on_last_stage(output_tensor):
            return loss_func(mb, self._model_output(output_tensor, layout, handle))

        return output, on_last_stage

    def _model_output(self, output: torch.Tensor, layout, handle) -> ModelOutput:
        tp_group = self.mesh.tp_group
        if self.head == "lm":
            return ModelOutput(
                layout,
                hidden_states=output,
                output_weight=handle.weight_used,
                vocab_size=self.model_cfg.vocab_size,
                tp_group=tp_group,
                tp_size=self.tf_config.tensor_model_parallel_size,
            )
        values = output.squeeze(-1).float()  # [b, s] (or this CP rank's share)
        return ModelOutput(
            layout,
            values=values,
            vocab_size=self.model_cfg.vocab_size,
            tp_group=tp_group,
            tp_size=self.tf_config.tensor_model_parallel_size,
        )

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        """Hand the last pipeline stage's result to every stage (no-op without PP)."""
        if self.mesh.size("pp") == 1:
            return obj
        holder = [obj if self.mesh.is_last_pp_stage else None]
        dist.broadcast_object_list(holder, src=self.mesh.ranks("pp")[-1], group=self.mesh.pp_group)
        return holder[0]

    # -- parameters and state -------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameter shards as ``(name, param)``; names of VPP chunks are prefixed ``chunkN.``."""
        out = []
        for i, chunk in enumerate(self.model):
            module = chunk.module if hasattr(chunk, "module") else chunk
            prefix = f"chunk{i}." if len(self.model) > 1 else ""
            out.extend((prefix + name, p) for name, p in module.named_parameters())
        return out

    def save_checkpoint(self, path: str, *, metadata: Optional[dict] = None) -> str:
        """Collective: model, optimizer, LR schedule and RNG states of every rank to ``path`` (a
        Megatron distributed checkpoint, written atomically; see ``parallel.checkpoint``)."""
        from parallel.checkpoint import save_model

        return str(
            save_model(
                self.model,
                path,
                overwrite=True,
                metadata=metadata,
                optimizer=self._ckpt_optimizer(),
                scheduler=self.scheduler,
                save_rng=self.trainable,
            )
        )

    def load_checkpoint(self, path: str, *, load_optimizer: bool = True) -> None:
        """Collective: restore what ``save_checkpoint`` wrote (the optimizer / schedule / RNG only
        for a trainable engine with ``load_optimizer``)."""
        from parallel.checkpoint import load_model

        full = self.trainable and load_optimizer
        if full and self.distributed_optimizer:
            # A fresh DistributedOptimizer has no state to load into (its state_dict needs Adam's
            # 'step'): Megatron's own loader first takes one zero-gradient step; the load overwrites it.
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
        load_model(
            self.model,
            path,
            optimizer=self._ckpt_optimizer() if full else None,
            scheduler=self.scheduler if full else None,
            load_rng=full,
        )

    def _ckpt_optimizer(self) -> Any:
        """The optimizer as checkpoints see it: a distributed optimizer saves its state in Megatron's
        ``fully_reshardable`` layout (one tensor per parameter, so it loads at any DP size); its
        default layout needs ``flattened_range`` shards that Megatron-Core 0.16's checkpoints refuse."""
        if not self.distributed_optimizer or self.optimizer is None:
            return self.optimizer
        return _ReshardableOptimizerState(self.optimizer)

    # -- host offload (megatron_rl.engine.offload) ------------------------------------------------
    def offload_to_cpu(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Move the chosen parts of this rank's state (parameters and module buffers, DDP gradient
        buffers, optimizer state and fp32 master weights) to host memory, leaving the module tensors
        empty; the bytes moved. Parts already offloaded stay where they are."""
        chosen = [c for c, on in zip(CATEGORIES, (params, grads, optimizer)) if on]
        return self._offload.offload(self.model, self.optimizer, chosen)

    def load_to_device(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Bring back what ``offload_to_cpu`` moved (the chosen parts); the bytes moved."""
        chosen = [c for c, on in zip(CATEGORIES, (params, grads, optimizer)) if on]
        return self._offload.onload(chosen)

    def offloaded(self) -> dict[str, bool]:
        """``{params|grads|optimizer: offloaded?}``."""
        return {c: self._offload.offloaded(c) for c in CATEGORIES}

    def resident_bytes(self, device: Optional[str] = None) -> dict[str, int]:
        """Bytes of storage this rank's state holds, by part (on ``device``'s type only, when given)."""
        return resident_bytes(self.model, self.optimizer, device)

    def _check_resident(self, *parts: str) -> None:
        """RuntimeError when a part the computation needs is offloaded (a schedule out of order)."""
        away = [p for p in parts if self._offload.offloaded(p)]
        if away:
            raise RuntimeError(
                f"the {self.name!r} engine's {away} are offloaded to host memory; call "
                "load_to_device() first (the phase schedule onloads a role before it computes)"
            )


def check_context_parallel(model_cfg: ModelConfig, context_parallel_size: int) -> None:
    """Refuse what context parallelism cannot run, by key, before the model is built.

    CP attends over a split sequence with TransformerEngine's attention only, and TE's flash and
    fused attention need float16 / bfloat16 while its unfused attention is disabled under CP: at
    float32 every CP forward fails inside TE ("No dot product attention backend is available").
    """
    if context_parallel_size <= 1:
        return
    if model_cfg.dtype == torch.float32:
        raise ValueError(
            f"megatron.context_parallel_size={context_parallel_size} needs bfloat16 or float16 "
            "parameters: TransformerEngine's flash and fused attention do not run float32 and its "
            "unfused attention is disabled under context parallelism; set megatron.dtype (an inline "
            "model's params_dtype) to bfloat16, or context_parallel_size=1"
        )
    require_te(f"megatron.context_parallel_size={context_parallel_size}")


class _ReshardableOptimizerState:
    """A distributed optimizer whose ``sharded_state_dict`` uses the ``fully_reshardable`` layout."""

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False, **kwargs: Any) -> dict:
        metadata = {**(kwargs.pop("metadata", None) or {}), "distrib_optim_sharding_type": "fully_reshardable"}
        return self._optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, metadata=metadata, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def add_lora(
    chunks: list[torch.nn.Module], lora: Any, mesh: Any, model_dtype: torch.dtype, *, sequence_parallel: bool
) -> list[str]:
    """LoRA adapters (``lora``: a ``LoRAConfig``) on every chunk, over the mesh's TP group; the wrapped
    modules' names. Each adapter is drawn (whole, then sharded) from ``mesh.seed`` and its module's
    layout-free name (``megatron_rl.engine.lora_layers.global_module_name``), so TP / PP / VPP / EP layouts
    start from the same adapters."""
    settings = LoRASettings(
        rank=lora.rank,
        alpha=float(lora.alpha),
        dropout=lora.dropout,
        dropout_position=lora.dropout_position,
        lora_A_init_method=lora.lora_A_init_method,
        lora_B_init_method=lora.lora_B_init_method,
    )
    dtype = _LORA_DTYPES[lora.dtype] if lora.dtype is not None else model_dtype
    wrapped = []
    for chunk in chunks:
        wrapped += apply_lora(
            chunk,
            settings,
            target_modules=tuple(lora.target_modules),
            exclude_modules=tuple(lora.exclude_modules),
            tp_group=mesh.tp_group,
            sequence_parallel=sequence_parallel,
            seed=mesh.seed,
            dtype=dtype,
            expert_tp_group=mesh.etp_group,
        )
    return wrapped


_LORA_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
