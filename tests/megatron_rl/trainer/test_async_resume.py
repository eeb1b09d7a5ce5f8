"""Resuming a killed fully-async run: no prompt group lost, none trained twice.

* A property test (deterministic fake clock, as ``test_async_buffer``'s): the rollouter's
  ``DrawLedger`` and the ``ReplayBuffer`` under random generation / training times, lookahead,
  staleness threshold, evictions and DAPO-filtered groups; the run checkpoints after every step and
  is "killed" after step k; a fresh buffer and ledger resume from step k's resume point. Checked:
  the groups trained before the checkpoint plus those trained after the resume are distinct and
  fill every step; nothing evicted or filtered before the checkpoint is trained after it; the
  resumed run re-draws exactly the groups unsettled at the checkpoint first, in order; and where
  no group can be evicted or filtered, the trained sequence equals the uninterrupted run's.
* End to end: ``recipes/grpo_async.yaml`` (separate_async: the rollouter thread, one batch ahead)
  with DAPO dynamic sampling, through the real CLI, SIGKILLed (``kill -9`` of the driver's whole process group, Ray included)
  once step 1's checkpoint is on disk, then the same command again. The sample ids of
  ``async_samples.jsonl`` (``<epoch>-<row>/<j>``) equal an uninterrupted run's, none twice
  (rewards are not compared: the rollouter thread's timing decides which weights generate what).
  Validation (``trainer.test_freq``) runs in the same async runs and logs its metrics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.trainer.replay_buffer import DrawLedger, Group, ReplayBuffer
from tests.megatron_rl.trainer.test_resume import logged_step
from tests.megatron_rl.trainer.test_resume import _env  # noqa: E402  (the CLI runs' environment)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


def simulate(
    batch, chunk, lookahead, threshold, strategy, gen_times, train_times, steps, filtered, start=0, settled_before=()
):
    """``steps`` trainer steps drawing prompt ``p<i>`` from position ``start``, checkpointing after each.

    Returns ``(trained per step, submitted uids, checkpoints)``; ``checkpoints[k]`` = (resume point,
    uids trained, evicted and filtered up to step k, uids drawn up to then)."""
    buf, ledger = ReplayBuffer(batch, lookahead, threshold, strategy), DrawLedger(settled_before)
    pos, clock, rollout_version, trainer_version = start, 0.0, 0, 0
    gen_end = gen_groups = gen_version = train_end = None
    push_pending, g_i, t_i, done, carry = False, 0, 0, 0, []
    trained, submitted, dropped, drawn, checkpoints = [], [], [], [], {}
    while done < steps:
        if gen_end is None and not push_pending and buf.budget() >= 1:  # as Rollouter._submit_one
            if not carry:
                while True:
                    before, uids = {"pos": pos}, [f"p{pos + i}" for i in range(chunk)]
                    pos += chunk
                    drawn += uids
                    keep, skipped = ledger.split(uids)
                    carry = [Group(uid=uids[i]) for i in keep]
                    ledger.record(before, carry, skipped)
                    if carry:
                        break
            groups, carry = carry[: buf.budget()], carry[buf.budget() :]
            buf.reserve(groups)
            submitted += [g.uid for g in groups]
            gen_end, gen_groups, gen_version = clock + gen_times[g_i % len(gen_times)], groups, rollout_version
            g_i += 1
        if train_end is None and not push_pending and buf.ready(trainer_version):
            groups, _ = buf.take(trainer_version)
            dropped += buf.last_evicted
            trained.append([g.uid for g in groups])
            train_end = clock + train_times[t_i % len(train_times)]
            t_i += 1
        clock = min(t for t in (gen_end, train_end) if t is not None)
        pushed = False
        if gen_end == clock:
            for g in gen_groups:
                if int(g.uid[1:]) in filtered:  # DAPO: no signal in the group
                    buf.discard(g, "filtered")
                    dropped.append(g.uid)
                else:
                    buf.put(g, gen_version)
            gen_end = None
            if push_pending:
                rollout_version, push_pending, pushed = trainer_version, False, True
        if train_end == clock:
            train_end, trainer_version = None, trainer_version + 1
            if gen_end is None:
                rollout_version, pushed = trainer_version, True
            else:
                push_pending = True
        if pushed:
            buf.step_done()
            done += 1
            checkpoints[done] = (
                ledger.resume_point({"pos": pos}),
                [u for s in trained for u in s],
                list(dropped),
                list(drawn),
            )
    return trained, submitted, checkpoints


durations = st.lists(st.floats(min_value=0.01, max_value=10.0, allow_nan=False), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 3),
    chunk_div=st.booleans(),
    lookahead=st.integers(0, 3),
    threshold=st.one_of(st.none(), st.integers(0, 3)),
    strategy=st.sampled_from(["drop", "wait"]),
    gen_times=durations,
    train_times=durations,
    steps=st.integers(2, 8),
    kill=st.integers(1, 7),
    filtered=st.sets(st.integers(0, 40), max_size=12),
    refiltered=st.sets(st.integers(0, 40), max_size=12),
)
def test_resume_point_loses_no_group_and_trains_none_twice(
    batch, chunk_div, lookahead, threshold, strategy, gen_times, train_times, steps, kill, filtered, refiltered
):
    chunk, kill = (1 if chunk_div else batch), min(kill, steps - 1)
    args = (batch, chunk, lookahead, threshold, strategy, gen_times, train_times)
    full, _, checkpoints = simulate(*args, steps, filtered)
    point, trained_before, dropped_before, drawn_before = checkpoints[kill]
    # the resumed run: another clock (the rollouts are generated again) and other groups filtered
    resumed, resubmitted, _ = simulate(
        *args[:5],
        train_times,
        gen_times,
        steps - kill,
        refiltered,
        start=point["dataloader"]["pos"],
        settled_before=point["settled_uids"],
    )
    after = [u for s in resumed for u in s]
    everything = trained_before + after
    assert len(everything) == len(set(everything)) == steps * batch  # every step full, no group twice
    assert not set(after) & set(dropped_before)  # evicted / filtered before the checkpoint never come back
    settled = set(trained_before) | set(dropped_before)
    unsettled = [u for u in drawn_before if u not in settled]  # in flight or queued at the checkpoint
    m = min(len(unsettled), len(resubmitted))
    assert resubmitted[:m] == unsettled[:m]  # re-generated first, in their order: none lost
    if not filtered and not refiltered and (strategy == "wait" or threshold is None or threshold >= lookahead):
        assert everything == [u for s in full for u in s]  # nothing can be evicted: the uninterrupted run's groups


def test_ledger_resume_point_by_hand():
    """Two batches of two groups; the second partly settled (one evicted): the resume point is before
    the second batch, with the evicted one left out; a ledger built from it skips it."""
    ledger = DrawLedger()
    a, b = [Group(uid="0-0"), Group(uid="0-1")], [Group(uid="0-2"), Group(uid="0-3")]
    ledger.record({"pos": 0}, a)
    ledger.record({"pos": 2}, b)
    assert ledger.resume_point({"pos": 4}) == {"dataloader": {"pos": 0}, "settled_uids": []}
    for g in a:
        g.state = "taken"
    b[0].state = "evicted"
    assert ledger.resume_point({"pos": 4}) == {"dataloader": {"pos": 2}, "settled_uids": ["0-2"]}
    b[1].state = "taken"
    assert ledger.resume_point({"pos": 4}) == {"dataloader": {"pos": 4}, "settled_uids": []}
    again = DrawLedger(["0-2"])
    assert again.split(["0-2", "0-3"]) == ([1], ["0-2"])
    again.record({"pos": 2}, [Group(uid="0-3")], ["0-2"])
    assert again.resume_point({"pos": 4}) == {"dataloader": {"pos": 2}, "settled_uids": ["0-2"]}


# ------------------------------------------------------------------------------------ end to end
REWARD = """
import random


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # answers starting with an even digit: one score for every response (DAPO filters the group);
    # the others: a random score, so their groups always carry a signal (and are never filtered)
    flat = int(str(ground_truth).split()[0]) % 2 == 0
    return {"score": 0.5 if flat else random.random(), "flat": float(flat)}
"""


def _command(out_dir: Path, reward: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_rl.cli",
        "train",
        "grpo_async",
        "--no-progress",
        "trainer.total_training_steps=2",
        "trainer.sft_warmup_steps=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=2",
        "data.val_max_samples=4",
        "trainer.save_freq=1",
        f"trainer.default_local_dir={out_dir}",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "reward.reward_fn=null",
        f"reward.custom_reward_function.path={reward}",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward",
    ]


def _ledger(out_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "async_samples.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == len({r["step"] for r in rows}), rows  # one line per step, a re-run step replaced
    return {r["step"]: r for r in rows}


def test_killed_separate_async_run_resumes_with_the_same_sample_ids(tmp_path):
    """The uninterrupted run (A) and the run to kill (B) start together; B is SIGKILLed once step 1's
    checkpoint is on disk (step 2 and the next batches in flight or queued), then resumed (C).
    DAPO filtering is on: prompts whose answer starts with an even digit are always filtered, the
    others never, so the trained ids do not depend on the generations."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    a, b = tmp_path / "a", tmp_path / "b"
    run_a = subprocess.Popen(
        _command(a, reward),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    proc = subprocess.Popen(
        _command(b, reward),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    try:
        while not ((b / "global_step_1" / "trainer_state.json").is_file() and logged_step(b, 1)):
            assert proc.poll() is None, f"run B ended before step 1 was saved:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "run B did not save step 1 in time"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9: the driver, its rollouter thread, Ray and the workers
        out_a, _ = run_a.communicate(timeout=600)
    finally:
        proc.wait(timeout=60)
        if run_a.poll() is None:
            os.killpg(run_a.pid, signal.SIGKILL)
            run_a.wait(timeout=60)
    assert run_a.returncode == 0, out_a[-3000:]
    assert not (b / "global_step_2").exists(), "the kill came too late: step 2 was already saved"
    state = json.loads((b / "global_step_1" / "trainer_state.json").read_text())
    assert "async_settled_uids" in state  # the queue's resume point is in the checkpoint
    before_kill = _ledger(b)

    resumed = subprocess.run(_command(b, reward), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {b / 'global_step_1'} at step 1" in resumed.stdout

    rows_a, rows_b = _ledger(a), _ledger(b)
    assert sorted(rows_a) == sorted(rows_b) == [1, 2]
    assert rows_b[1] == before_kill[1]  # step 1 is the killed run's
    flat_a = [s for step in (1, 2) for s in rows_a[step]["trained"]]
    flat_b = [s for step in (1, 2) for s in rows_b[step]["trained"]]
    assert len(flat_b) == len(set(flat_b)) == 2 * 2 * 4  # 2 steps x 2 prompt groups x 4 samples, none twice
    assert set(flat_b) == set(flat_a)
    filtered_a = {s for r in rows_a.values() for s in r["filtered"]}
    assert filtered_a and not filtered_a & set(flat_a)  # DAPO filtered groups in the run, never trained
    assert not set(rows_b[1]["filtered"]) & set(rows_b[2]["trained"])  # filtered before the kill: never back
    for out_dir in (a, b):  # validation ran in the async loop and logged verl's val metric; no flat group trained
        rows = {r["step"]: r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}
        assert "val-core/toy_reverse/reward/mean@1" in rows[2], rows[2]
        assert rows[1]["reward/flat/mean"] == rows[2]["reward/flat/mean"] == 0.0


def test_group_filter_bounds_generation_batches_beyond_the_window():
    """DAPO in the async loop: max_num_gen_batches counts the prompt batches finished since the trainer's
    last take beyond those the window generates ahead; the metrics are verl's filter_groups/*."""
    import types

    from megatron_rl.trainer.async_records import GroupFilter

    filt = GroupFilter(types.SimpleNamespace(metric="score", max_num_gen_batches=2), batch_groups=2, ahead_batches=1)
    for i in range(3):  # 3 batches of 2 groups, one kept: within 2 + 1 ahead
        filt.batches += 1
        filt.count(f"0-{2 * i}", kept=i == 0)
        filt.count(f"0-{2 * i + 1}", kept=False)
    filt.check_rounds()
    filt.batches += 1
    with pytest.raises(
        RuntimeError,
        match="4 generation batches since the last step gave 1 informative prompt groups, "
        "fewer than data.train_batch_size=2 .*max_num_gen_batches=2, plus 1",
    ):
        filt.check_rounds()
    assert filt.take_metrics() == {
        "filter_groups/num_gen_batches": 4.0,
        "filter_groups/kept_group_ratio": 1 / 6,
        "filter_groups/num_filtered_groups": 5.0,
    }
    assert (
        filt.filtered_uids == ["0-1", "0-2", "0-3", "0-4", "0-5"]
        and filt.take_metrics()["filter_groups/num_gen_batches"] == 0
    )
