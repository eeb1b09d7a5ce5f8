"""Tool configs (verl's YAML), the calculator, the tool-call parser, tool execution and its failures.

Bad input: a tool config naming an unknown class, a schema that is not valid JSON Schema, a tool
that raises, a tool that hangs -- each with its exact message.
"""

from __future__ import annotations

import textwrap
import threading
import time

import pytest

from megatron_rl.config.rollout import AgentLoopConfig, MultiTurnConfig, RolloutConfig
from megatron_rl.rollout.agent.calls import TimedOut, run_calls
from megatron_rl.rollout.agent.loop import ToolAgentLoop, truncate_tool_response
from megatron_rl.rollout.agent.parser import FunctionCall, HermesToolParser
from megatron_rl.rollout.tools import BUILTIN_TOOL_CONFIGS, BaseTool, ToolSchema, load_tools
from megatron_rl.rollout.tools.calculator import evaluate

SCHEMA = """
    tool_schema:
      type: function
      function:
        name: {name}
        description: test tool
        parameters: {parameters}
"""


def _config(
    tmp_path,
    class_name: str,
    parameters: str = "{type: object, properties: {x: {type: integer}}, required: [x]}",
    name: str = "t",
    extra: str = "",
) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(
        f"tools:\n  - class_name: {class_name}\n    config: {{type: native{extra}}}\n"
        + textwrap.indent(textwrap.dedent(SCHEMA.format(name=name, parameters=parameters)), "    ")
    )
    return str(path)


class Hangs(BaseTool):
    """Sleeps far past its timeout."""

    def execute(self, instance_id, parameters):
        time.sleep(30)
        return "never"


class Raises(BaseTool):
    def execute(self, instance_id, parameters):
        raise RuntimeError(f"boom {parameters['x']}")


class Echo(BaseTool):
    released: list = []

    def execute(self, instance_id, parameters):
        return f"x={parameters['x']}"

    def release(self, instance_id):
        Echo.released.append(instance_id)


def test_builtin_configs_load_with_their_schemas():
    assert set(BUILTIN_TOOL_CONFIGS) == {"calculator", "code_interpreter", "calculator_and_code"}
    tools = load_tools("calculator_and_code")
    assert sorted(tools) == ["calculator", "code_interpreter"]
    assert tools["calculator"].tool_schema.to_openai()["function"]["parameters"]["required"] == ["expression"]
    assert tools["code_interpreter"].limits.wall_seconds == 10 and tools["code_interpreter"].timeout == 15.0


def test_unknown_class_is_named(tmp_path):
    path = _config(tmp_path, "no_such_module.Tool")
    with pytest.raises(ValueError) as err:
        load_tools(path)
    assert str(err.value) == (
        f"tool config {path}: tools[0].class_name='no_such_module.Tool' cannot be imported: "
        "No module named 'no_such_module'"
    )
    path = _config(tmp_path, f"{__name__}.Missing")
    with pytest.raises(ValueError) as err:
        load_tools(path)
    assert str(err.value) == (
        f"tool config {path}: tools[0].class_name='{__name__}.Missing' cannot be imported: "
        f"module '{__name__}' has no class 'Missing'"
    )
    path = _config(tmp_path, "megatron_rl.rollout.tools.sandbox.SandboxLimits")
    with pytest.raises(ValueError, match=r"is not a megatron_rl.rollout.tools.BaseTool subclass"):
        load_tools(path)


def test_invalid_json_schema_is_named(tmp_path):
    path = _config(tmp_path, f"{__name__}.Echo", parameters="{type: object, properties: {x: {type: integr}}}")
    with pytest.raises(ValueError) as err:
        load_tools(path)
    assert str(err.value).startswith(
        f"tool config {path}: tools[0].tool_schema.function.parameters is not a valid "
        "JSON Schema: 'integr' is not valid under any of the given schemas"
    )
    path = _config(tmp_path, f"{__name__}.Echo", parameters="{type: array}")
    with pytest.raises(ValueError) as err:
        load_tools(path)
    assert str(err.value) == (
        f"tool config {path}: tools[0].tool_schema.function.parameters.type='array': the "
        "arguments of a function call are an object, so the schema's type must be 'object'"
    )
    with pytest.raises(ValueError, match=r"tool_schema.function.name='two words' must be a non-empty name"):
        ToolSchema.from_dict({"type": "function", "function": {"name": "two words"}})
    with pytest.raises(ValueError, match=r"neither a file nor a built-in tool config; built-in: "):
        load_tools("no_such_config")


def test_calculator_is_exact_and_bounded():
    assert evaluate("48213*9174") == str(48213 * 9174)
    assert (evaluate("7/2"), evaluate("8/2"), evaluate("-(3+4)*2"), evaluate("2**64")) == (
        "3.5",
        "4",
        "-14",
        str(2**64),
    )
    for expression, message in [
        ("2**65", "exponent 65 is larger than 64"),
        ("1/0", "division by zero"),
        ("__import__('os')", "unsupported element Call"),
        ("9" * 201, "more than 200"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
            evaluate(expression)


def test_hermes_parser_reads_calls_and_marks_malformed_ones():
    parser = HermesToolParser()
    text = parser.format("calculator", {"expression": "1+1"})
    assert text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    content, calls = parser.parse(
        "thinking " + text + ' <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
        "</tool_call><tool_call>{oops</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "g", "arguments": [1]}</tool_call><tool_call>{"name"'
    )
    assert content == "thinking"
    assert calls[0] == FunctionCall("calculator", {"expression": "1+1"}, None, calls[0].raw)
    assert calls[1].arguments == {"x": 1} and calls[1].error is None  # OpenAI's JSON-string arguments
    assert [c.error for c in calls[2:]] == [
        "the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 1)",
        'a tool call must be a JSON object {"name": ..., "arguments": {...}} with a string name',
        "the arguments of 'g' must be a JSON object, got list",
        "unclosed <tool_call> (no </tool_call> follows it)",
    ]
    assert parser.parse("42") == ("42", [])


def test_tool_response_truncation_uses_verls_markers():
    text = "0123456789"
    assert truncate_tool_response(text, 4, "left") == "(truncated)...6789"
    assert truncate_tool_response(text, 4, "right") == "0123...(truncated)"
    assert truncate_tool_response(text, 4, "middle") == "01...(truncated)...89"
    assert truncate_tool_response(text, 10, "middle") == text


def _loop(tools, **multi_turn):
    cfg = RolloutConfig(multi_turn=MultiTurnConfig(**multi_turn), agent=AgentLoopConfig(num_workers=2))

    class NoChat:  # the loop's tool execution does not render anything
        eos_token_id = 0

    return ToolAgentLoop(NoChat(), tools, cfg.multi_turn, cfg.agent, cfg)


def test_failing_calls_become_error_observations_with_exact_messages(tmp_path):
    tools = load_tools(_config(tmp_path, f"{__name__}.Raises"))
    tools.update(load_tools(_config(tmp_path, f"{__name__}.Echo", name="echo")))
    tools.update(load_tools(_config(tmp_path, f"{__name__}.Hangs", name="hang", extra=", timeout: 0.5")))
    loop = _loop(tools)
    call = lambda name, args: loop._call(FunctionCall(name, args), tools.get(name))  # noqa: E731
    assert call("t", {"x": 3}).text == "Error executing tool 't': boom 3"
    assert call("t", {"x": 3}).error
    assert call("nope", {}).text == "Unknown function 'nope'. Available tools: ['echo', 'hang', 't']"
    assert (
        call("echo", {"x": "a"}).text
        == "Invalid arguments for 'echo': 'a' is not of type 'integer' (at arguments['x'])"
    )
    assert call("echo", {}).text == "Invalid arguments for 'echo': 'x' is a required property"
    Echo.released.clear()
    assert (call("echo", {"x": 2}).text, call("echo", {"x": 2}).error, len(Echo.released)) == ("x=2", False, 2)
    malformed = FunctionCall(None, None, "the tool call is not valid JSON (Expecting value at character 0)")
    assert loop._call(malformed, None).text == "Error: the tool call is not valid JSON (Expecting value at character 0)"
    # A hanging tool costs its timeout; the other calls of the round still run, at most 2 at a time.
    start = time.monotonic()
    before = threading.active_count()
    jobs = [lambda: call("hang", {"x": 1})] + [lambda i=i: call("echo", {"x": i}) for i in range(5)]
    results = run_calls(jobs, [tools["hang"].timeout] + [5.0] * 5, max_workers=2)
    assert 0.4 < time.monotonic() - start < 5
    assert isinstance(results[0], TimedOut) and results[0].seconds == 0.5
    assert [r.text for r in results[1:]] == [f"x={i}" for i in range(5)]
    assert threading.active_count() <= before + 1  # only the abandoned daemon thread is left
