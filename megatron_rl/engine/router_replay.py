"""MoE router replay (verl's ``megatron.router_replay``): record each token's top-k experts, replay them.

RL on MoE models drifts when the experts a token is routed to differ between the pass that
produced the old log-probs and the update (Megatron-LM#4168). Router replay pins the update's
routing to a recorded one; Megatron-Core 0.16 ships the mechanism
(``megatron.core.transformer.moe.router_replay.RouterReplay``, built into every ``TopKRouter``
when ``TransformerConfig.moe_enable_routing_replay``): per router a ``RECORD`` action keeps the
top-k ids it computed, ``REPLAY_FORWARD`` uses given ids instead of its own top-k (the routing
probabilities are still gathered from the router's scores, so the router keeps its gradient),
``REPLAY_BACKWARD`` pops the ids of activation recompute in micro-batch order.

This module maps those per-router, per-micro-batch tensors to one layout-free batch field:
``routed_experts [b, s, num_layers, topk]`` (the expert id of every token position of
``input_ids``, every layer -- zero at padding and at dense layers; ``uint8`` for <= 256 experts,
else ``int32``). Whatever the micro-batches, the packed THD layout (``engine.packing``) or the
padded one (``engine.layout``), TP with sequence parallelism (each TP rank routes a contiguous
slice of the sequence), CP (a zigzag share), PP / VPP (each stage's routers hold its layers) or
EP (routing happens before dispatch, on the rank's own tokens), a ``RoutingSession``:

* record: writes each router's ids into the field at the tokens' original places, then sums the
  partial fields over the TP (under SP), CP and PP groups (every element has one writer);
* replay: gives each router, per micro-batch, the ids of exactly the tokens it routes, in the
  order it routes them (``[tokens, topk]``; alignment padding gets experts ``0..k-1``);
* counts, while replaying, how many decisions agree with the target -- those the router used and
  those it would have picked itself (``natural``) -- for the ``router_agreement`` metrics;
* frees every router's ids when it closes.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "MODES",
    "ROUTED_EXPERTS",
    "RoutingReplay",
    "RoutingSession",
    "token_sources",
    "routing_dtype",
    "check_router_replay",
    "check_run_router_replay",
    "save_routing",
]

MODES = ("disabled", "R2", "R3")
"""verl's ``router_replay.mode``: off; R2 replays the old-log-prob pass's routing; R3 the rollout's."""
ROUTED_EXPERTS = "routed_experts"
"""The batch field: ``[b, s, num_layers, topk]`` expert ids of every token of ``input_ids``."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """Storage of expert ids: ``uint8`` up to 256 experts (NCCL and gloo reduce it), else ``int32``."""
    return torch.uint8 if num_experts <= 256 else torch.int32


def check_router_replay(mode: str, *, key: str, is_moe: bool, model: str = "the model") -> None:
    """ValueError naming ``key`` for a mode that is not in ``MODES`` or router replay on a dense model."""
    if mode not in MODES:
        raise ValueError(f"{key}={mode!r} is not allowed; choose one of {list(MODES)}")
    if mode != "disabled" and not is_moe:
        raise ValueError(
            f"{key}={mode!r} needs an MoE model, but {model} is dense (no routed experts: "
            f"num_moe_experts is unset); set {key}=disabled"
        )


def _replay_classes():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class CountingReplay(RouterReplay):
        """Megatron's per-router replay state, counting agreement with the target while it replays."""

        def __init__(self):
            super().__init__()
            # Megatron keeps a process-wide list of every instance; the engine holds its own.
            RouterReplay.global_router_replay_instances.remove(self)
            self.count_mask: Optional[torch.Tensor] = None
            self.counts = torch.zeros(3, dtype=torch.float64)  # [used agree, natural agree, decisions]

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            replaying = self.router_replay_action == RouterReplayAction.REPLAY_FORWARD
            target = self.target_topk_idx
            probs, used = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if replaying and self.count_mask is not None:
                with torch.no_grad():
                    _, natural = default_compute_topk(
                        scores.detach(), topk, num_groups=num_groups, group_topk=group_topk
                    )
                    mask = self.count_mask.to(scores.device)
                    target = target.to(scores.device)[mask]
                    agree = [(ids[mask][:, :, None] == target[:, None, :]).any(-1).sum() for ids in (used, natural)]
                    self.counts += torch.tensor(
                        [float(agree[0]), float(agree[1]), float(target.numel())], dtype=torch.float64
                    )
            return probs, used

    return CountingReplay, RouterReplayAction


def token_sources(mb: dict, layout: Any, *, tp_size: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """``[n]``: for each token this rank's routers see in micro-batch ``mb`` (in the order they route
    them), its flat index into ``mb``'s ``[b, s]`` (``row * s + column``), or -1 for padding the layout
    added. ``layout``: the micro-batch's ``PackedLayout`` (THD, ``[1, t]``: row i's k-th valid token at
    ``starts[i] + k``) or padded ``Layout`` (left-aligned rows, routed as ``[s', b]``), either with this
    rank's CP share; ``tp_size`` / ``tp_rank``: the contiguous sequence slice of sequence parallelism."""
    mask = mb["attention_mask"].bool().cpu()
    b, s = mask.shape
    lengths = mask.sum(-1)
    shift = (mask.long().cumsum(-1) == 0).sum(-1)  # leading pads
    if hasattr(layout, "starts"):
        full = torch.full((layout.seq_len,), -1, dtype=torch.long)
        rows = torch.arange(b).repeat_interleave(lengths)
        within = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths)[rows]
        full[layout.starts.cpu()[rows] + within] = rows * s + shift[rows] + within
        if layout.cp_size > 1:
            full = full[layout.cp_indices[dist.get_rank(layout.cp_group)].cpu()]
        full = full[:, None]  # [t, 1]
    else:
        j = torch.arange(layout.seq_len)[:, None]
        full = torch.where(
            j < lengths[None], torch.arange(b)[None] * s + shift[None] + j, torch.full((), -1, dtype=torch.long)
        )
        if layout.cp_size > 1:
            full = full[layout.local_index.cpu()]
    if tp_size > 1:
        full = full.chunk(tp_size, dim=0)[tp_rank]
    return full.reshape(-1)


class RoutingReplay:
    """The routers of one engine's model chunks (built with ``moe_enable_routing_replay``).

    Args:
        chunks: the engine's model chunks (DDP-wrapped or not).
        num_layers: transformer layers of the whole model (the field's layer axis).
        num_experts: routed experts per layer.
        topk: experts per token.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], *, num_layers: int, num_experts: int, topk: int):
        from megatron.core.transformer.moe.router import TopKRouter

        counting, self.action = _replay_classes()
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.dtype = routing_dtype(num_experts)
        self.routers: dict[int, list[tuple[int, Any]]] = {}
        """id(chunk) -> [(layer index, replay state)] of its routers."""
        for chunk in chunks:
            found = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.router_replay is None:
                        raise ValueError("the model was built without TransformerConfig.moe_enable_routing_replay")
                    instances = type(module.router_replay).global_router_replay_instances
                    if module.router_replay in instances:  # no process-wide list that grows with every model built
                        instances.remove(module.router_replay)
                    module.router_replay = counting()  # Megatron's own, plus the agreement counts
                    found.append((int(module.layer_number) - 1, module.router_replay))
            self.routers[id(chunk)] = found
            self.routers[id(_unwrap(chunk))] = found
        # A pipeline stage may hold only dense layers (a model whose first layers are dense): no routers.

    def all_states(self) -> list[Any]:
        """Every router's replay state on this rank."""
        seen, out = set(), []
        for found in self.routers.values():
            for _, state in found:
                if id(state) not in seen:
                    seen.add(id(state))
                    out.append(state)
        return out


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class RoutingSession:
    """One ``forward`` / ``train_step`` call's recording or replay over its micro-batches.

    Args:
        replay: the engine's ``RoutingReplay``.
        action: ``"record"`` or ``"replay"``.
        micro_batches: the call's micro-batches (``replay``: each holds ``routed_experts``).
        sample_index: per micro-batch, the batch rows it holds (``MicroBatchPlan.indices``).
        batch_size / seq_len: the batch's ``[b, s]`` (``record``: the field's shape).
        mesh: the engine's mesh; ``sequence_parallel``: the router sees a TP slice of the sequence.
        forward_only: no backward passes (``replay``: no ids kept for activation recompute).
    """

    def __init__(
        self,
        replay: RoutingReplay,
        action: str,
        *,
        micro_batches: Sequence[dict],
        sample_index: Sequence[Sequence[int]],
        batch_size: int,
        seq_len: int,
        mesh: Any,
        sequence_parallel: bool,
        forward_only: bool,
    ):
        if action not in ("record", "replay"):
            raise ValueError(f"action={action!r}; choose 'record' or 'replay'")
        if action == "replay":
            for mb in micro_batches:
                if ROUTED_EXPERTS not in mb:
                    raise ValueError(
                        f"router replay needs the batch field {ROUTED_EXPERTS!r} (recorded by the "
                        "old-log-prob pass under R2, returned by the rollout under R3)"
                    )
        self.replay, self.action, self.mesh = replay, action, mesh
        self.sample_index = [torch.as_tensor(list(ix), dtype=torch.long) for ix in sample_index]
        self.seq_len, self.forward_only = seq_len, forward_only
        self.sequence_parallel = sequence_parallel and mesh.size("tp") > 1
        self.micro_batches = micro_batches
        self.recorded = None
        if action == "record":
            self.recorded = torch.zeros(batch_size, seq_len, replay.num_layers, replay.topk, dtype=replay.dtype)
        for state in replay.all_states():
            state.clear_indices()
            state.counts.zero_()
            state.set_router_replay_action(replay.action.RECORD if action == "record" else replay.action.REPLAY_FORWARD)

    def token_sources(self, mb: dict, layout: Any) -> torch.Tensor:
        """``token_sources`` of this rank (its TP slice under sequence parallelism)."""
        tp = (self.mesh.size("tp"), self.mesh.tp_rank) if self.sequence_parallel else (1, 0)
        return token_sources(mb, layout, tp_size=tp[0], tp_rank=tp[1])

    # -- around each micro-batch's forward on a chunk -------------------------------------------
    def before_forward(self, chunk: Any, index: int, mb: dict, layout: Any) -> None:
        """Replay: hand this chunk's routers the micro-batch's target ids (``[n, topk]`` int64)."""
        if self.action != "replay":
            return
        routers = self.replay.routers.get(id(chunk), [])
        if not routers:
            return
        src = self.token_sources(mb, layout)
        valid = src >= 0
        routed = mb[ROUTED_EXPERTS].reshape(-1, *mb[ROUTED_EXPERTS].shape[2:])  # [b * s, L, k]
        filler = torch.arange(self.replay.topk, dtype=torch.long)
        picked = routed[src.clamp(min=0).to(routed.device)].long().cpu()  # [n, L, k]
        picked[~valid] = filler
        for layer, state in routers:
            state.set_target_indices(picked[:, layer].contiguous().to(mb["input_ids"].device))
            state.count_mask = valid
            state.set_router_replay_action(self.replay.action.REPLAY_FORWARD)

    def after_forward(self, chunk: Any, index: int, mb: dict, layout: Any) -> None:
        """Record: copy this chunk's routers' ids into the field; replay: recompute pops in order."""
        routers = self.replay.routers.get(id(chunk), [])
        if not routers:
            return
        if self.action == "replay":
            if not self.forward_only:
                for _, state in routers:
                    state.set_router_replay_action(self.replay.action.REPLAY_BACKWARD)
            return
        src = self.token_sources(mb, layout)
        valid = src >= 0
        s = mb["attention_mask"].shape[1]
        flat = src[valid]
        rows = self.sample_index[index][flat // s]
        cols = flat % s
        for layer, state in routers:
            ids = state.get_recorded_indices()
            if ids is None:
                raise RuntimeError(f"router of layer {layer} recorded nothing for micro-batch {index}")
            self.recorded[rows, cols, layer] = ids.cpu()[valid].to(self.recorded.dtype)

    # -- after the schedule ------------------------------------------------------------------------
    def close(self) -> tuple[Optional[torch.Tensor], dict[str, float]]:
        """Free every router's ids; the recorded field (complete on every rank of the model) and,
        after a replay, the agreement fractions ``{"used": ..., "natural": ...}`` over all ranks."""
        states = self.replay.all_states()
        counts = sum((state.counts for state in states), torch.zeros(3, dtype=torch.float64))
        for state in states:
            state.clear_indices()
            state.clear_router_replay_action()
            state.count_mask = None
        device = _device()
        recorded, metrics = self.recorded, {}
        if recorded is not None:
            recorded = recorded.to(device)
            for axis in ("tp", "cp", "pp"):  # partial fields -> whole (each element has one writer)
                if axis == "tp" and not self.sequence_parallel:
                    continue
                if self.mesh.size(axis) > 1:
                    dist.all_reduce(recorded, group=getattr(self.mesh, f"{axis}_group"))
            recorded = recorded.cpu()
        if self.action == "replay":
            counts = counts.to(device)
            for axis in ("dp", "cp", "pp", "tp"):  # the whole model; TP duplicates scale both sums alike
                if self.mesh.size(axis) > 1:
                    dist.all_reduce(counts, group=getattr(self.mesh, f"{axis}_group"))
            total = float(counts[2])
            metrics = {
                "used": float(counts[0]) / total if total else float("nan"),
                "natural": float(counts[1]) / total if total else float("nan"),
            }
        self.recorded = None
        return recorded, metrics


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# -- the run's checks and files (called by the trainer) ------------------------------------------
ACTOR_KEY = "actor_rollout_ref.actor.megatron.router_replay"
REF_KEY = "actor_rollout_ref.ref.megatron.router_replay"


def check_run_router_replay(
    actor_mode: str, ref_mode: Optional[str], *, is_moe: bool, rollout_lacks: Optional[str]
) -> None:
    """ValueError, before any worker starts, for a run whose router replay cannot work: a mode not in
    ``MODES``, replay on a dense policy, R3 with a rollout engine that cannot return the experts it
    routed to (``rollout_lacks`` says why; None: it can), or a reference replaying routing that no
    pass provides (R2 needs the actor to record: actor mode R2). ``ref_mode`` None: no reference runs."""
    check_router_replay(actor_mode, key=f"{ACTOR_KEY}.mode", is_moe=is_moe, model="the policy")
    if ref_mode is not None:
        check_router_replay(ref_mode, key=f"{REF_KEY}.mode", is_moe=is_moe, model="the policy")
    for key, mode in ((ACTOR_KEY, actor_mode), (REF_KEY, ref_mode)):
        if mode == "R3" and rollout_lacks is not None:
            raise ValueError(
                f"{key}.mode='R3' replays the experts the rollout engine routed each token to, but "
                f"{rollout_lacks}; use mode=R2 (replay the old-log-prob pass's routing) or disabled"
            )
    if ref_mode == "R2" and actor_mode != "R2":
        raise ValueError(
            f"{REF_KEY}.mode='R2' replays the routing the actor's old-log-prob pass records, but "
            f"{ACTOR_KEY}.mode={actor_mode!r} records none; set both to R2"
        )


def _step_path(path: str, step: int) -> str:
    return path.replace("{step}", str(step))


def save_routing(path: str, step: int, batch: Any) -> str:
    """``torch.save`` the step's ``routed_experts`` with ``input_ids`` / ``attention_mask`` (``{step}``
    in ``path`` is replaced by ``step``); the file's path."""
    import os

    target = _step_path(os.path.expanduser(path), step)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    payload = {
        "global_step": step,
        ROUTED_EXPERTS: batch[ROUTED_EXPERTS].cpu(),
        "input_ids": batch["input_ids"].cpu(),
        "attention_mask": batch["attention_mask"].cpu(),
    }
    torch.save(payload, target + ".tmp")
    os.replace(target + ".tmp", target)  # a reader never sees half a file
    return target
