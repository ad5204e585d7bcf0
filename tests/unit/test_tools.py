"""rl.tools: the Hermes-style tool-call parser on fixed strings, the exact calculator, and the
dispatch that turns every bad call into an "error: ..." observation instead of an exception."""

from __future__ import annotations

import pytest

from rl.tools import (
    BUILTIN_TOOLS,
    CalculatorError,
    ToolCall,
    ToolCallError,
    calculate,
    get_tools,
    parse_tool_calls,
    run_tool_call,
    tool_prompt,
)


def test_one_valid_call():
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "12*34"})]


def test_no_call():
    assert parse_tool_calls("The answer is 408.") == []


def test_two_calls_in_one_turn_in_order():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> and '
            '<tool_call>\n{"name": "python", "arguments": {"code": "print(3)"}}\n</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+1"}),
                                      ToolCall("python", {"code": "print(3)"})]


def test_nested_json_arguments():
    text = ('<tool_call>{"name": "python", "arguments": {"code": "d = {\'a\': {\'b\': [1, 2]}}\\nprint(d)", '
            '"meta": {"x": {"y": [1, {"z": null}]}}}}</tool_call>')
    (call,) = parse_tool_calls(text)
    assert call == ToolCall("python", {"code": "d = {'a': {'b': [1, 2]}}\nprint(d)",
                                       "meta": {"x": {"y": [1, {"z": None}]}}})


@pytest.mark.parametrize("body,message", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"arguments": {}}', 'needs a string "name"'),
    ('{"name": "calculator", "arguments": "1+1"}', '"arguments" must be an object'),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "not valid JSON"),
])
def test_malformed_calls_are_errors_not_exceptions(body, message):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, ToolCallError) and message in call.error


def test_unclosed_call_after_a_good_one():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
            '<tool_call>{"name": "calc')
    good, bad = parse_tool_calls(text)
    assert good == ToolCall("calculator", {"expression": "2"})
    assert isinstance(bad, ToolCallError) and "unclosed" in bad.error and bad.text == '{"name": "calc'


@pytest.mark.parametrize("expression,value", [
    ("12345678901234567890 * 98765432109876543210", str(12345678901234567890 * 98765432109876543210)),
    ("0.1 + 0.2", "0.3"),
    ("1 / 3", "1/3"),
    ("7 / 8", "0.875"),
    ("-(3 - 10) ** 2", "-49"),
    ("2 ** -2", "0.25"),
    ("17 // 5 + 17 % 5", "5"),
    ("-7 // 2", "-4"),
    ("(1/3) * 3", "1"),
    ("-0.05", "-0.05"),
])
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression,message", [
    ("__import__('os').system('ls')", "not allowed"),
    ("x + 1", "not allowed"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("2 ** 0.5", "integer exponents"),
    ("10 ** 10 ** 10", "larger than"),
    ("99 ** 1000", "more than 4096 bits"),
    ("1 +", "cannot parse"),
    ("'a' * 3", "not a number"),
    ("True + 1", "not a number"),
    ("1" * 300, "longer than"),
    ("+".join(["1"] * 100), "more than 128 parts"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


def test_dispatch_turns_every_mistake_into_an_error_observation():
    tools = get_tools(["calculator"])
    ok = run_tool_call(ToolCall("calculator", {"expression": "6 * 7"}), tools)
    assert ok == ("42", True)
    cases = [
        (ToolCallError("{", "tool call is not valid JSON: x"), "error: tool call is not valid JSON"),
        (ToolCall("search", {"q": "x"}), "error: unknown tool 'search'; available: calculator"),
        (ToolCall("calculator", {"expr": "1"}), "error: calculator takes arguments expression; got expr"),
        (ToolCall("calculator", {"expression": "1/0"}), "error: division by zero"),
        (ToolCall("calculator", {"expression": 5}), "error: expression must be a string"),
    ]
    for call, message in cases:
        text, good = run_tool_call(call, tools)
        assert not good and text.startswith(message), text


def test_python_tool_runs_in_the_sandbox():
    tools = get_tools(["python"])
    assert run_tool_call(ToolCall("python", {"code": "print(6 * 7)"}), tools) == ("42\n", True)
    text, good = run_tool_call(ToolCall("python", {"code": "raise ValueError('no')"}), tools)
    assert not good and text.startswith("error: exited with status 1: ValueError: no")


def test_unknown_tool_name_and_prompt():
    with pytest.raises(ValueError, match="unknown tool 'calc'"):
        get_tools(["calc"])
    prompt = tool_prompt(get_tools(["calculator"]))
    assert "<tool_call>" in prompt and BUILTIN_TOOLS["calculator"].description in prompt
