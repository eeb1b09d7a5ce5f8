"""MoE router replay (R2) on real Megatron-Core with gloo ranks: the update routes exactly as the
old-log-prob pass did, whatever the router weights became, at EP=2, TP=2 x EP=2 (sequence
parallel; expert TP 1) on the packed THD layout and PP=2 on padded rows (``use_remove_padding=False``).

One spawn per layout runs every assertion: (1) the recorded ``routed_experts`` equal the
single-rank recording of the same weights (the layout mapping is right, not just self-consistent);
(2) a replayed update on unchanged weights gives its first micro-batch exactly the old-log-prob
pass's log-probs and routes exactly as recorded; (3) after the router weights are perturbed, a
replayed update still routes exactly as recorded (``router_agreement/used`` 1.0, the natural
agreement below 1) and the routers still get gradients; (4) with replay off the routing differs.
Routing is compared through forward hooks on Megatron's ``TopKRouter`` (its ``routing_map``). A spawn
without a model checks ``token_sources`` (which token each routed position is) under CP=2 and SP too.
"""

from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed

MOE = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    max_position_embeddings=64,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_aux_loss_coeff=0.0,
)
BATCH, PROMPT, RESPONSE = 8, 6, 5
PROMPT_LENS, RESPONSE_LENS = [6, 6, 3, 4, 1, 2, 5, 6], [5, 5, 2, 1, 4, 3, 5, 4]
"""The two rows of each micro-batch are equally long (and hold an even number of tokens): neither
padded rows nor sequence parallelism at TP=2 add padding, so every routed token is a real one and
routing maps compare whole."""
ROUTER_SCALE = 20.0  # wide router logits: no near-ties whose top-k could flip between layouts
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "clip_grad": 0.0}
ACTOR = dict(ppo_mini_batch_size=BATCH, ppo_micro_batch_size_per_gpu=2, rollout_n=1, optim=SGD, shuffle=False)


def make_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses of varying lengths."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (BATCH, PROMPT), generator=g)
    responses = torch.randint(1, vocab, (BATCH, RESPONSE), generator=g)
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - torch.tensor(PROMPT_LENS)[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < torch.tensor(RESPONSE_LENS)[:, None]).long()
    return {
        "input_ids": torch.cat([prompts, responses], 1) * torch.cat([prompt_mask, response_mask], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "responses": responses * response_mask,
        "response_mask": response_mask,
        "advantages": torch.randn(BATCH, RESPONSE, generator=g),
    }


def _routers(engine):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in engine.model for m in chunk.modules() if isinstance(m, TopKRouter)]


class _RoutingMaps:
    """Every ``TopKRouter`` call's ``routing_map`` ([tokens, experts] bool), in call order."""

    def __init__(self, engine):
        self.maps: list[torch.Tensor] = []
        self.handles = [
            r.register_forward_hook(lambda m, i, out: self.maps.append(out[1].detach().clone()))
            for r in _routers(engine)
        ]

    def take(self) -> list[torch.Tensor]:
        maps, self.maps = self.maps, []
        return maps


def _case(rank, world_size, par, ckpt, save):
    import torch.distributed as dist

    from megatron_rl.config import ActorConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.engine.router_replay import ROUTED_EXPERTS
    from megatron_rl.roles import build_role
    from megatron_rl.roles.lm_head import response_log_probs
    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    par = dict(par)
    remove_padding = par.pop("remove_padding", True)  # a megatron.* key, not a ParallelConfig field
    mesh = init_mesh(ParallelConfig(**par), seed=1234)
    actor = build_role(
        "actor",
        ModelConfig(**MOE),
        mesh,
        ActorConfig.from_dict(ACTOR),
        routing_replay=True,
        remove_padding=remove_padding,
    )
    engine = actor.engine
    if save:
        save_model(engine.model, ckpt)
    else:
        load_model(engine.model, ckpt)
    with torch.no_grad():
        for router in _routers(engine):
            router.weight.mul_(ROUTER_SCALE)
    batch = make_batch(MOE["vocab_size"])
    dp, dp_rank = mesh.size("dp"), mesh.dp_rank
    batch = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    maps = _RoutingMaps(engine)
    result = {"dp": (dp, dp_rank)}

    # (1) the old-log-prob pass records.
    old = actor.compute_log_prob(batch, routing="record")
    recorded_maps = maps.take()
    result["routed"], result["log_probs"] = old[ROUTED_EXPERTS], old["log_probs"]
    if save:
        return result
    batch = {**batch, "old_log_probs": old["log_probs"], ROUTED_EXPERTS: old[ROUTED_EXPERTS]}
    mini = {k: v for k, v in batch.items()}

    # (2) a replayed update on unchanged weights: first micro-batch's log-probs and all routing as recorded.
    first = {}

    def loss_fn(mb, out, step):
        from megatron_rl.engine.step_info import LossMetrics

        lp, _ = response_log_probs(
            out, mb["responses"], temperature=1.0, entropy=False, chunk_size=actor.config.logprob_chunk_size
        )
        if "lp" not in first:
            first["lp"] = lp.detach().clone()
        loss = (lp * mb["response_mask"]).sum() / max(step.batch_num_tokens, 1) * step.dp_size
        return loss, LossMetrics()

    metrics = engine.train_step(mini, loss_fn, micro_batch_size=2)
    result["first_lp"] = first.get("lp")
    result["same_maps_unchanged"] = _maps_equal(recorded_maps, maps.take())
    result["agree_unchanged"] = metrics["router_agreement/used"], metrics["router_agreement/natural"]

    # (3) perturbed routers: the replayed update still routes as recorded; the routers get gradients.
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)  # the same draw on every rank (router weights are replicated)
        for router in _routers(engine):
            router.weight.add_(ROUTER_SCALE * torch.randn(router.weight.shape, generator=g))
    metrics = actor.update_policy(batch)
    result["same_maps_perturbed"] = _maps_equal(recorded_maps, maps.take())
    result["agree_perturbed"] = (
        metrics["actor/router_agreement/old_vs_update"],
        metrics["actor/router_agreement/old_vs_update_natural"],
    )
    grads = [float(getattr(r.weight, "main_grad", r.weight.grad).abs().sum()) for r in _routers(engine)]
    result["router_grads"] = grads

    # (4) replay off: the routing differs.
    engine.train_step({k: v for k, v in mini.items() if k != ROUTED_EXPERTS}, loss_fn, micro_batch_size=2)
    result["same_maps_off"] = _maps_equal(recorded_maps, maps.take())
    leftovers = [
        s
        for s in engine.routing.all_states()
        if s.target_topk_idx is not None or s.replay_backward_list or s.recorded_topk_idx is not None
    ]
    result["freed"] = not leftovers
    dist.barrier()
    return result


def _maps_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


LAYOUTS = {
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "tp2_ep2": (4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
    "pp2_padded": (2, dict(pipeline_model_parallel_size=2, remove_padding=False)),  # padded rows, not THD
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("router_replay") / "ckpt")
    (ref,) = run_distributed(_case, 1, {}, ckpt, True)
    return ckpt, ref


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_r2_replays_recorded_routing(layout, reference):
    ckpt, ref = reference
    world, par = LAYOUTS[layout]
    results = run_distributed(_case, world, par, ckpt, False)
    mask = make_batch(MOE["vocab_size"])["attention_mask"].bool()
    for rank, res in enumerate(results):
        # (1) recorded routing = the single-rank recording of the same rows (sets of experts per token).
        rows = torch.arange(BATCH).chunk(res["dp"][0])[res["dp"][1]]
        mine, theirs = res["routed"].sort(-1).values, ref["routed"][rows].sort(-1).values
        valid = mask[rows]
        assert res["routed"].shape == (len(rows), PROMPT + RESPONSE, MOE["num_layers"], MOE["moe_router_topk"])
        assert torch.equal(mine[valid], theirs[valid]), f"{layout} rank {rank}: recorded routing differs from 1 rank"
        assert int(res["routed"][~valid].abs().sum()) == 0
        # (2) unchanged weights: the update's first micro-batch = the old-log-prob pass, bit for bit.
        if res["first_lp"] is not None:  # the last pipeline stage computes log-probs
            assert torch.equal(res["first_lp"], res["log_probs"][:2])
        assert res["same_maps_unchanged"]
        assert res["agree_unchanged"] == (1.0, 1.0)
        # (3) perturbed routers: replay still routes as recorded; the natural routing drifted.
        assert res["same_maps_perturbed"]
        used, natural = res["agree_perturbed"]
        assert used == 1.0 and 0.0 < natural < 1.0, res["agree_perturbed"]
        assert all(g > 0 for g in res["router_grads"]), res["router_grads"]
        # (4) replay off: the routing differs (so this test can fail).
        assert not res["same_maps_off"]
        assert res["freed"]


def _token_sources_case(rank, world_size):
    """Every layout's router tokens, mapped back by ``token_sources``, are the tokens the rank feeds the
    model: packed / padded, whole or split over 2 CP ranks (zigzag), whole or cut into TP=2 SP slices."""
    import torch.distributed as dist

    from megatron_rl.engine.batch_layout import prepare_inputs
    from megatron_rl.engine.packing import pack_micro_batch
    from megatron_rl.engine.router_replay import token_sources

    batch = make_batch(MOE["vocab_size"])
    mb = {k: v[2:6] for k, v in batch.items()}  # rows of 5, 5, 5 and 5 tokens: CP pads each to 8
    flat = mb["input_ids"].reshape(-1)
    group = dist.new_group(list(range(world_size)))
    out = {}
    for name, cp_group in (("whole", None), ("cp2", group)):
        for tp in (1, 2):
            packed_ids, _, _, packed = pack_micro_batch(mb, tp_multiple=tp, cp_group=cp_group)
            padded_ids, _, padded = prepare_inputs(mb, pad_to=0, multiple=tp, cp_group=cp_group)
            # the routers see [s, b] (packed: [t, 1]); sequence parallelism slices the s axis
            for layout_name, ids, layout in (("packed", packed_ids.t(), packed), ("padded", padded_ids.t(), padded)):
                for tp_rank in range(tp):
                    src = token_sources(mb, layout, tp_size=tp, tp_rank=tp_rank)
                    routed = ids.reshape(-1) if tp == 1 else ids.chunk(tp, dim=0)[tp_rank].reshape(-1)
                    valid = src >= 0
                    key = f"{name}/tp{tp}/{layout_name}/{tp_rank}"
                    out[key] = (bool(torch.equal(routed[valid], flat[src[valid]])), src[valid].tolist())
    return out


def test_token_sources_follow_every_layout():
    results = run_distributed(_token_sources_case, 2)
    mask = make_batch(MOE["vocab_size"])["attention_mask"][2:6].reshape(-1).bool()
    every_valid = sorted(torch.nonzero(mask).flatten().tolist())
    for key in results[0]:
        assert all(res[key][0] for res in results), key  # the ids the routers see are the batch's tokens
        split = key.startswith("cp2")
        seen = sorted(
            i
            for res in (results if split else results[:1])
            for k, (_, ids) in res.items()
            if k.rsplit("/", 1)[0] == key.rsplit("/", 1)[0]
            for i in ids
        )
        assert seen == every_valid, key  # each valid token routed exactly once across the CP / SP shares
