"""OpenAI request validation and response shapes (no web framework needed here).

:func:`parse_completion_request` and :func:`parse_chat_request` turn a JSON body into prompts and
:class:`SamplingParams`, raising :class:`APIError` (HTTP status, message, parameter) on anything
invalid. ``temperature = 0`` means greedy; ``top_p = 1`` means no nucleus filter; ``top_k`` is
accepted as an extension.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from megatron_core.inference.sampling_params import SamplingParams

__all__ = ["APIError", "ParsedRequest", "parse_completion_request", "parse_chat_request", "error_body"]

_UNSUPPORTED = {"n": 1, "echo": False, "best_of": 1, "suffix": None, "seed": None, "tools": None, "functions": None}


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
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


def _common(body: Any, model_name: str, default_max_tokens: int, kind: str) -> tuple[SamplingParams, bool]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required and must be a string", "model")
    if model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model",
                       "model_not_found")
    for name, allowed in _UNSUPPORTED.items():
        if name in body and body[name] not in (allowed, None):
            raise APIError(400, f"'{name}' = {body[name]!r} is not supported (only {allowed!r})", name)
    max_tokens = _int(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                      default_max_tokens, 0)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _int(body, "top_k", 0, 0)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, "'stop' must be a non-empty string or a list of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    greedy = temperature == 0.0 or top_k == 1
    if not greedy and top_k > 0 and top_p < 1.0:
        raise APIError(400, "set either 'top_k' or 'top_p', not both", "top_p")
    params = SamplingParams(
        temperature=1.0 if greedy else temperature, top_k=1 if greedy else top_k,
        top_p=0.0 if greedy or top_p >= 1.0 else top_p, num_tokens_to_generate=max_tokens, stop_words=stop,
    )
    if kind == "completion":
        logprobs = _int(body, "logprobs", None, 0, 20)
    else:
        logprobs = _int(body, "top_logprobs", 0, 0, 20) if body.get("logprobs") else None
    if logprobs is not None:
        params.return_log_probs = True
        params.skip_prompt_log_probs = True
        params.top_n_logprobs = logprobs
    return params, stream


def parse_completion_request(body: Any, model_name: str, default_max_tokens: int) -> ParsedRequest:
    """Validate a ``/v1/completions`` body."""
    params, stream = _common(body, model_name, default_max_tokens, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)) for p in prompt
    ):
        prompts = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise APIError(400, "'prompt' must not be empty", "prompt")
    if stream and len(prompts) > 1:
        raise APIError(400, "streaming supports a single prompt", "stream")
    return ParsedRequest(prompts, params, stream, params.top_n_logprobs if params.return_log_probs else None,
                         f"cmpl-{uuid.uuid4().hex}", int(time.time()))


def parse_chat_request(body: Any, model_name: str, default_max_tokens: int) -> tuple[ParsedRequest, list[dict]]:
    """Validate a ``/v1/chat/completions`` body; the messages still need the chat template."""
    params, stream = _common(body, model_name, default_max_tokens, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise APIError(400, "'messages' must be a non-empty list of {'role': str, 'content': str}", "messages")
    parsed = ParsedRequest([], params, stream, params.top_n_logprobs if params.return_log_probs else None,
                           f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
    return parsed, [{"role": m["role"], "content": m["content"]} for m in messages]
