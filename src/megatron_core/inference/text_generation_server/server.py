"""The OpenAI-compatible FastAPI app over a :class:`MegatronAsyncLLM`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (prompt from the tokenizer's
chat template), both with ``"stream": true`` as server-sent events; ``GET /v1/models``;
``GET /health``. Invalid requests get a 4xx with OpenAI's error body. At most
``max_pending_requests`` generations are in flight; beyond that the server answers 429, and
while shutting down 503. A client that disconnects has its request cancelled, which frees its
KV blocks. On shutdown uvicorn stops accepting connections, waits up to ``shutdown_timeout_s``
for open ones, then every request still running is cancelled explicitly.
"""

# No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` class in the
# endpoint signatures, which come from the lazily imported ``fastapi`` module.
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from megatron_core.inference.apis.async_llm import MegatronAsyncLLM, request_finish_reason
from megatron_core.inference.apis.serve_config import ServeConfig
from megatron_core.inference.inference_request import DynamicInferenceRequest
from megatron_core.inference.text_generation_server.deps import require_server_deps
from megatron_core.inference.text_generation_server.protocol import (
    APIError,
    ParsedRequest,
    error_body,
    parse_chat_request,
    parse_completion_request,
)

__all__ = ["build_app", "create_uvicorn_server", "apply_chat_template"]

DISCONNECT_POLL_S = 0.1


def apply_chat_template(tokenizer: Any, messages: list[dict]) -> str:
    """The prompt text for ``messages`` from the tokenizer's (or its wrapped Hugging Face tokenizer's) chat template."""
    for candidate in (tokenizer, getattr(tokenizer, "tokenizer", None), getattr(tokenizer, "_tokenizer", None)):
        apply = getattr(candidate, "apply_chat_template", None)
        if apply is not None:
            try:
                return apply(messages, tokenize=False, add_generation_prompt=True)
            except ValueError as error:  # no template configured
                raise APIError(400, f"chat completions need a chat template: {error}", "messages") from error
    raise APIError(400, "chat completions need a tokenizer with a chat template (apply_chat_template)", "messages")


class _Admission:
    """Counts in-flight generations; refuses beyond the bound or while draining."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight: set[int] = set()
        self.draining = False

    def check(self, count: int) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if len(self.in_flight) + count > self.limit:
            raise APIError(429, f"the server is at capacity ({len(self.in_flight)} requests in flight, limit "
                                f"{self.limit}); retry later")


def _logprobs_block(llm: MegatronAsyncLLM, request: DynamicInferenceRequest) -> dict[str, Any] | None:
    if request.generated_log_probs is None:
        return None
    tokens = [llm.controller.detokenize([t]) for t in request.generated_tokens]
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": request.generated_log_probs,
            "top_logprobs": request.generated_top_n_logprobs, "text_offset": offsets}


def _usage(requests: list[DynamicInferenceRequest]) -> dict[str, int]:
    prompt = sum(r.prompt_length or 0 for r in requests)
    completion = sum(len(r.generated_tokens) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def build_app(llm: MegatronAsyncLLM, serve_config: ServeConfig) -> Any:
    """The FastAPI application."""
    fastapi, _ = require_server_deps()
    from fastapi.responses import JSONResponse, StreamingResponse

    admission = _Admission(serve_config.max_pending_requests)
    model_name = serve_config.model_name

    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        admission.draining = True
        for request_id in list(admission.in_flight):  # still running after uvicorn's graceful wait
            llm.cancel(request_id)

    app = fastapi.FastAPI(title="megatron_core inference", lifespan=lifespan)
    app.state.admission = admission

    @app.exception_handler(APIError)
    async def _api_error(_: Any, error: APIError) -> Any:
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error_body(error.status, error.message, error.param, error.code), error.status, headers)

    async def _body(http_request: Any) -> Any:
        raw = await http_request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from error

    def _submit(parsed: ParsedRequest) -> list[tuple[int, Any]]:
        admission.check(len(parsed.prompts))
        jobs = []
        try:
            for prompt in parsed.prompts:
                jobs.append(llm.submit(prompt, parsed.params))
        except ValueError as error:
            for request_id, _ in jobs:
                llm.cancel(request_id)
            raise APIError(400, str(error), "prompt") from error
        admission.in_flight.update(request_id for request_id, _ in jobs)
        return jobs

    async def _wait(http_request: Any, jobs: list[tuple[int, Any]]) -> list[DynamicInferenceRequest] | None:
        futures = [asyncio.wrap_future(f) for _, f in jobs]
        try:
            while True:
                done, _ = await asyncio.wait(futures, timeout=DISCONNECT_POLL_S)
                if len(done) == len(futures):
                    return [f.result() for f in futures]
                if await http_request.is_disconnected():
                    for request_id, _ in jobs:
                        llm.cancel(request_id)
                    return None
        finally:
            admission.in_flight.difference_update(request_id for request_id, _ in jobs)

    def _prompt_of(parsed: ParsedRequest, messages: list[dict] | None) -> None:
        if messages is not None:
            parsed.prompts = [apply_chat_template(llm.tokenizer, messages)]
        if any(isinstance(p, str) for p in parsed.prompts) and llm.tokenizer is None:
            raise APIError(400, "this server has no tokenizer; send 'prompt' as token ids", "prompt")

    async def _stream(parsed: ParsedRequest, chat: bool) -> AsyncIterator[str]:
        admission.check(1)
        obj = "chat.completion.chunk" if chat else "text_completion"
        agen = llm.stream(parsed.prompts[0], parsed.params)
        try:
            first = await agen.__anext__()
        except ValueError as error:
            raise APIError(400, str(error), "prompt") from error

        async def events() -> AsyncIterator[str]:
            request_id = None
            sent_text = ""
            item = first
            try:
                if chat:
                    yield _sse({"id": parsed.request_id, "object": obj, "created": parsed.created, "model": model_name,
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
                while True:
                    token, request = item
                    if request_id is None:
                        request_id = request.request_id
                        admission.in_flight.add(request_id)
                    finished = token is None
                    text = request.generated_text if finished else llm.controller.detokenize_generations(
                        request.generated_tokens, llm.controller.termination_id(request.sampling_params))[0]
                    delta, sent_text = text[len(sent_text):], text
                    reason = request_finish_reason(request) if finished else None
                    if delta or finished:
                        choice = ({"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": reason}
                                  if chat else {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None})
                        yield _sse({"id": parsed.request_id, "object": obj, "created": parsed.created,
                                    "model": model_name, "choices": [choice]})
                    if finished:
                        yield _sse("[DONE]")
                        return
                    item = await agen.__anext__()
            finally:
                await agen.aclose()  # a client that went away cancels the request here
                if request_id is not None:
                    admission.in_flight.discard(request_id)

        return events()

    @app.get("/health")
    async def health() -> Any:
        if admission.draining:
            return JSONResponse({"status": "shutting_down"}, 503)
        return {"status": "ok", "in_flight": len(admission.in_flight)}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "megatron_core",
             "max_model_len": llm.context.max_sequence_length}
        ]}

    @app.post("/v1/completions")
    async def completions(http_request: fastapi.Request) -> Any:
        parsed = parse_completion_request(await _body(http_request), model_name, serve_config.default_max_tokens)
        _prompt_of(parsed, None)
        if parsed.stream:
            return StreamingResponse(await _stream(parsed, chat=False), media_type="text/event-stream")
        results = await _wait(http_request, _submit(parsed))
        if results is None:
            return JSONResponse(error_body(499, "client disconnected"), 499)
        choices = [{"index": i, "text": r.generated_text, "logprobs": _logprobs_block(llm, r),
                    "finish_reason": request_finish_reason(r)} for i, r in enumerate(results)]
        return {"id": parsed.request_id, "object": "text_completion", "created": parsed.created, "model": model_name,
                "choices": choices, "usage": _usage(results)}

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: fastapi.Request) -> Any:
        parsed, messages = parse_chat_request(await _body(http_request), model_name, serve_config.default_max_tokens)
        _prompt_of(parsed, messages)
        if parsed.stream:
            return StreamingResponse(await _stream(parsed, chat=True), media_type="text/event-stream")
        results = await _wait(http_request, _submit(parsed))
        if results is None:
            return JSONResponse(error_body(499, "client disconnected"), 499)
        r = results[0]
        return {"id": parsed.request_id, "object": "chat.completion", "created": parsed.created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.generated_text},
                             "finish_reason": request_finish_reason(r), "logprobs": None}],
                "usage": _usage(results)}

    app.state.started = time.time()
    return app


def create_uvicorn_server(llm: MegatronAsyncLLM, serve_config: ServeConfig) -> Any:
    """A ``uvicorn.Server`` for :func:`build_app` on ``serve_config.host:port`` (not started)."""
    _, uvicorn = require_server_deps()
    config = uvicorn.Config(
        build_app(llm, serve_config), host=serve_config.host, port=serve_config.port,
        log_level="info" if serve_config.verbose else "warning", timeout_graceful_shutdown=serve_config.shutdown_timeout_s,
        lifespan="on",
    )
    return uvicorn.Server(config)
