"""``CalculatorTool``: exact arithmetic on an expression string, the small example tool.

The expression is parsed with ``ast`` and evaluated by walking the tree -- numbers, ``+ - * / //
% **``, unary signs and parentheses only, never ``eval`` -- with bounds that keep a hostile
expression cheap: at most 200 characters, exponents up to 64 and results up to 200 digits.
Integers stay exact (Python's big ints); ``/`` gives an integer when it divides evenly, else a
float printed with 12 significant digits.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from megatron_rl.rollout.tools.tool_base import BaseTool, ToolSchema

__all__ = ["CalculatorTool", "evaluate"]

MAX_CHARS, MAX_EXPONENT, MAX_DIGITS = 200, 64, 200
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _div(a: int | float, b: int | float) -> int | float:
    if isinstance(a, int) and isinstance(b, int) and b and a % b == 0:
        return a // b
    return a / b


def _walk(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Div)):
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _div(left, right) if isinstance(node.op, ast.Div) else _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"unsupported element {type(node).__name__}: only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text (ValueError for anything but bounded arithmetic)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("the expression is empty")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters, more than {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot parse {expression!r}: {err.msg}") from None
    try:
        value = _walk(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None
    return format(value, ".12g") if isinstance(value, float) else str(value)


class CalculatorTool(BaseTool):
    """Evaluates ``{"expression": "48213 * 9174"}`` exactly (see the module docstring)."""

    @classmethod
    def default_schema(cls) -> ToolSchema:
        return ToolSchema.from_dict(
            {
                "type": "function",
                "function": {
                    "name": "calculator",
                    "description": "Evaluate an arithmetic expression exactly.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "expression": {
                                "type": "string",
                                "description": "numbers with + - * / // % ** and parentheses",
                            }
                        },
                        "required": ["expression"],
                    },
                },
            }
        )

    def execute(self, instance_id: str, parameters: dict[str, Any]) -> str:
        return evaluate(parameters["expression"])
