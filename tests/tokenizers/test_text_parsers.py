"""Megatron-Core 0.19's response parsers on hand-written model outputs (reasoning, tool calls, malformed text)."""

from __future__ import annotations

import json

import pytest

from megatron_core.tokenizers.text.parsers import PARSER_MAPPING
from megatron_core.tokenizers.text.parsers.base_parser import BaseParser
from megatron_core.tokenizers.text.parsers.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from megatron_core.tokenizers.text.parsers.nemotron_v3_reasoning_parser import NemotronV3ReasoningParser
from megatron_core.tokenizers.text.parsers.qwen3_coder_tool_parser import Qwen3CoderToolParser
from megatron_core.tokenizers.text.parsers.tool_arguments import normalize_structured_arguments

OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def test_parser_mapping_names_the_three_parsers():
    assert PARSER_MAPPING == {"deepseek-r1-reasoning": DeepSeekR1ReasoningParser,
                              "qwen3-coder-tool": Qwen3CoderToolParser,
                              "nemotron-v3-reasoning": NemotronV3ReasoningParser}
    assert BaseParser.parse("x", tools=[]) == ("x", {})


@pytest.mark.parametrize("text,content,info", [
    ("<think>plan</think>answer", "answer", {"reasoning": "plan"}),  # complete
    ("<think>still planning", "", {"reasoning": "still planning"}),  # unterminated: all reasoning
    ("no tags at all", "", {"reasoning": "no tags at all"}),  # absent: the prompt opened the thought
    ("plan</think>answer", "answer", {"reasoning": "plan"}),  # the opener was in the prompt
    ("junk<think>a</think>b</think>c", "b</think>c", {"reasoning": "a"}),  # before <think> dropped, first close
    ("<think></think>answer", "answer", {}),  # empty reasoning is not reported
    ("<think>a</think>", "", {"reasoning": "a"}),
    ("", "", {}),
])
def test_deepseek_r1(text, content, info):
    assert DeepSeekR1ReasoningParser.parse(text) == (content, info)
    assert NemotronV3ReasoningParser.parse(text) == (content, info)  # no override: the same


@pytest.mark.parametrize("text,kwargs,expected", [
    ("<think>a", OFF, ("a", {})),
    ("<think>a</think>", {"chat_template_kwargs": {"force_nonempty_content": True}}, ("a", {})),
    ("<think>a</think>b", OFF, ("b", {"reasoning": "a"})),  # an answer exists: nothing moves
    ("<think>a</think>", {"chat_template_kwargs": {"enable_thinking": True}}, ("", {"reasoning": "a"})),
    ("<think>a</think>", {"chat_template_kwargs": "not a dict"}, ("", {"reasoning": "a"})),
])
def test_nemotron_v3_puts_reasoning_in_empty_content_when_asked(text, kwargs, expected):
    assert NemotronV3ReasoningParser.parse(text, **kwargs) == expected


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"}, "metric": {"type": "boolean"},
    "opts": {"type": "object"}, "tags": {"type": "array"}, "when": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
}}}}]


def call_xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def calls_of(text: str, tools=TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    content, info = Qwen3CoderToolParser.parse(text, tools=tools)
    for call in info.get("tool_calls", []):
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in info.get("tool_calls", [])]


def test_qwen3_coder_several_calls_typed_by_the_schema():
    text = ("Let me check.\n" + call_xml("get_weather", city=" Paris ", days="3", temp="2.0", metric="True",
                                         opts='{"units": ["C"]}', tags="['a', 'b']", when="5", extra="7")
            + "\n" + call_xml("get_weather", city="Oslo", temp="-1.5", metric="no", days="null") + "\ntrailing text")
    content, calls = calls_of(text)
    assert content == "Let me check.\n"  # text before the first call; text after the calls is dropped
    assert calls == [
        ("get_weather", {"city": " Paris ", "days": 3, "temp": 2, "metric": True, "opts": {"units": ["C"]},
                         "tags": ["a", "b"], "when": 5, "extra": "7"}),
        ("get_weather", {"city": "Oslo", "temp": -1.5, "metric": False, "days": None}),
    ]
    _, info = Qwen3CoderToolParser.parse(text, tools=TOOLS)
    assert len({c["id"] for c in info["tool_calls"]}) == 2


def test_qwen3_coder_without_tools_keeps_strings_and_finds_untagged_functions():
    content, calls = calls_of("ok <function=f>\n<parameter=a>\n1\n</parameter>\n</function>", tools=None)
    assert content == "ok " and calls == [("f", {"a": "1"})]


def test_qwen3_coder_truncated_call_yields_what_it_holds():
    content, calls = calls_of("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                              "<parameter=days>\n4")
    assert content == "" and calls == [("get_weather", {"city": "Rome", "days": 4})]


@pytest.mark.parametrize("text", [
    "plain answer, no call",
    "<tool_call>\n<function=get_weather",  # the name never closes
    "<tool_call>no function here</tool_call> <function=x>",  # tags present, but no function inside them
    "<function=",
])
def test_qwen3_coder_malformed_output_is_plain_content(text):
    assert Qwen3CoderToolParser.parse(text, tools=TOOLS) == (text, {})


def test_qwen3_coder_values_that_do_not_fit_stay_text():
    _, calls = calls_of(call_xml("get_weather", days="three", temp="1e999", opts="{not json", tags="{1, 2}",
                                 when="b'x'"))
    assert calls == [("get_weather", {"days": "three", "temp": "1e999", "opts": "{not json", "tags": "{1, 2}",
                                      "when": "b'x'"})]


def test_qwen3_coder_never_raises(monkeypatch):
    import megatron_core.tokenizers.text.parsers.qwen3_coder_tool_parser as module

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(module, "extract_tool_calls", broken)
    text = call_xml("get_weather", city="x")
    assert Qwen3CoderToolParser.parse(text, tools=TOOLS) == (text, {})


def test_structured_arguments_are_parsed_where_the_schema_allows():
    schemas = {"a": {"type": ["array", "null"]}, "b": {"oneOf": [{"type": "object"}]}, "c": {"type": "string"}}
    got = normalize_structured_arguments({"a": " [true] ", "b": '{"x": 1}', "c": "[1]", "d": "[2]"}, schemas)
    assert got == {"a": [True], "b": {"x": 1}, "c": "[1]", "d": "[2]"}
