"""OpenAI request validation and response shapes (no web framework needed here).

:func:`parse_completion_request` and :func:`parse_chat_request` turn a JSON body into prompts and
:class:`SamplingParams`, raising :class:`APIError` (HTTP status, message, parameter) on anything
invalid. ``temperature = 0`` means greedy; ``top_p = 1`` means no nucleus filter and ``top_p = 0``
keeps only the most probable token (greedy, as OpenAI clients expect); ``top_k`` is accepted as
an extension (at most the vocabulary size when :class:`Limits` gives it). Every field is checked
for its JSON type (``true`` is not a number, ``1.0`` is not an integer, ``NaN`` is not in range).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from megatron_core.inference.sampling_params import SamplingParams

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


def _common(body: Any, model_name: str, default_max_tokens: int, kind: str, limits: Limits
            ) -> tuple[SamplingParams, bool]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required and must be a string", "model")
    if model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model",
                       "model_not_found")
    for name, allowed in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and (type(value) is not type(allowed) or value != allowed):
            raise APIError(400, f"'{name}' = {value!r} is not supported (only {allowed!r})", name)
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


def _message_text(index: int, message: Any) -> dict[str, str]:
    """``{"role", "content"}`` of one chat message; content may be a string or a list of text parts."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(400, f"'{where}' must be an object with 'role' and 'content'", "messages")
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise APIError(400, f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise APIError(400, f"'{where}.content' must be a string or a list of text parts", "messages")
    return {"role": role, "content": content}


def parse_chat_request(body: Any, model_name: str, default_max_tokens: int,
                       limits: Limits = Limits()) -> tuple[ParsedRequest, list[dict]]:
    """Validate a ``/v1/chat/completions`` body; the messages still need the chat template."""
    params, stream = _common(body, model_name, default_max_tokens, "chat", limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {'role': str, 'content': str}", "messages")
    texts = [_message_text(i, m) for i, m in enumerate(messages)]
    parsed = ParsedRequest([], params, stream, params.top_n_logprobs if params.return_log_probs else None,
                           f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
    return parsed, texts
