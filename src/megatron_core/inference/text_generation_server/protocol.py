"""OpenAI request validation and response shapes (no web framework needed here).

:func:`parse_completion_request` and :func:`parse_chat_request` turn a JSON body into prompts and
:class:`SamplingParams`, raising :class:`APIError` (HTTP status, message, parameter) on anything
invalid. ``temperature = 0`` means greedy; ``top_p = 1`` means no nucleus filter and ``top_p = 0``
keeps only the most probable token (greedy, as OpenAI clients expect); ``top_k`` is accepted as
an extension (at most the vocabulary size when :class:`Limits` gives it). Every field is checked
for its JSON type (``true`` is not a number, ``1.0`` is not an integer, ``NaN`` is not in range).
Chat requests may carry ``chat_template_kwargs`` (passed to the template) and, where a tool-call
parser is configured, ``tools``, ``tool_choice``, ``parallel_tool_calls`` and tool history.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_server.response_parsers import ChatOptions

__all__ = ["APIError", "Limits", "ParsedRequest", "parse_completion_request", "parse_chat_request", "error_body"]

# Fields whose only accepted value (besides null) is the one given.
_UNSUPPORTED = {"n": 1, "echo": False, "best_of": 1, "suffix": None, "seed": None, "tools": None, "functions": None}
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_LOGPROBS = 20  # as OpenAI


@dataclass(frozen=True)
class Limits:
    """What the served model allows: its sampling vocabulary and its context (``None``: not checked here)."""

    vocab_size: int | None = None
    max_sequence_length: int | None = None
    max_prompts: int | None = None


class APIError(Exception):
    """A request the server refuses, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope."""
    kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    """A validated request."""

    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    logprobs: int | None
    request_id: str
    created: int
    chat: ChatOptions | None = None


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not low <= value <= high):
        raise APIError(400, f"'{name}' must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _int(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise APIError(400, f"'{name}' must be an integer {bound}, got {value!r}", name)
    return value


def _common(body: Any, model_name: str, default_max_tokens: int, kind: str, limits: Limits,
            allowed: tuple[str, ...] = ()) -> tuple[SamplingParams, bool]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required and must be a string", "model")
    if model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model",
                       "model_not_found")
    for name, only in _UNSUPPORTED.items():
        value = body.get(name)
        if name not in allowed and value is not None and (type(value) is not type(only) or value != only):
            raise APIError(400, f"'{name}' = {value!r} is not supported (only {only!r})", name)
    tokens_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, tokens_field, default_max_tokens, 1, limits.max_sequence_length)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _int(body, "top_k", 0, 0, limits.vocab_size)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not 0 < len(stop) <= MAX_STOP_SEQUENCES
                             or not all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP_SEQUENCES} of them",
                       "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    greedy = temperature == 0.0 or top_k == 1 or top_p == 0.0
    if not greedy and top_k > 0 and top_p < 1.0:
        raise APIError(400, "set either 'top_k' or 'top_p', not both", "top_p")
    params = SamplingParams(
        temperature=1.0 if greedy else temperature, top_k=1 if greedy else top_k,
        top_p=0.0 if greedy or top_p >= 1.0 else top_p, num_tokens_to_generate=max_tokens, stop_words=stop,
    )
    if kind == "completion":
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    else:
        wants = body.get("logprobs")
        if wants is not None and not isinstance(wants, bool):
            raise APIError(400, "'logprobs' must be a boolean", "logprobs")
        top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        logprobs = top if wants else None
    if logprobs is not None:
        params.return_log_probs = True
        params.skip_prompt_log_probs = True
        params.top_n_logprobs = logprobs
    return params, stream


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def parse_completion_request(body: Any, model_name: str, default_max_tokens: int,
                             limits: Limits = Limits()) -> ParsedRequest:
    """Validate a ``/v1/completions`` body."""
    params, stream = _common(body, model_name, default_max_tokens, "completion", limits)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise APIError(400, "'prompt' must not be empty", "prompt")
    if stream and len(prompts) > 1:
        raise APIError(400, "streaming supports a single prompt", "stream")
    if limits.max_prompts is not None and len(prompts) > limits.max_prompts:
        raise APIError(400, f"{len(prompts)} prompts exceed this server's limit of {limits.max_prompts} in flight",
                       "prompt")
    return ParsedRequest(prompts, params, stream, params.top_n_logprobs if params.return_log_probs else None,
                         f"cmpl-{uuid.uuid4().hex}", int(time.time()))


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(index: int, message: Any, allow_tools: bool = False) -> dict[str, Any]:
    """``{"role", "content"}`` of one chat message; content may be a string or a list of text parts.

    With ``allow_tools`` an assistant message may carry ``tool_calls`` (then ``content`` may be
    null) and a tool message its ``tool_call_id``; both are passed on to the chat template.
    """
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(400, f"'{where}' must be an object with 'role' and 'content'", "messages")
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise APIError(400, f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
    extra = _tool_fields(where, role, message) if allow_tools else {}
    if content is None and "tool_calls" in extra:
        content = ""
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise APIError(400, f"'{where}.content' must be a string or a list of text parts", "messages")
    return {"role": role, "content": content, **extra}


def _tool_fields(where: str, role: str, message: dict) -> dict[str, Any]:
    """A message's ``tool_calls`` (arguments as objects, as chat templates read them) and ``tool_call_id``."""
    extra: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise APIError(400, f"'{where}.tool_calls' must be a list, on an assistant message", "messages")
        extra["tool_calls"] = [_history_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if role != "tool" or not isinstance(call_id, str):
            raise APIError(400, f"'{where}.tool_call_id' must be a string, on a tool message", "messages")
        extra["tool_call_id"] = call_id
    return extra


def _history_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"'{where}' must be {{'type': 'function', 'function': {{'name': str, 'arguments': "
                            "str}}}}", "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise APIError(400, f"'{where}.function.arguments' is not valid JSON: {error}", "messages") from error
    if not isinstance(arguments, dict):
        raise APIError(400, f"'{where}.function.arguments' must be a JSON object", "messages")
    return {**call, "function": {**function, "arguments": arguments}}


_TOOL_CHOICES = ("none", "auto", "required")
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "tokenize", "add_generation_prompt", "conversation")


def _chat_options(body: dict, allow_tools: bool) -> ChatOptions:
    """The tool and template fields of a chat request; ``tools`` only where a tool-call parser is configured."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel, template_kwargs = body.get("parallel_tool_calls"), body.get("chat_template_kwargs")
    if tools is not None and not allow_tools:
        raise APIError(400, "'tools' needs a tool-call parser on the server (ServeConfig.parsers / megatron-serve "
                            "--parsers, e.g. 'qwen3-coder-tool')", "tools")
    if tools is not None and (not isinstance(tools, list) or not all(_is_tool(t) for t in tools)):
        raise APIError(400, "'tools' must be a list of {'type': 'function', 'function': {'name': str, "
                            "'parameters': object}}", "tools")
    names = [t["function"]["name"] for t in tools or []]
    if choice is not None and choice not in ("none", "auto"):
        if not tools:
            raise APIError(400, f"'tool_choice' = {choice!r} needs 'tools'", "tool_choice")
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
            choice.get("function"), dict) else None
        if choice not in _TOOL_CHOICES and named not in names:
            raise APIError(400, f"'tool_choice' must be one of {', '.join(_TOOL_CHOICES)} or {{'type': 'function', "
                                f"'function': {{'name': one of {names}}}}}, got {choice!r}", "tool_choice")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if template_kwargs is not None and (not isinstance(template_kwargs, dict)
                                        or not all(isinstance(k, str) for k in template_kwargs)):
        raise APIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = sorted(set(template_kwargs or {}) & set(_RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise APIError(400, f"'chat_template_kwargs' must not set {reserved} (the server sets them)",
                       "chat_template_kwargs")
    return ChatOptions(tools, choice, True if parallel is None else parallel, dict(template_kwargs or {}))


def _is_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (tool.get("type", "function") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str) and bool(function["name"])
            and isinstance(function.get("parameters", {}), dict))


def parse_chat_request(body: Any, model_name: str, default_max_tokens: int,
                       limits: Limits = Limits(), allow_tools: bool = False) -> tuple[ParsedRequest, list[dict]]:
    """Validate a ``/v1/chat/completions`` body; the messages still need the chat template.

    ``allow_tools`` (a tool-call parser is configured) admits ``tools`` and tool messages.
    """
    params, stream = _common(body, model_name, default_max_tokens, "chat", limits, allowed=("tools",))
    chat = _chat_options(body, allow_tools)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {'role': str, 'content': str}", "messages")
    texts = [_message_text(i, m, allow_tools) for i, m in enumerate(messages)]
    parsed = ParsedRequest([], params, stream, params.top_n_logprobs if params.return_log_probs else None,
                           f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), chat)
    return parsed, texts
