"""Packing and token budgets below the layouts: how micro-batches are formed, how rows become one
THD sequence and back, and the outputs of every head packed vs padded.

``test_engine.py`` proves packed / token-budget training equals padded single-rank under every
parallel layout; here: Karmarkar-Karp partitions, budgets (every micro-batch within it, outputs
back in the batch's order, one count agreed over DP ranks, errors that name both numbers), the
packed layout (positions restart per row, alignment once per sequence, CP zigzag per row), and
the reward model's scores, the teacher's top-k and the actor's / critic's forward outputs under
three budgets against padded micro-batches.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.engine.batching import (
    MicroBatchPlan,
    balanced_partitions,
    fixed_micro_batches,
    karmarkar_karp,
    token_budget_micro_batches,
)
from megatron_rl.engine.engine import MegatronEngine
from megatron_rl.engine.packing import pack_micro_batch, packed_length, row_lengths
from parallel.testing import run_distributed
from tests.megatron_rl.engine.test_engine import BATCH, DENSE, PROMPT, RESPONSE, make_batch, make_role
from tests.numerics import assert_within, gpt_forward_terms, max_abs_diff, rounding_bound

LENGTHS = [11, 1, 9, 7, 5, 1, 5, 11]  # the ragged batch of test_engine (prompt + response tokens)
KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


# -- partitions and budgets -------------------------------------------------------------------
def test_karmarkar_karp_balances_and_covers_every_index():
    groups = balanced_partitions(list(range(1, 9)), 2, equal_size=True)
    assert [sum(i + 1 for i in g) for g in groups] == [18, 18] and [len(g) for g in groups] == [4, 4]
    assert sorted(i for g in groups for i in g) == list(range(8))
    uneven = karmarkar_karp([10, 1, 1, 1, 1, 6], 2, equal_size=False)
    assert sorted(sum([10, 1, 1, 1, 1, 6][i] for i in g) for g in uneven) == [10, 10]
    with pytest.raises(ValueError, match=r"^7 items cannot be split into 2 equal-sized groups$"):
        karmarkar_karp([1] * 7, 2, equal_size=True)


@pytest.mark.parametrize("budget", [11, 16, 32])
def test_token_budget_micro_batches_fit_the_budget_and_restore_the_order(budget):
    plan = token_budget_micro_batches(LENGTHS, budget, budget_key=KEY)
    sums = [sum(LENGTHS[i] for i in mb) for mb in plan.indices]
    assert max(sums) <= budget and sorted(i for mb in plan.indices for i in mb) == list(range(8))
    assert len(plan) == {11: 5, 16: 4, 32: 2}[budget]  # ceil(50 / budget), raised only if the partition does not fit
    values = torch.arange(8.0)[:, None] * 10
    parts = plan.split({"x": values})
    assert torch.equal(plan.restore(torch.cat([p["x"] for p in parts])), values)
    assert len(token_budget_micro_batches(LENGTHS, budget, multiple_of=4)) % 4 == 0


def test_fixed_micro_batches_and_budget_errors_name_both_numbers():
    assert fixed_micro_batches(5, 2).indices == ((0, 1), (2, 3), (4,))
    assert isinstance(fixed_micro_batches(5, 2), MicroBatchPlan)
    with pytest.raises(
        ValueError,
        match=rf"^a sample of 11 tokens is longer than the token budget {KEY}=10; "
        rf"raise {KEY} to at least 11$",
    ):
        token_budget_micro_batches(LENGTHS, 10, budget_key=KEY)
    with pytest.raises(
        ValueError,
        match=rf"^{KEY}=3 needs 4 micro-batches on every data-parallel rank \(a multiple "
        rf"of 4\), but a rank holds only 2 samples",
    ):
        token_budget_micro_batches([3, 3], 3, multiple_of=4, budget_key=KEY)


def test_engine_refuses_budgets_it_cannot_honour():
    tf = types.SimpleNamespace(pipeline_model_parallel_size=2)
    batch = make_batch(DENSE["vocab_size"], ragged=True)
    sp = types.SimpleNamespace(
        name="actor",
        model=[None],
        tf_config=tf,
        remove_padding=True,
        token_alignment=2,
        cp_size=1,
        mesh=types.SimpleNamespace(dp_group=None),
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match=rf"^{KEY}=15 is not a multiple of 2, the packed-sequence alignment"):
        MegatronEngine.plan_micro_batches(sp, batch, max_token_len=15, budget_key=KEY)
    vpp = types.SimpleNamespace(**{**vars(sp), "model": [None, None], "remove_padding": False})
    with pytest.raises(
        ValueError, match=rf"^{KEY}: token-budget micro-batches under the interleaved pipeline schedule"
    ):
        MegatronEngine.plan_micro_batches(vpp, batch, max_token_len=16, budget_key=KEY)
    with pytest.raises(ValueError, match=r"^the 'actor' engine needs micro_batch_size or max_token_len$"):
        MegatronEngine.plan_micro_batches(sp, batch)
    plan = MegatronEngine.plan_micro_batches(
        vars(sp) and types.SimpleNamespace(**{**vars(sp), "model": [None, None]}),
        batch,
        max_token_len=16,
        budget_key=KEY,
    )
    assert len(plan) % 2 == 0  # interleaved schedule: a multiple of the pipeline size


# -- the packed layout --------------------------------------------------------------------------
def test_packed_rows_restart_positions_and_map_back_to_responses():
    batch = make_batch(DENSE["vocab_size"], ragged=True)
    batch["attention_mask"][5] = 0  # a row without any token leaves no segment
    ids, pos, params, layout = pack_micro_batch(batch, tp_multiple=4)
    lengths = [11, 1, 9, 7, 5, 0, 5, 11]
    assert ids.shape == (1, 52) and packed_length(batch["attention_mask"], tp_multiple=4) == 52  # 49 -> 4 * 13
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 11, 12, 21, 28, 33, 38, 52]
    assert params.max_seqlen_q == 14  # the last row's segment holds its 11 tokens + 3 alignment pads
    starts = [0, 11, 12, 21, 28, 33, 33, 38]
    for row, (start, n) in enumerate(zip(starts, lengths)):
        valid = batch["input_ids"][row][batch["attention_mask"][row].bool()]
        assert torch.equal(ids[0, start : start + n], valid)
        assert pos[0, start : start + n].tolist() == list(range(n))
    # Each scored position predicts the response token it is mapped to.
    got = ids[0, layout.token_index + 1]
    assert torch.equal(got, batch["responses"][layout.rows, layout.cols])
    assert torch.equal(layout.rows.bincount(minlength=BATCH), batch["attention_mask"][:, -RESPONSE:].sum(-1))
    scores = torch.arange(1.0, len(layout.rows) + 1)[None]
    dense = layout.to_responses(scores)
    assert dense.shape == (BATCH, RESPONSE) and torch.equal(layout.from_responses(dense), scores)
    assert float(dense[batch["attention_mask"][:, -RESPONSE:] == 0].abs().sum()) == 0.0
    seq = layout.sequence_values(torch.arange(52.0)[None])
    assert seq.shape == (BATCH, 11) and seq[1, :1].tolist() == [11.0] and float(seq[5].abs().sum()) == 0.0
    assert row_lengths(batch["attention_mask"], cp_size=2) == [12, 4, 12, 8, 8, 0, 8, 12]
    assert pack_micro_batch(batch, pad_to=64)[0].shape == (1, 64)


def _dp_and_cp_case(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    out = {}
    # DP agreement: rank 0 needs 3 micro-batches, rank 1 one; both run 3.
    lengths = [[10, 10, 5], [2, 2, 2]][rank]
    out["count"] = len(token_budget_micro_batches(lengths, 10, dp_group=group))
    try:  # rank 1 holds two samples but rank 0 needs four micro-batches: both ranks raise
        token_budget_micro_batches([[10, 10, 10, 10], [1, 1]][rank], 10, dp_group=group, budget_key=KEY)
        out["error"] = ""
    except ValueError as exc:
        out["error"] = str(exc)
    # CP: every row split into 2 * cp zigzag chunks; the shares reassemble into the packed sequence.
    batch = make_batch(DENSE["vocab_size"], ragged=True)
    ids, _, params, layout = pack_micro_batch(batch, tp_multiple=1, cp_group=group)
    full = pack_micro_batch(batch, tp_multiple=1)[0]  # the same rows on one rank (no CP padding)
    values = ids.float().requires_grad_()
    gathered = layout.gather_sequence(values)
    (gathered * (torch.arange(gathered.shape[1]) + 1.0)).sum().backward()
    out.update(
        local=ids.shape[1],
        seq_len=layout.seq_len,
        cu=params.cu_seqlens_q.tolist(),
        gathered=gathered.detach().long(),
        own=layout.cp_indices[rank],
        grad=values.grad,
        full=full,
        labels=layout.local_labels,
    )
    return out


def test_dp_ranks_agree_on_one_count_and_cp_shares_reassemble():
    results = run_distributed(_dp_and_cp_case, 2)
    assert [r["count"] for r in results] == [3, 3]
    assert all(r["error"].startswith(f"{KEY}=10 needs 4 micro-batches on every data-parallel rank") for r in results)
    r0, r1 = results
    assert r0["cu"] == [0, 12, 16, 28, 36, 44, 48, 56, 68] == r1["cu"]  # rows rounded up to 2 * cp = 4
    assert r0["local"] == r1["local"] == 34 and r0["seq_len"] == 68
    assert torch.equal(r0["gathered"], r1["gathered"])
    assert sorted(torch.cat([r0["own"], r1["own"]]).tolist()) == list(range(68))
    assert r0["own"][:3].tolist() == [0, 1, 2] and r0["own"][3:6].tolist() == [9, 10, 11]  # chunks 0 and 3 of row 0
    for r in results:  # each rank's gradient is its own positions' share
        assert torch.equal(r["grad"][0], r["own"].float() + 1)
    # The valid tokens of every row sit at the same offsets as in the CP-padded sequence.
    starts, lengths = [0, 12, 16, 28, 36, 44, 48, 56], LENGTHS
    single = [0, 11, 12, 21, 28, 33, 34, 39]
    for s, t, n in zip(starts, single, lengths):
        assert torch.equal(r0["gathered"][0, s : s + n], r0["full"][0, t : t + n])


# -- every head, packed vs padded ------------------------------------------------------------
def _heads_case(rank, world_size, ckpt):
    from megatron_rl.config import RewardModelConfig
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.roles import build_role
    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=3)
    batch = make_batch(DENSE["vocab_size"], ragged=True)
    out = {}
    for packed in (False, True):
        budgets = (None, 11, 16, 64) if packed else (None,)
        for budget in budgets:
            dynamic = (
                {} if budget is None else {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": budget}
            )
            tag = (packed, budget)
            actor = make_role(
                "actor", DENSE, mesh, {"ppo_micro_batch_size_per_gpu": 3, **dynamic}, remove_padding=packed
            )
            critic = make_role(
                "critic",
                DENSE,
                mesh,
                {
                    "ppo_micro_batch_size_per_gpu": 3,
                    **({} if budget is None else {"use_dynamic_bsz": True, "forward_max_token_len_per_gpu": budget}),
                },
                remove_padding=packed,
            )
            rm_cfg = RewardModelConfig(
                micro_batch_size_per_gpu=3, use_dynamic_bsz=budget is not None, forward_max_token_len_per_gpu=budget
            )
            rm = build_role("reward", ModelConfig(**DENSE), mesh, rm_cfg, remove_padding=packed)
            for name, role in (("actor", actor), ("critic", critic), ("reward", rm)):
                path = f"{ckpt}_{name}"
                if tag == (False, None):
                    if name != "actor":  # the scalar heads start at zero: give them weights that matter
                        chunk = role.engine.model[0]
                        with torch.no_grad():
                            getattr(chunk, "module", chunk).output_layer.weight.normal_(0, 0.3)
                    save_model(role.engine.model, path)
                else:
                    load_model(role.engine.model, path)
            out[tag] = {
                **actor.compute_log_prob(batch, calculate_entropy=True),
                **actor.compute_topk_log_probs(batch, k=4, temperature=0.8),
                **critic.compute_values(batch),
                **rm.compute_rm_score(batch),
            }
    return out


def test_every_head_packed_with_any_budget_equals_padded(tmp_path):
    out = run_distributed(_heads_case, 1, str(tmp_path / "w"))[0]
    mask = make_batch(DENSE["vocab_size"], ragged=True)["response_mask"].bool()
    ref = out[(False, None)]
    assert float(ref["rm_scores"].abs().min()) > 0 and float(ref["values"][mask].abs().max()) > 0

    def bound(exact):
        """Packed and padded are two float32 forwards, each within eps * n * scale of the exact
        values: twice it apart. A token attending across a packed boundary, or a value read one
        position off, moves them by ~1e-1."""
        return 2 * rounding_bound(gpt_forward_terms(DENSE, PROMPT + RESPONSE), max(1.0, float(exact.abs().max())))

    for tag, got in out.items():
        for key in ("log_probs", "entropys", "values", "topk_log_probs"):
            assert_within(max_abs_diff(got[key][mask], ref[key][mask]), bound(ref[key][mask]), f"packing {tag} {key}")
        assert torch.equal(got["topk_ids"][mask], ref["topk_ids"][mask]), tag
        assert_within(max_abs_diff(got["rm_scores"], ref["rm_scores"]), bound(ref["rm_scores"]), f"packing {tag} rm")


def _te_case(rank, world_size, ckpt):
    from parallel.checkpoint import load_model, save_model
    from parallel.config import ParallelConfig
    from parallel.mesh import init_mesh

    mesh = init_mesh(ParallelConfig(), seed=3)
    batch = make_batch(DENSE["vocab_size"], ragged=True)  # host tensors, as the driver sends them
    out = {}
    for packed in (False, True):
        actor = make_role(
            "actor",
            dict(DENSE, attention_backend="te"),
            mesh,
            {
                "ppo_micro_batch_size_per_gpu": 3,
                "log_prob_use_dynamic_bsz": packed,
                "log_prob_max_token_len_per_gpu": 16,
            },
            remove_padding=packed,
        )
        (load_model if packed else save_model)(actor.engine.model, ckpt)
        out[packed] = actor.compute_log_prob(batch, calculate_entropy=True)
        assert {v.device.type for v in out[packed].values()} == {"cpu"}  # results come back in host memory
    return out


@pytest.mark.gpu
def test_transformer_engine_thd_attention_equals_padded(tmp_path):
    """TE's THD attention (cu_seqlens, padding_causal) on one GPU: packed + token budget equals padded.
    A GPU without Transformer Engine installed (the first H200's image) skips it by name rather than
    failing in a rank's import."""
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed (the [gpu] extra's TE)")
    out = run_distributed(_te_case, 1, str(tmp_path / "te"), backend="nccl")[0]
    mask = make_batch(DENSE["vocab_size"], ragged=True)["response_mask"].bool()
    for key in ("log_probs", "entropys"):
        assert float((out[True][key][mask] - out[False][key][mask]).abs().max()) < 1e-5, key
