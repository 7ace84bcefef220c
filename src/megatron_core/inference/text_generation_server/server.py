"""The OpenAI-compatible FastAPI app over a :class:`MegatronAsyncLLM`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (prompt from the tokenizer's
chat template), both with ``"stream": true`` as server-sent events; ``GET /v1/models``;
``GET /health``. Every error, including unknown routes and internal failures, is OpenAI's JSON
error body (``{"error": {"message", "type", "param", "code"}}``): 4xx naming the field when the
request is at fault, 500 when serving it failed, 503 when the engine has stopped or the server is
shutting down. A stream that fails after its first chunk ends with a ``data: {"error": ...}``
event, then ``data: [DONE]``.

With ``ServeConfig.parsers`` chat responses carry ``reasoning_content`` and ``tool_calls``
(:mod:`.response_parsers`); a parsed chat stream sends the whole parsed message in its last chunk.

At most ``max_pending_requests`` generations (streaming or not) are in flight; beyond that the
server answers 429 (:mod:`.admission`). ``/health`` answers 200 ``{"status": "ok"}`` while the
engine loop runs, 503 with the reason once it has stopped (every pending request then fails at
once) or while shutting down. A client that disconnects has its request cancelled, which frees its
KV blocks and its admission slot. On shutdown the server stops accepting connections and waits up
to ``shutdown_timeout_s`` for running requests; then it cancels them, so each still gets a JSON
503 (a stream: a last chunk with ``finish_reason: "cancelled"``, then ``[DONE]``).
"""

# No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` class in the
# endpoint signatures, which come from the lazily imported ``fastapi`` module.
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from megatron_core.inference.apis.finish_reason import request_finish_reason
from megatron_core.inference.apis.serve_config import ServeConfig
from megatron_core.inference.engines.fault_isolation import (
    CANCELLED,
    EngineFailedError,
    describe,
)
from megatron_core.inference.inference_request import DynamicInferenceRequest, Status
from megatron_core.inference.text_generation_server.admission import Admission, Ticket
from megatron_core.inference.text_generation_server.deps import require_server_deps
from megatron_core.inference.text_generation_server.protocol import (
    APIError,
    Limits,
    ParsedRequest,
    error_body,
    parse_chat_request,
    parse_completion_request,
)
from megatron_core.inference.text_generation_server.response_parsers import (
    accepts_tools,
    parse_generation,
    resolve_parsers,
)

__all__ = ["build_app", "create_uvicorn_server", "apply_chat_template", "chat_template_owner"]

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1
CANCEL_MARGIN_S = 5.0  # after cancelling what is left, the time responses get before uvicorn cuts connections
# SamplingParams fields as the OpenAI request names them.
_PARAM_NAMES = {"num_tokens_to_generate": "max_tokens", "top_n_logprobs": "logprobs"}


def chat_template_owner(tokenizer: Any) -> Any:
    """The tokenizer, or the Hugging Face tokenizer it wraps, whose ``apply_chat_template`` renders chats (or ``None``).

    A tokenizer whose ``chat_template`` attribute is ``None`` has no template to apply.
    """
    for candidate in (tokenizer, getattr(tokenizer, "tokenizer", None), getattr(tokenizer, "_tokenizer", None)):
        if getattr(candidate, "apply_chat_template", None) is not None and (
                not hasattr(candidate, "chat_template") or candidate.chat_template is not None):
            return candidate
    return None


def apply_chat_template(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                        add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt text for ``messages`` from the tokenizer's (or its wrapped Hugging Face tokenizer's) chat template.

    ``tools`` and ``template_kwargs`` (a request's ``chat_template_kwargs``) reach the template only when given.
    """
    extra = {**template_kwargs, **({"tools": tools} if tools is not None else {})}
    owner = chat_template_owner(tokenizer)
    if owner is None:
        raise APIError(400, "chat completions need a tokenizer with a chat template (apply_chat_template)",
                       "messages")
    try:
        return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)
    except Exception as error:  # noqa: BLE001 - the template refused the messages
        raise APIError(400, f"the chat template cannot render these messages: {describe(error)}",
                       "messages") from error


def _logprobs_block(llm: Any, request: DynamicInferenceRequest) -> dict[str, Any] | None:
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


def _rejected(error: Exception) -> APIError:
    """The HTTP error for a request the engine refused in ``add_request``."""
    if isinstance(error, EngineFailedError):
        return APIError(503, str(error), code="engine_failed")
    param = getattr(error, "param", "prompt")
    name = _PARAM_NAMES.get(param, param)
    return APIError(400, str(error).replace(param, name), name)


def _failure(request: DynamicInferenceRequest, draining: bool) -> APIError | None:
    """The HTTP error for a request that finished without completing, else ``None``."""
    if request.status != Status.FAILED:
        return None
    if request.error == CANCELLED:
        why = "the server is shutting down" if draining else "the request was cancelled"
        return APIError(503, f"{why}; the request was cancelled before it finished", code="cancelled")
    return APIError(500, request.error or "internal error while generating", code="generation_failed")


class _Streams:
    """Builds the ``StreamingResponse`` subclass that always releases its slot (needs starlette)."""

    def __init__(self) -> None:
        from fastapi.responses import StreamingResponse

        class ManagedStream(StreamingResponse):
            def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
                super().__init__(content, media_type="text/event-stream")
                self._on_close = on_close

            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                try:
                    await super().__call__(scope, receive, send)
                finally:  # also when the body was never iterated (the client left first) or the task was cancelled
                    try:
                        await self.body_iterator.aclose()
                    finally:
                        self._on_close()

        self.response = ManagedStream


def build_app(llm: Any, serve_config: ServeConfig) -> Any:
    """The FastAPI application (``app.state.begin_drain()`` starts the shutdown sequence)."""
    fastapi, _ = require_server_deps()
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    admission = Admission(serve_config.max_pending_requests)
    parsers = resolve_parsers(serve_config.parsers)
    allow_tools = accepts_tools(parsers)
    model_name = serve_config.model_name
    limits = Limits(vocab_size=llm.engine.sampling_vocab_size, max_sequence_length=llm.context.max_sequence_length,
                    max_prompts=serve_config.max_pending_requests)
    streams = _Streams()

    def _parsed_delta(request: DynamicInferenceRequest, parsed: ParsedRequest) -> tuple[dict, str]:
        """The last chunk's delta of a parsed chat stream (tool calls with their ``index``) and finish reason."""
        generation = parse_generation(request.generated_text, parsers, parsed.chat)
        message = generation.message()
        delta = {key: message[key] for key in ("content", "reasoning_content") if message.get(key)}
        if generation.tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(generation.tool_calls)]
        return delta, generation.finish_reason(request_finish_reason(request), parsed.chat)

    def cancel_all() -> None:
        for request_id in list(admission.in_flight):
            llm.cancel(request_id)

    def begin_drain() -> None:
        """Refuse new requests; after ``shutdown_timeout_s`` cancel the running ones (they answer 503)."""
        if not admission.draining:
            admission.draining = True
            asyncio.get_running_loop().call_later(serve_config.shutdown_timeout_s, cancel_all)

    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        admission.draining = True
        cancel_all()  # anything uvicorn's graceful wait left behind

    app = fastapi.FastAPI(title="megatron_core inference", lifespan=lifespan)
    app.state.admission = admission
    app.state.begin_drain = begin_drain

    def _error(error: APIError) -> Any:
        headers = {"Retry-After": "1"} if error.status in (429, 503) else None
        return JSONResponse(error_body(error.status, error.message, error.param, error.code), error.status, headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Any, error: APIError) -> Any:
        return _error(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http_request: Any, error: Any) -> Any:
        message = f"{http_request.method} {http_request.url.path}: {error.detail}"
        return JSONResponse(error_body(error.status_code, message), error.status_code, getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Any, error: Exception) -> Any:
        logger.error("request failed: %s", describe(error), exc_info=error)
        return _error(APIError(500, f"internal error: {describe(error)}", code="internal_error"))

    async def _body(http_request: Any) -> Any:
        content_type = http_request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if content_type != "application/json" and not content_type.endswith("+json"):
            raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got "
                                f"{content_type!r}", "content-type")
        declared = http_request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > serve_config.max_request_bytes:
            raise APIError(413, f"the request body ({declared} bytes) exceeds {serve_config.max_request_bytes} bytes")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in http_request.stream():
                size += len(chunk)
                if size > serve_config.max_request_bytes:
                    raise APIError(413, f"the request body exceeds {serve_config.max_request_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            raw = await asyncio.wait_for(read(), serve_config.request_body_timeout_s)
        except asyncio.TimeoutError as error:
            raise APIError(408, f"the request body did not arrive within {serve_config.request_body_timeout_s} s") \
                from error
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise APIError(400, f"the request body is not valid JSON: {describe(error)}") from error

    def _submit(parsed: ParsedRequest) -> tuple[Ticket, list[tuple[int, Any]]]:
        ticket = admission.acquire(len(parsed.prompts))
        jobs: list[tuple[int, Any]] = []
        try:
            for prompt in parsed.prompts:
                jobs.append(llm.submit(prompt, parsed.params))
                ticket.track(jobs[-1][0])
        except (ValueError, EngineFailedError) as error:
            for request_id, _ in jobs:
                llm.cancel(request_id)
            ticket.release()
            raise _rejected(error) from error
        except BaseException:
            for request_id, _ in jobs:
                llm.cancel(request_id)
            ticket.release()
            raise
        return ticket, jobs

    async def _wait(http_request: Any, parsed: ParsedRequest) -> list[DynamicInferenceRequest] | None:
        ticket, jobs = _submit(parsed)
        futures = [asyncio.wrap_future(f) for _, f in jobs]
        try:
            while True:
                done, _ = await asyncio.wait(futures, timeout=DISCONNECT_POLL_S)
                if len(done) == len(futures):
                    results = [f.result() for f in futures]
                    for result in results:
                        error = _failure(result, admission.draining)
                        if error is not None:
                            raise error
                    return results
                if await http_request.is_disconnected():
                    return None
                if llm.engine_failure is not None:  # the loop died without failing these (it normally does)
                    raise APIError(503, f"the inference engine stopped: {llm.engine_failure}", code="engine_failed")
        finally:
            for (request_id, _), future in zip(jobs, futures):
                if not future.done():
                    llm.cancel(request_id)
            ticket.release()

    def _prompt_of(parsed: ParsedRequest, messages: list[dict] | None) -> None:
        if messages is not None:
            chat = parsed.chat
            parsed.prompts = [apply_chat_template(llm.tokenizer, messages, chat.tools, **chat.chat_template_kwargs)]
        if any(isinstance(p, str) for p in parsed.prompts) and llm.tokenizer is None:
            raise APIError(400, "this server has no tokenizer; send 'prompt' as token ids", "prompt")

    def _stream(parsed: ParsedRequest, chat: bool) -> Any:
        ticket = admission.acquire(1)
        try:
            request_id, tokens = llm.open_stream(parsed.prompts[0], parsed.params)
        except (ValueError, EngineFailedError) as error:
            ticket.release()
            raise _rejected(error) from error
        except BaseException:
            ticket.release()
            raise
        ticket.track(request_id)
        state = {"finished": False}
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | dict, reason: str | None) -> str:
            if isinstance(delta, dict):  # the parsed message of a chat stream, sent whole at its end
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            elif chat:
                choice = {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}
            return _sse({"id": parsed.request_id, "object": obj, "created": parsed.created, "model": model_name,
                         "choices": [choice]})

        def close() -> None:
            if not state["finished"]:
                state["finished"] = True
                llm.cancel(request_id)  # the client went away (or the response never started)
            ticket.release()

        async def events() -> AsyncIterator[str]:
            sent_text = ""
            try:
                if chat:
                    yield _sse({"id": parsed.request_id, "object": obj, "created": parsed.created, "model": model_name,
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
                async for token, request in tokens:
                    finished = token is None
                    if finished:
                        state["finished"] = True
                        error = _failure(request, admission.draining)
                        if error is not None and error.status != 503:
                            yield _sse(error_body(error.status, error.message, error.param, error.code))
                            yield _sse("[DONE]")
                            return
                    if chat and parsers:  # parsers read the whole text: send it once, parsed, at the end
                        if finished:
                            yield chunk(*_parsed_delta(request, parsed))
                            yield _sse("[DONE]")
                            return
                        continue
                    text = request.generated_text if finished else llm.controller.detokenize_generations(
                        request.generated_tokens, llm.controller.termination_id(request.sampling_params))[0]
                    delta, sent_text = text[len(sent_text):], text
                    if delta or finished:
                        yield chunk(delta, request_finish_reason(request) if finished else None)
                    if finished:
                        yield _sse("[DONE]")
                        return
            except Exception as error:  # noqa: BLE001 - the headers are sent: report in the stream
                logger.error("stream %s failed: %s", parsed.request_id, describe(error), exc_info=error)
                status = 503 if isinstance(error, EngineFailedError) else 500
                yield _sse(error_body(status, f"internal error while streaming: {describe(error)}"))
                yield _sse("[DONE]")
            finally:
                await tokens.aclose()
                close()

        return streams.response(events(), close)

    @app.get("/health")
    async def health() -> Any:
        failure = llm.engine_failure
        if failure is not None:
            body = error_body(503, f"the inference engine stopped: {failure}", code="engine_failed")
            return JSONResponse({"status": "engine_failed", "reason": failure, **body}, 503)
        if admission.draining:
            return JSONResponse({"status": "shutting_down", **error_body(503, "the server is shutting down")}, 503)
        return {"status": "ok", "in_flight": admission.used, "limit": admission.limit}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "megatron_core",
             "max_model_len": llm.context.max_sequence_length}
        ]}

    @app.post("/v1/completions")
    async def completions(http_request: fastapi.Request) -> Any:
        parsed = parse_completion_request(await _body(http_request), model_name, serve_config.default_max_tokens,
                                          limits)
        _prompt_of(parsed, None)
        if parsed.stream:
            return _stream(parsed, chat=False)
        results = await _wait(http_request, parsed)
        if results is None:
            return JSONResponse(error_body(499, "client disconnected"), 499)
        choices = [{"index": i, "text": r.generated_text, "logprobs": _logprobs_block(llm, r),
                    "finish_reason": request_finish_reason(r)} for i, r in enumerate(results)]
        return {"id": parsed.request_id, "object": "text_completion", "created": parsed.created, "model": model_name,
                "choices": choices, "usage": _usage(results)}

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: fastapi.Request) -> Any:
        parsed, messages = parse_chat_request(await _body(http_request), model_name, serve_config.default_max_tokens,
                                              limits, allow_tools)
        _prompt_of(parsed, messages)
        if parsed.stream:
            return _stream(parsed, chat=True)
        results = await _wait(http_request, parsed)
        if results is None:
            return JSONResponse(error_body(499, "client disconnected"), 499)
        r = results[0]
        message, reason = {"role": "assistant", "content": r.generated_text}, request_finish_reason(r)
        if parsers:
            generation = parse_generation(r.generated_text, parsers, parsed.chat)
            message, reason = generation.message(), generation.finish_reason(reason, parsed.chat)
        return {"id": parsed.request_id, "object": "chat.completion", "created": parsed.created, "model": model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
                "usage": _usage(results)}

    app.state.started = time.time()
    return app


def create_uvicorn_server(llm: Any, serve_config: ServeConfig) -> Any:
    """A ``uvicorn.Server`` for :func:`build_app` on ``serve_config.host:port`` (not started).

    Its shutdown first starts the app's drain (``begin_drain``), so the requests still running after
    ``shutdown_timeout_s`` are cancelled and answered before uvicorn's own limit (``CANCEL_MARGIN_S``
    later) would cut their connections with a plain-text 500.
    """
    _, uvicorn = require_server_deps()
    app = build_app(llm, serve_config)
    config = uvicorn.Config(
        app, host=serve_config.host, port=serve_config.port,
        log_level="info" if serve_config.verbose else "warning",
        timeout_graceful_shutdown=serve_config.shutdown_timeout_s + CANCEL_MARGIN_S, lifespan="on",
    )

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.state.begin_drain()
            await super().shutdown(sockets=sockets)

    return DrainingServer(config)
