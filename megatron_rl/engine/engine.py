"""The Megatron training engine: log-probs, values and parameter updates for one role.

``MegatronEngine`` owns this rank's model chunks (actor, reference, critic or reward model),
their Megatron optimizer and learning-rate schedule, and runs every batch through Megatron's
``get_forward_backward_func()`` schedule, so the same code serves one CPU process and TP x PP
x VPP x EP layouts on many GPUs. Batches use verl's field names (``input_ids``,
``attention_mask``, ``responses``, ``response_mask``, ``old_log_probs``, ``advantages``,
``ref_log_prob``, ``values``, ``returns``, ``rollout_is_weights``) and hold this data-parallel
rank's share of the global batch. Losses are normalised by the *global* token/sequence count
(``global_batch_info``), so micro-batch count and data-parallel size do not change the loss or
the gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from functools import partial
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.algos import agg_loss, get_policy_loss_fn
from megatron_rl.config import ActorConfig, CriticConfig, OptimConfig
from megatron_rl.algos.distillation import TOPK_LOSS_MODES, distillation_ppo_loss, resolve_distillation_config
from megatron_rl.config.model import ModelConfig
from megatron_rl.data.batch import BatchFields, batch_fields, check_fields
from megatron_rl.models.gpt import build_model, build_transformer_config, hidden_states_output
from parallel.context_parallel import gather_from_context_parallel, pad_length_for_context_parallel, zigzag_index

__all__ = ["MegatronEngine", "left_align", "response_positions"]

Batch = Mapping[str, torch.Tensor]
_PAD_LOGIT = -1e30  # finite: exp() underflows to exactly 0 and 0 * logit stays 0 (no NaN in entropy)


# ----------------------------------------------------------------------------- batch layout
def left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate each row so its valid tokens start at column 0.

    RL batches are ``[left-padded prompt | right-padded response]``: the valid tokens of a row
    are contiguous. Left-aligned, plain causal attention is exact for every valid token and
    position ids are ``arange``. Returns ``(aligned_ids [b, s], shift [b])`` where ``shift`` is
    the number of leading pads.
    """
    b, s = input_ids.shape
    shift = (attention_mask.long().cumsum(-1) == 0).sum(-1)  # [b]
    index = (torch.arange(s, device=input_ids.device)[None, :] + shift[:, None]) % s
    return input_ids.gather(1, index), shift


def response_positions(shift: torch.Tensor, seq_len: int, response_len: int, max_pos: int) -> torch.Tensor:
    """Aligned positions whose outputs predict each response token: ``[b, response_len]``.

    Response token ``j`` sits at original column ``P + j`` (``P = seq_len - response_len``),
    i.e. aligned column ``P + j - shift``; it is predicted by the position before it.
    """
    prompt_len = seq_len - response_len
    j = torch.arange(response_len, device=shift.device)[None, :]
    return (prompt_len + j - shift[:, None] - 1).clamp(0, max_pos - 1)


def _split(batch: Batch, size: int) -> list[dict[str, torch.Tensor]]:
    n = _batch_len(batch)
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def _batch_len(batch: Batch) -> int:
    return int(batch["input_ids"].shape[0])


def _require(batch: Batch, *keys: str) -> None:
    check_fields(batch, BatchFields(keys))


# ----------------------------------------------------------------------------- engine
class MegatronEngine:
    """Model chunks + optimizer + schedule for one role on this rank (mesh must be initialised)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        parallel_cfg: Any,
        *,
        role: str = "actor",
        config: ActorConfig | CriticConfig | Mapping | None = None,
        trainable: bool = True,
        transformer_overrides: Optional[Mapping[str, Any]] = None,
    ):
        """``transformer_overrides``: extra ``TransformerConfig`` fields (verl's
        ``megatron.override_transformer_config``, e.g. ``recompute_granularity: full``)."""
        import dataclasses

        from megatron.core import parallel_state as ps
        from megatron.core.transformer import TransformerConfig

        overrides = dict(transformer_overrides or {})
        known = {f.name for f in dataclasses.fields(TransformerConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"megatron.override_transformer_config has unknown TransformerConfig field(s) {unknown}")
        self.role = role
        self.model_cfg = model_cfg
        self.parallel_cfg = parallel_cfg
        config_cls = CriticConfig if role in ("critic", "reward") else ActorConfig
        self.config = config_cls.from_dict(config) if not isinstance(config, config_cls) else config
        self.tf_config = build_transformer_config(model_cfg, parallel_cfg, **overrides)
        self.trainable = trainable and role in ("actor", "critic")
        chunks = build_model(model_cfg, self.tf_config, role=role)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.cp_group = ps.get_context_parallel_group()
        self.cp_size, self.cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        # Pure DP: the CP ranks of one DP replica hold the same samples, so token counts and
        # metrics reduce over DP only (Megatron's DDP reduces gradients over DP x CP itself).
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.dp_group)
        # Collectives on small host values still need device tensors under NCCL.
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.is_pp_last = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.optimizer = self.scheduler = None
        if self.trainable:
            self.model = self._wrap_ddp(chunks)
            self.optimizer, self.scheduler = self._build_optimizer(self.config.optim)
        else:
            self.model = chunks
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()

    # -- construction ---------------------------------------------------------------------
    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        wrapped = [
            DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        no_sync = [m.no_sync for m in wrapped]
        self.tf_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        return wrapped

    def _build_optimizer(self, optim: OptimConfig):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        opt_config = OptimizerConfig(
            optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=float(optim.betas[0]), adam_beta2=float(optim.betas[1]), adam_eps=optim.eps,
            clip_grad=optim.clip_grad, bf16=self.tf_config.bf16, fp16=self.tf_config.fp16,
            params_dtype=self.tf_config.params_dtype, use_distributed_optimizer=False,
        )
        optimizer = get_megatron_optimizer(opt_config, self.model)
        total = optim.total_training_steps if optim.total_training_steps > 0 else 1_000_000_000
        warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total)
        decay = optim.lr_decay_steps or total
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=optim.lr_warmup_init, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=max(decay, warmup + 1), lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(decay, 1),
            wd_incr_style="constant",
        )
        return optimizer, scheduler

    # -- forward plumbing -------------------------------------------------------------------
    def _forward_step(self, data_iterator, model, *, head: Callable, loss_fn: Callable, pad_to: int = 0):
        """Megatron ``forward_step_func``: run one micro-batch; the last stage gets ``loss_fn``.

        The micro-batch is trimmed to its longest row (``pad_to`` sets a floor: the interleaved
        schedule exchanges activations of one shape for all micro-batches).
        """
        mb = next(data_iterator)
        ids, shift = left_align(mb["input_ids"], mb["attention_mask"])
        seq_len = max(int(mb["attention_mask"].sum(-1).max().item()), pad_to)
        multiple = self.tf_config.tensor_model_parallel_size if self.tf_config.sequence_parallel else 1
        seq_len = pad_length_for_context_parallel(seq_len, self.cp_size, multiple)
        if seq_len > ids.shape[1]:
            ids = F.pad(ids, (0, seq_len - ids.shape[1]))
        ids = ids[:, :seq_len].contiguous()
        layout = {
            "positions": response_positions(shift, mb["input_ids"].shape[1], mb["responses"].shape[1], seq_len),
            "seq_len": seq_len,
        }
        if self.cp_size > 1:  # this CP rank's zigzag share of the sequence
            local = zigzag_index(seq_len, self.cp_size, self.cp_rank, ids.device)
            layout["local_index"] = local
            layout["local_labels"] = torch.roll(ids, -1, dims=1)[:, local]
            ids = ids[:, local].contiguous()
            pos = local.unsqueeze(0).expand_as(ids)
        else:
            pos = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand_as(ids)
        output, handle = head(model, ids, pos)
        return output, partial(loss_fn, mb, layout, handle)

    def _logits_head(self, model, ids, pos):
        return model(ids, pos, attention_mask=None), None

    def _hidden_head(self, model, ids, pos):
        with hidden_states_output(model) as handle:
            out = model(ids, pos, attention_mask=None)
        return out, handle

    def _run(self, batch: Batch, *, loss_fn: Callable, forward_only: bool, micro_batch_size: int) -> list[dict]:
        """Run ``batch`` through the schedule; returns the per-micro-batch dicts (last stage only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro_batches = _split(batch, micro_batch_size)
        num_micro = len(micro_batches)
        vpp = len(self.model)
        pp = self.tf_config.pipeline_model_parallel_size
        if vpp > 1 and num_micro % pp:
            raise ValueError(
                f"interleaved pipeline (virtual_pipeline_model_parallel_size={vpp}) needs the number of "
                f"micro-batches ({num_micro}) to be a multiple of pipeline_model_parallel_size={pp}"
            )
        head = self._hidden_head if self._use_hidden_head() else self._logits_head
        max_len = max(int(mb["attention_mask"].sum(-1).max().item()) for mb in micro_batches)
        step = partial(self._forward_step, head=head, loss_fn=partial(loss_fn, num_micro=num_micro),
                       pad_to=max_len if vpp > 1 else 0)
        iterators = [iter(micro_batches) for _ in range(vpp)]
        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iterators if vpp > 1 else iterators[0],
            model=self.model if vpp > 1 else self.model[0],
            num_microbatches=num_micro,
            seq_length=max_len,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def _use_hidden_head(self) -> bool:
        return self.role in ("actor", "ref")

    def _log_probs(self, output, mb, layout, handle, *, temperature: float, entropy: bool):
        """Vocab-parallel log-probs (and entropy) of the response tokens: ``[b, r]`` each.

        Straight from the final hidden states and the vocab-sharded output weight: only the
        positions that predict response tokens are projected, chunk by chunk, so full logits
        are never materialised. Under CP every local position is scored, then gathered.
        """
        from parallel.vocab_parallel import fused_linear_log_probs_and_entropy

        if self.cp_size > 1:
            hidden, labels = output, layout["local_labels"]  # [b, s/cp, h], [b, s/cp]
        else:
            hidden, labels = self._response_hidden(output, layout), mb["responses"]
        log_probs, ent = fused_linear_log_probs_and_entropy(
            hidden.reshape(-1, hidden.shape[-1]), handle.weight_used, labels.reshape(-1), tp_group=self.tp_group,
            temperature=temperature, chunk_size=self.config.logprob_chunk_size, compute_entropy=entropy,
            vocab_size=self.model_cfg.vocab_size,  # padded embedding rows stay out of the softmax
        )
        log_probs = self._from_layout(log_probs.view(labels.shape), layout)
        ent = self._from_layout(ent.view(labels.shape), layout) if ent is not None else None
        return log_probs, ent

    @staticmethod
    def _response_hidden(output: torch.Tensor, layout: dict) -> torch.Tensor:
        """``[b, r, h]`` final hidden states at the positions that predict the response tokens."""
        positions = layout["positions"]
        b, r = positions.shape
        return output.gather(1, positions[..., None].expand(b, r, output.shape[-1]))

    def _from_layout(self, values: torch.Tensor, layout: dict) -> torch.Tensor:
        """Per-position values -> ``[b, r]`` at the response positions (gathering CP shares first)."""
        if self.cp_size == 1:
            return values
        full = gather_from_context_parallel(values, self.cp_group, layout["seq_len"])  # [b, s]
        return full.gather(1, layout["positions"])

    def _values(self, output, layout, mask):
        values = output.squeeze(-1).float()  # [b, s] (or this CP rank's share)
        if self.cp_size > 1:
            values = gather_from_context_parallel(values, self.cp_group, layout["seq_len"])
        return values.gather(1, layout["positions"]) * mask

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        """Hand the last pipeline stage's result to every stage (no-op without PP)."""
        if self.tf_config.pipeline_model_parallel_size == 1:
            return obj
        holder = [obj if self.is_pp_last else None]
        dist.broadcast_object_list(holder, src=self.pp_last_rank, group=self.pp_group)
        return holder[0]

    # -- inference ------------------------------------------------------------------------
    @batch_fields("input_ids", "attention_mask", "responses")
    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, *, temperature: float = 1.0, calculate_entropy: bool = False,
                         micro_batch_size: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Log-probs ``[b, r]`` (and ``entropys``) of ``batch["responses"]``; forward only."""

        def loss_fn(mb, layout, handle, output, *, num_micro):
            lp, ent = self._log_probs(output, mb, layout, handle, temperature=temperature, entropy=calculate_entropy)
            out = {"log_probs": lp}
            if ent is not None:
                out["entropys"] = ent
            return torch.zeros((), device=lp.device), out

        return self._forward_only(batch, loss_fn, micro_batch_size)

    @batch_fields("input_ids", "attention_mask", "responses", "response_mask")
    @torch.no_grad()
    def compute_values(self, batch: Batch, *, micro_batch_size: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Critic values ``[b, r]`` at the positions predicting each response token (masked)."""

        def loss_fn(mb, layout, handle, output, *, num_micro):
            values = self._values(output, layout, mb["response_mask"])
            return torch.zeros((), device=values.device), {"values": values}

        return self._forward_only(batch, loss_fn, micro_batch_size)

    @batch_fields("input_ids", "attention_mask", "responses")
    @torch.no_grad()
    def compute_rm_score(self, batch: Batch, *, micro_batch_size: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Reward-model scores ``rm_scores [b]``: the scalar head at the last valid token.

        The last valid token is the last ``attention_mask`` token of prompt + response (the end
        of the response, or of the prompt for an empty response) -- verl's reward-model semantics,
        and what HF ``*ForSequenceClassification`` picks (last non-pad token) when pads carry
        ``pad_token_id``. Needs the ``reward`` (or ``critic``) role's scalar head.
        """
        if self.role not in ("reward", "critic"):
            raise ValueError(f"compute_rm_score needs a scalar-head engine (role 'reward'); this one is {self.role!r}")

        def loss_fn(mb, layout, handle, output, *, num_micro):
            values = output.squeeze(-1).float()  # [b, s] (or this CP rank's share)
            if self.cp_size > 1:
                values = gather_from_context_parallel(values, self.cp_group, layout["seq_len"])
            # Sequences are left-aligned: the last valid token sits at column length - 1.
            last = (mb["attention_mask"].sum(-1).long() - 1).clamp(min=0)  # [b]
            scores = values.gather(1, last[:, None]).squeeze(1)
            return torch.zeros((), device=scores.device), {"rm_scores": scores}

        return self._forward_only(batch, loss_fn, micro_batch_size)

    def _forward_only(self, batch: Batch, loss_fn: Callable, micro_batch_size: Optional[int]) -> dict:
        for chunk in self.model:
            chunk.eval()
        mbs = micro_batch_size or self.config.ppo_micro_batch_size_per_gpu
        outputs = self._run(batch, loss_fn=loss_fn, forward_only=True, micro_batch_size=mbs)
        result = None
        if self.is_pp_last:
            result = {k: torch.cat([o[k] for o in outputs]) for k in outputs[0]}
        return self._broadcast_from_last_stage(result)

    # -- training -------------------------------------------------------------------------
    @batch_fields("input_ids", "attention_mask", "responses", "response_mask",
                  optional=("old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights", "teacher_log_probs",
                            "teacher_topk_log_probs", "teacher_topk_ids"))
    def update_policy(self, batch: Batch, *, temperature: float = 1.0, distillation_loss: Any = None) -> dict[str, float]:
        """PPO-style update of the actor on this rank's share of the batch; returns verl's metrics.

        With ``distillation_loss`` (a ``DistillationLossConfig``, verl's ``distillation`` section or
        its ``distillation_loss`` part; a section with ``enabled=False`` is off) the loss is verl's
        ``distillation_ppo_loss``: the distillation loss from the student's log-probs and the
        batch's ``teacher_log_probs [b, r]`` -- for ``forward_kl_topk`` the teacher's
        ``teacher_topk_log_probs`` / ``teacher_topk_ids [b, r, k]`` against the student's vocab-parallel
        logits -- (back-propagated, or as advantages ``-loss`` of a
        policy loss with ``use_policy_gradient``). With ``use_task_rewards`` it is added, times
        ``distillation_loss_coef``, to the task loss (policy loss - entropy bonus + KL loss); without,
        it is the whole loss. Adds ``distillation/*`` metrics (``loss_min``/``loss_max`` reduced by
        min/max over all tokens, the others like the ``actor/*`` metrics)."""
        cfg: ActorConfig = self.config
        dcfg = resolve_distillation_config(distillation_loss)
        # verl still evaluates the task loss for its metrics in policy-gradient distillation.
        run_task = dcfg is None or dcfg.use_task_rewards or (dcfg.use_policy_gradient and "advantages" in batch)
        if run_task:
            _require(batch, "old_log_probs", "advantages")
        topk = dcfg is not None and dcfg.loss_mode in TOPK_LOSS_MODES
        if dcfg is not None:
            teacher_keys = ("teacher_topk_log_probs", "teacher_topk_ids") if topk else ("teacher_log_probs",)
            _require(batch, *teacher_keys, *(("old_log_probs",) if dcfg.use_policy_gradient else ()))
        if cfg.use_kl_loss and run_task:
            _require(batch, "ref_log_prob")
        policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        need_entropy = cfg.entropy_coeff != 0 or cfg.calculate_entropy

        def loss_fn(mb, layout, handle, output, *, num_micro, step_cfg):
            mask = mb["response_mask"]
            lp, ent = self._log_probs(output, mb, layout, handle, temperature=temperature, entropy=need_entropy)
            gbi = step_cfg.global_batch_info
            loss, stats, pg_metrics, extremes = lp.sum() * 0.0, {}, {}, {}
            if run_task:
                loss, stats, pg_metrics = self._task_loss(mb, lp, ent, step_cfg, policy_loss_fn)
            if dcfg is not None:
                terms = self._topk_terms(output, mb, layout, handle, dcfg, temperature) if topk else None
                loss, distill_metrics, extremes = distillation_ppo_loss(mb, lp, loss if run_task else None, dcfg,
                                                                     cfg.loss_agg_mode, gbi, topk=terms)
                stats["distillation/loss"] = distill_metrics.pop("distillation/loss")
                pg_metrics.update(distill_metrics)
            tokens = mask.sum()
            # Token-weighted per-micro-batch ratios, so the global value is their weighted mean.
            weighted = {k: float(v) * float(tokens) for k, v in pg_metrics.items()}
            return loss * num_micro, {"sums": {k: float(v) for k, v in stats.items()}, "weighted": weighted,
                                      "tokens": float(tokens), "extremes": extremes}

        return self._train(batch, loss_fn, prefix="actor")

    def _response_logits(self, output, layout, handle) -> torch.Tensor:
        """``[b, r, vocab/tp]`` logits (this rank's vocabulary shard) of the positions that predict
        the response tokens -- only those positions are projected. The hidden state's gradient is
        summed over TP, as ``ColumnParallelLinear``'s input gradient is."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if self.cp_size > 1:
            raise ValueError("top-k distillation (forward_kl_topk) does not support context parallelism yet")
        hidden = self._response_hidden(output, layout)
        if self.tf_config.tensor_model_parallel_size > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden)
        return hidden @ handle.weight_used.t()

    def _topk_terms(self, output, mb, layout, handle, dcfg, temperature: float):
        """``forward_kl_topk`` terms of one micro-batch from vocab-parallel logits: the student's
        log-probs at the teacher's top-k ids (differentiable) and the student's own top-k ids."""
        from megatron_rl.algos.distillation import topk_distillation_from_log_probs
        from parallel.vocab_parallel_topk import vocab_parallel_gather_log_probs, vocab_parallel_topk_log_probs

        logits = self._response_logits(output, layout, handle)
        ids = mb["teacher_topk_ids"].long()
        kw = dict(tp_group=self.tp_group, temperature=temperature, vocab_size=self.model_cfg.vocab_size)
        student_at_teacher = vocab_parallel_gather_log_probs(logits, ids, **kw)
        _, student_ids = vocab_parallel_topk_log_probs(logits.detach(), ids.shape[-1], **kw)
        return topk_distillation_from_log_probs(student_at_teacher, student_ids, mb["teacher_topk_log_probs"].float(),
                                                ids, dcfg.log_prob_min_clamp)

    @batch_fields("input_ids", "attention_mask", "responses")
    @torch.no_grad()
    def compute_topk_log_probs(self, batch: Batch, *, k: int, temperature: float = 1.0,
                               micro_batch_size: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The ``k`` largest log-probs of every response position and their ids (``topk_log_probs``,
        ``topk_ids``, both ``[b, r, k]``) -- a distillation teacher's side of ``forward_kl_topk``."""
        from parallel.vocab_parallel_topk import vocab_parallel_topk_log_probs

        if not self._use_hidden_head():
            raise ValueError(f"compute_topk_log_probs needs a language-model head; this engine is a {self.role!r}")

        def loss_fn(mb, layout, handle, output, *, num_micro):
            values, ids = vocab_parallel_topk_log_probs(self._response_logits(output, layout, handle), k,
                                                        tp_group=self.tp_group, temperature=temperature,
                                                        vocab_size=self.model_cfg.vocab_size)
            return torch.zeros((), device=values.device), {"topk_log_probs": values.float(), "topk_ids": ids}

        return self._forward_only(batch, loss_fn, micro_batch_size)

    def _task_loss(self, mb, lp, ent, step_cfg, policy_loss_fn) -> tuple[torch.Tensor, dict, dict]:
        """Policy loss - entropy bonus + KL loss of one micro-batch: ``(loss, summed stats, ratio metrics)``."""
        cfg: ActorConfig = self.config
        mask, gbi = mb["response_mask"], step_cfg.global_batch_info
        pg_loss, pg_metrics = policy_loss_fn(
            old_log_prob=mb["old_log_probs"], log_prob=lp, advantages=mb["advantages"], response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode, config=step_cfg, rollout_is_weights=mb.get("rollout_is_weights"),
        )
        loss = pg_loss
        stats = {"actor/pg_loss": pg_loss.detach()}
        if ent is not None:
            entropy_loss = agg_loss(ent, mask, cfg.loss_agg_mode, **gbi)
            stats["actor/entropy"] = entropy_loss.detach()
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
        if cfg.use_kl_loss:
            from megatron_rl.algos.kl import kl_penalty

            kld = kl_penalty(lp, mb["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, **gbi)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss.detach()
            stats["actor/kl_coef"] = torch.tensor(cfg.kl_loss_coef)
        return loss, stats, dict(pg_metrics)

    @batch_fields("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss update of the critic; returns verl's ``critic/*`` metrics."""
        from megatron_rl.algos.value_loss import compute_value_loss

        cfg: CriticConfig = self.config

        def loss_fn(mb, layout, handle, output, *, num_micro, step_cfg):
            mask = mb["response_mask"]
            vpreds = self._values(output, layout, mask)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds=vpreds, returns=mb["returns"], values=mb["values"], response_mask=mask,
                cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, **step_cfg.global_batch_info,
            )
            tokens = mask.sum()
            weighted = {
                "critic/vf_clipfrac": float(vf_clipfrac) * float(tokens),
                "critic/vpred_mean": float((vpreds.detach() * mask).sum()),
            }
            return vf_loss * num_micro, {"sums": {"critic/vf_loss": float(vf_loss.detach())}, "weighted": weighted,
                                         "tokens": float(tokens)}

        return self._train(batch, loss_fn, prefix="critic")

    def _train(self, batch: Batch, loss_fn: Callable, *, prefix: str) -> dict[str, float]:
        if not self.trainable:
            raise ValueError(f"the {self.role!r} engine is not trainable")
        cfg = self.config
        n = _batch_len(batch)
        mini = cfg.ppo_mini_batch_size * cfg.rollout_n
        if mini % self.dp_size:
            raise ValueError(
                f"{prefix}.ppo_mini_batch_size * rollout_n = {mini} is not divisible by the data-parallel size {self.dp_size}"
            )
        local_mini = min(mini // self.dp_size, n)
        if n % local_mini:
            raise ValueError(f"{prefix}: local batch of {n} samples is not a multiple of the mini-batch {local_mini}")
        for chunk in self.model:
            chunk.train()
        history: dict[str, list[float]] = defaultdict(list)
        generator = torch.Generator().manual_seed(cfg.data_loader_seed)
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=generator) if cfg.shuffle else torch.arange(n)
            for start in range(0, n, local_mini):
                idx = order[start : start + local_mini]
                mini_batch = {k: v[idx] for k, v in batch.items()}
                for key, value in self._train_mini_batch(mini_batch, loss_fn, prefix).items():
                    history[key].append(value)
        return {k: sum(v) / len(v) for k, v in history.items()}

    def _train_mini_batch(self, mini_batch: Batch, loss_fn: Callable, prefix: str) -> dict[str, float]:
        cfg = self.config
        masks = mini_batch["response_mask"]
        counts = torch.tensor([float(masks.sum()), float((masks.sum(-1) > 0).sum())], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(counts, group=self.dp_group)
        gbi = {"dp_size": self.dp_size, "batch_num_tokens": int(counts[0]), "global_batch_size": int(counts[1])}
        if cfg.loss_scale_factor is not None:
            gbi["loss_scale_factor"] = cfg.loss_scale_factor
        step_cfg = dataclasses.replace(cfg, global_batch_info=gbi)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(mini_batch, loss_fn=partial(loss_fn, step_cfg=step_cfg), forward_only=False,
                            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        metrics = self._reduce_metrics(outputs, total_tokens=float(counts[0]))
        metrics[f"{prefix}/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics[f"{prefix}/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics

    def _reduce_metrics(self, outputs: list[dict], total_tokens: float) -> dict[str, float]:
        """Global metrics: summed losses averaged over DP, token-weighted ratios over all tokens,
        and (``extremes``) minima / maxima over all tokens."""
        local = None
        if self.is_pp_last:
            sums: dict[str, float] = defaultdict(float)
            weighted: dict[str, float] = defaultdict(float)
            lows: dict[str, float] = defaultdict(lambda: math.inf)
            highs: dict[str, float] = defaultdict(lambda: -math.inf)
            for out in outputs:
                for k, v in out["sums"].items():
                    sums[k] += v
                for k, v in out["weighted"].items():
                    weighted[k] += v
                extremes = out.get("extremes", {})
                for k, v in extremes.get("min", {}).items():
                    lows[k] = min(lows[k], v)
                for k, v in extremes.get("max", {}).items():
                    highs[k] = max(highs[k], v)
            if self.dp_size > 1:
                # A rank whose micro-batches had no response token may lack some keys: agree first.
                names = [None] * self.dp_size
                dist.all_gather_object(names, (sorted(sums), sorted(weighted), sorted(lows), sorted(highs)),
                                       group=self.dp_group)
                for table, i in ((sums, 0), (weighted, 1), (lows, 2), (highs, 3)):
                    for k in {k for n in names for k in n[i]}:
                        table[k] += 0.0  # materialises the default (0, +inf or -inf)
            keys = sorted(sums) + sorted(weighted)
            vec = torch.tensor([sums[k] / self.dp_size for k in sorted(sums)] + [weighted[k] for k in sorted(weighted)],
                               dtype=torch.float64, device=self.device)
            dist.all_reduce(vec, group=self.dp_group)
            n_sums = len(sums)
            local = {k: float(vec[i]) if i < n_sums else float(vec[i]) / max(total_tokens, 1.0)
                     for i, k in enumerate(keys)}
            for table, op in ((lows, dist.ReduceOp.MIN), (highs, dist.ReduceOp.MAX)):
                if table:
                    ext = torch.tensor([table[k] for k in sorted(table)], dtype=torch.float64, device=self.device)
                    dist.all_reduce(ext, op=op, group=self.dp_group)
                    local.update({k: float(v) for k, v in zip(sorted(table), ext.tolist())})
        return self._broadcast_from_last_stage(local)

    # -- parameters -----------------------------------------------------------------------
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

        return str(save_model(self.model, path, overwrite=True, metadata=metadata, optimizer=self.optimizer,
                              scheduler=self.scheduler, save_rng=self.trainable))

    def load_checkpoint(self, path: str, *, load_optimizer: bool = True) -> None:
        """Collective: restore what ``save_checkpoint`` wrote (the optimizer / schedule / RNG only
        for a trainable engine with ``load_optimizer``)."""
        from parallel.checkpoint import load_model

        full = self.trainable and load_optimizer
        load_model(self.model, path, optimizer=self.optimizer if full else None,
                   scheduler=self.scheduler if full else None, load_rng=full)

    def offload_to_cpu(self) -> None:
        """Move parameters, gradient buffers and optimizer state to host memory (no-op on CPU)."""
        self._move("cpu")

    def load_to_device(self) -> None:
        """Bring parameters, gradient buffers and optimizer state back to the GPU (no-op on CPU)."""
        self._move("cuda")

    def _move(self, device: str) -> None:
        if not torch.cuda.is_available():
            return
        target = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        for chunk in self.model:
            for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
                for attr in ("param_data", "grad_data"):
                    tensor = getattr(buffer, attr, None)
                    if tensor is not None:
                        tensor.data = tensor.data.to(target, non_blocking=True)
                # Params are views into param_data: re-point them at the moved storage.
                for param, (start, end, _) in buffer.param_index_map.items():
                    param.data = buffer.param_data[start:end].view(param.data.shape)
                    param.main_grad = buffer.grad_data[start:end].view(param.data.shape)
            for param in chunk.parameters():
                if param.device != target:
                    param.data = param.data.to(target, non_blocking=True)
        if self.optimizer is not None:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                for state in opt.optimizer.state.values():
                    for key, value in state.items():
                        if torch.is_tensor(value):
                            state[key] = value.to(target, non_blocking=True)
        torch.cuda.synchronize()
        if device == "cpu":
            torch.cuda.empty_cache()
