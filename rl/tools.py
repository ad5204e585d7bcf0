"""Tool calling for agentic rollouts: the parser of the tool-call format a model writes, the
built-in tools and the dispatch that turns any bad call into an "error: ..." observation.

Format (Hermes style, what Qwen / SmolLM2-style chat templates document):

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>

`parse_tool_calls` returns every call in a turn, in order; a call that is not valid JSON, not an
object with a string "name" and an object "arguments", or that is not closed, comes back as a
`ToolCallError` (the model sees the error; nothing raises). `run_tool_call` runs one parsed call
on the tools of an environment and returns (observation text, ok).

Built-in tools: `calculator` (exact rational arithmetic over an AST walk: numbers, + - * / //
% **, no names, no calls, no eval; size limits) and `python` (rl.sandbox: a subprocess with no
network, a temporary directory, CPU / memory / output limits).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ToolCallError:
    """A call the parser could not read; `error` is what the model is told."""

    text: str  # the text between the tags (or after an unclosed tag)
    error: str


def _parse_one(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(body, f"tool call is not valid JSON: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return ToolCallError(body, f"tool call must be a JSON object, got {type(obj).__name__}")
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCallError(body, 'tool call needs a string "name"')
    if not isinstance(arguments, dict):
        return ToolCallError(body, f'tool call "arguments" must be an object, got {type(arguments).__name__}')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every <tool_call>...</tool_call> of one model turn, in order; an opening tag with no
    closing tag after the last complete call is a ToolCallError (a turn cut by its budget)."""
    out: list[ToolCall | ToolCallError] = []
    end = 0
    for m in _CALL.finditer(text):
        out.append(_parse_one(m.group(1).strip()))
        end = m.end()
    rest = text.find(OPEN, end)
    if rest >= 0:
        out.append(ToolCallError(text[rest + len(OPEN):], f"unclosed {OPEN} (no {CLOSE})"))
    return out


# --- the calculator -------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 256
MAX_NODES = 128
MAX_BITS = 4096  # numerator / denominator of any intermediate value
MAX_EXPONENT = 1024

_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}


class CalculatorError(ValueError):
    pass


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents are exact")
    e = int(exponent)
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {e} is larger than {MAX_EXPONENT}")
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if bits * abs(e) > MAX_BITS:
        raise CalculatorError(f"the result would have more than {MAX_BITS} bits")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    return base**e


def _number(node: ast.Constant) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"not a number: {value!r}")
    # Fraction(str(x)) keeps the decimal the model wrote (0.1 is 1/10, not the nearest double).
    return Fraction(value) if isinstance(value, int) else Fraction(repr(value))


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return _number(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            result = _power(a, b)
        elif type(node.op) in _BINARY:
            if b == 0 and not isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
                raise CalculatorError("division by zero")
            result = _BINARY[type(node.op)](a, b)
        else:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        if max(abs(result.numerator).bit_length(), result.denominator.bit_length()) > MAX_BITS:
            raise CalculatorError(f"an intermediate result has more than {MAX_BITS} bits")
        return result
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def format_number(value: Fraction) -> str:
    """An integer as is; a fraction whose denominator has only factors 2 and 5 as an exact
    decimal; any other as p/q."""
    if value.denominator == 1:
        return str(value.numerator)
    d, twos, fives = value.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    if d != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    sign = "-" if value < 0 else ""
    digits = str(scaled).rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression as text; CalculatorError says what is wrong."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse the expression: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    return format_number(_evaluate(tree.body))


# --- the tools and the dispatch -------------------------------------------------------------


def _calculator_tool(arguments: dict[str, Any]) -> str:
    return calculate(arguments["expression"])


def _python_tool(arguments: dict[str, Any]) -> str:
    from rl.sandbox import run_python

    result = run_python(arguments["code"])
    if not result.ok:
        raise RuntimeError(result.error)
    return result.output


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, str]  # argument name -> its description (all required, strings)
    run: Callable[[dict[str, Any]], str]
    example: tuple[dict[str, Any], str]  # (arguments, output) of a call, for a worked example


EXAMPLE_QUESTION, EXAMPLE_ANSWER = "What is 1234 * 5678?", "1234 * 5678 = 7006652"


BUILTIN_TOOLS: dict[str, Tool] = {
    "calculator": Tool("calculator", "exact arithmetic: numbers and + - * / // % ** ( )",
                       {"expression": "e.g. (12 + 3) * 45"}, _calculator_tool,
                       ({"expression": "1234 * 5678"}, "7006652")),
    "python": Tool("python", "runs Python code in a sandbox (no network); returns what it prints",
                   {"code": "a Python program; print the result"}, _python_tool,
                   ({"code": "print(1234 * 5678)"}, "7006652\n")),
}


def get_tools(names: list[str]) -> dict[str, Tool]:
    """The built-in tools by name (ValueError naming an unknown one)."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tool {unknown[0]!r}; expected one of {', '.join(BUILTIN_TOOLS)}")
    return {n: BUILTIN_TOOLS[n] for n in names}


def run_tool_call(call: ToolCall | ToolCallError, tools: dict[str, Tool]) -> tuple[str, bool]:
    """(observation text, ok) of one call: the tool's output, or "error: ..." for a call that
    did not parse, an unknown tool, wrong arguments or a tool that failed. Never raises for
    the model's mistakes."""
    if isinstance(call, ToolCallError):
        return f"error: {call.error}", False
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; available: {', '.join(tools) or 'none'}", False
    wrong = sorted(set(call.arguments) ^ set(tool.parameters))
    if wrong:
        return (f"error: {call.name} takes arguments {', '.join(tool.parameters)}; got "
                f"{', '.join(sorted(call.arguments)) or 'none'}"), False
    try:
        return tool.run(call.arguments), True
    except Exception as e:  # a tool's failure is the model's observation, not the run's crash
        return f"error: {e}", False


def example_messages(tool: Tool) -> list[dict[str, str]]:
    """A worked exchange (question, the call, the tool's answer, the final answer) that shows a
    small model the format: SmolLM2-135M-Instruct calls no tool from the system message alone,
    and calls the calculator correctly after this example (docs/agentic.md)."""
    arguments, output = tool.example
    call = f"{OPEN}{json.dumps({'name': tool.name, 'arguments': arguments})}{CLOSE}"
    return [{"role": "user", "content": EXAMPLE_QUESTION}, {"role": "assistant", "content": call},
            {"role": "tool", "content": output}, {"role": "assistant", "content": EXAMPLE_ANSWER}]


def tool_prompt(tools: dict[str, Tool]) -> str:
    """The system message that tells the model its tools and the call format."""
    lines = [f'- {t.name}: {t.description}; arguments: {json.dumps(t.parameters)}' for t in tools.values()]
    first = next(iter(tools.values()), BUILTIN_TOOLS["calculator"])
    example = json.dumps({"name": first.name, "arguments": dict.fromkeys(first.parameters, "...")})
    return ("You can call tools. Tools:\n" + "\n".join(lines) +
            f"\nTo call one, write {OPEN}{example}{CLOSE} and wait for the result. "
            "Give the final answer without a tool call.")
