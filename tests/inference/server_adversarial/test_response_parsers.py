"""Chat completions with response parsers (``ServeConfig.parsers``): ``reasoning_content`` and ``tool_calls``.

A tiny GPT model runs in the real engine, but its forward step is scripted: whatever the prompt,
greedy decoding writes :data:`SCRIPT` ``[0]`` then the end token, so each test chooses the model's
output. The apps are driven in-process through FastAPI's ``TestClient`` (no socket is opened).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_core.inference.apis import MegatronAsyncLLM, ServeConfig
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.text_generation_server.server import build_app
from tests.inference.server_adversarial._support import CHARS, CharTokenizer, sse_events, tiny_model

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

MODEL = "tiny"
CH = "/v1/chat/completions"
PROMPT = "<prompt>"  # every chat renders to this, so the output starts at a known position
SCRIPT = [""]
CHAT = [{"role": "user", "content": "weather?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hours": {"type": ["array", "null"]}}}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>")
SHORT = "<tool_call><function=get_weather><parameter=city>{}</parameter></function></tool_call>"


class TemplateTokenizer(CharTokenizer):
    """Records what reached the chat template; renders every chat as :data:`PROMPT`."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, tools=None, **kwargs):
        self.calls.append({"messages": messages, "tools": tools, "kwargs": kwargs})
        return PROMPT


def scripted(forward):
    """The forward step with logits replaced: position ``len(PROMPT) - 1 + k`` predicts ``SCRIPT[0][k]``."""

    def step(inputs):
        out = forward(inputs)
        logits = out[0]  # [rows, vocab]: a prefill step keeps only its last position's row
        positions = inputs["position_ids"].reshape(-1).tolist()[-logits.shape[0]:]
        for row, position in enumerate(positions):
            k = position - (len(PROMPT) - 1)
            token = 3 + CHARS.index(SCRIPT[0][k]) if 0 <= k < len(SCRIPT[0]) else CharTokenizer.eod
            logits[row] = -1e4
            logits[row, token] = 1e4
        return out

    return step


@pytest.fixture(scope="module")
def served():
    from fastapi.testclient import TestClient

    tokenizer = TemplateTokenizer()
    llm = MegatronAsyncLLM(model=tiny_model(), tokenizer=tokenizer, use_coordinator=False, inference_config=InferenceConfig(
        block_size_tokens=16, buffer_size_gb=0.02, max_sequence_length=512, max_requests=4))
    wrapper = llm.controller.inference_wrapped_model
    wrapper.run_one_forward_step = scripted(wrapper.run_one_forward_step)
    parsed = build_app(llm, ServeConfig(port=0, model_name=MODEL, default_max_tokens=400,
                                        parsers=["deepseek-r1-reasoning", "qwen3-coder-tool"]))
    plain = build_app(llm, ServeConfig(port=0, model_name=MODEL, default_max_tokens=400))
    with TestClient(parsed) as with_parsers, TestClient(plain) as without:
        yield with_parsers, without, tokenizer
    asyncio.run(llm.shutdown())
    assert not llm.engine.has_unfinished_requests()


def chat(client, script: str, **fields):
    SCRIPT[0] = script
    reply = client.post(CH, json={"model": MODEL, "messages": CHAT, "temperature": 0, **fields})
    return reply


def test_reasoning_and_tool_calls_in_the_openai_shape(served):
    client, _, tokenizer = served
    tokenizer.calls.clear()
    reply = chat(client, f"<think>need data</think>Checking.{CALL}", tools=TOOLS,
                 chat_template_kwargs={"enable_thinking": True})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == "Checking."
    assert message["reasoning_content"] == "need data"
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice["finish_reason"] == "tool_calls"
    assert tokenizer.calls[-1]["tools"] == TOOLS and tokenizer.calls[-1]["kwargs"] == {"enable_thinking": True}


def test_reasoning_only_and_plain_answers(served):
    client, _, _ = served
    message = chat(client, "<think>a</think>The answer.").json()["choices"][0]
    assert message["message"] == {"role": "assistant", "content": "The answer.", "reasoning_content": "a"}
    assert message["finish_reason"] == "stop"
    unterminated = chat(client, "<think>thinking and thinking", max_tokens=10).json()["choices"][0]
    assert unterminated["message"] == {"role": "assistant", "content": "", "reasoning_content": "thi"}  # 10 tokens
    assert unterminated["finish_reason"] == "length"


def test_tool_choice_and_parallel_tool_calls(served):
    client, _, _ = served
    text = f"</think>ok{SHORT.format('Paris')}{SHORT.format('Oslo')}"
    both = chat(client, text, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in both] == ["Paris", "Oslo"]
    first = chat(client, text, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]
    assert len(first["tool_calls"]) == 1 and first["content"] == "ok"
    required = chat(client, text, tools=TOOLS, tool_choice="required").json()["choices"][0]["message"]
    assert required["content"] == "" and len(required["tool_calls"]) == 2
    named = chat(client, text, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.json()["choices"][0]["finish_reason"] == "stop"
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}):  # no tools requested: the syntax is content
        message = chat(client, text, **fields).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": text[len("</think>"):]}


def test_malformed_tool_calls_are_plain_content(served):
    client, _, _ = served
    for text in ("</think>Try <tool_call>\n<function=get_weather", "</think>x<tool_call>oops</tool_call>"):
        reply = chat(client, text, tools=TOOLS)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": text[len("</think>"):]}
        assert choice["finish_reason"] == "stop"


def test_streaming_sends_the_parsed_message_at_the_end(served):
    client, _, _ = served
    SCRIPT[0] = f"<think>r</think>Hi{CALL}"
    reply = client.post(CH, json={"model": MODEL, "messages": CHAT, "temperature": 0, "stream": True, "tools": TOOLS})
    events = sse_events(reply.content)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    [last] = [e for e in events[1:-1]]
    choice = last["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["delta"]["content"] == "Hi" and choice["delta"]["reasoning_content"] == "r"
    [call] = choice["delta"]["tool_calls"]
    assert call["index"] == 0 and json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_tool_history_reaches_the_template(served):
    client, _, tokenizer = served
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    SCRIPT[0] = "</think>Sunny."
    reply = client.post(CH, json={"model": MODEL, "messages": history, "tools": TOOLS, "temperature": 0})
    assert reply.json()["choices"][0]["message"]["content"] == "Sunny."
    sent = tokenizer.calls[-1]["messages"]
    assert sent[1]["content"] == "" and sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{bad"}}]}]}, "messages"),
])
def test_bad_tool_fields_are_400_naming_the_field(served, fields, param):
    client, _, _ = served
    reply = chat(client, "x", **fields)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_without_parsers_nothing_changes(served):
    _, client, tokenizer = served
    text = f"<think>a</think>b{CALL}"
    reply = chat(client, text)
    assert reply.json()["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert reply.json()["choices"][0]["finish_reason"] == "stop"
    assert tokenizer.calls[-1]["tools"] is None and tokenizer.calls[-1]["kwargs"] == {}
    refused = chat(client, text, tools=TOOLS)
    assert refused.status_code == 400 and "tool-call parser" in refused.json()["error"]["message"]


@pytest.mark.parametrize("parsers,match", [
    (["deepseek-r1-reasoning", "json"], r"\['json'\] are not parser names; choose from \['deepseek-r1-reasoning'"),
    (["qwen3-coder-tool", "qwen3-coder-tool"], "names a parser twice"),
    (["deepseek-r1-reasoning", "nemotron-v3-reasoning"], "both extract 'reasoning'"),
    ("qwen3-coder-tool", "must be a list of parser names"),
])
def test_bad_parser_config_fails_at_startup(parsers, match):
    with pytest.raises(ValueError, match=match):
        ServeConfig(parsers=parsers)


def test_cli_refuses_a_bad_parser_name_before_loading(capsys):
    pytest.importorskip("uvicorn")
    from megatron_core.inference.cli.serve import main

    with pytest.raises(SystemExit) as exited:
        main(["--load", "/nonexistent", "--parsers", "deepseek-r1-reasoning", "nope"])
    assert exited.value.code == 2
    assert "['nope'] are not parser names" in capsys.readouterr().err
