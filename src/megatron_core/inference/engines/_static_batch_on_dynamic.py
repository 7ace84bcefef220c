"""One static batch served by the dynamic engine (the non-legacy path of ``StaticInferenceEngine.run_engine``).

Megatron-Core 0.19's ``run_engine`` always calls the controller's static-batch loop, which needs a
``StaticInferenceContext``; with ``legacy=False`` its engine has already swapped the wrapper's context for the
dynamic engine's, so that combination fails there. Here the scheduler's batch is queued on the dynamic engine
instead and stepped until every request ends; the results are copied into the scheduler's
:class:`InferenceRequest` objects. A streaming request gets a token listener that puts a partial
:class:`InferenceRequest` on its :class:`AsyncStream` after every token, then the finished request when it differs
from the last partial one (stop words are only stripped at the end), then finishes the stream (with a
``RuntimeError`` when the request failed).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from megatron_core.inference.async_stream import AsyncStream
from megatron_core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_core.inference.inference_request import DynamicInferenceRequest, InferenceRequest, Status

__all__ = ["generate_static_batch_on_dynamic_engine"]

# The request's own fields; every other InferenceRequest field is a result copied back from the dynamic engine.
_INPUT_FIELDS = frozenset({"request_id", "prompt", "sampling_params", "inference_parameters", "prompt_tokens",
                           "prompt_length", "arrival_time", "encoder_prompt"})


class _StreamPublisher:
    """Token listener that puts the partial results of one request on its stream."""

    def __init__(self, controller: Any, request: InferenceRequest, stream: AsyncStream) -> None:
        self.controller = controller
        self.request = request
        self.stream = stream
        self.last: tuple[list[int], str | None] | None = None

    def _put(self, live: DynamicInferenceRequest, text: str | None, segments: list[str] | None) -> None:
        tokens = list(live.generated_tokens)
        self.last = (tokens, text)
        self.stream.put(InferenceRequest(
            request_id=self.request.request_id, prompt=self.request.prompt, sampling_params=live.sampling_params,
            prompt_tokens=self.request.prompt_tokens, arrival_time=self.request.arrival_time, status=live.status,
            encoder_prompt=self.request.encoder_prompt, generated_text=text, generated_segments=segments,
            generated_tokens=tokens, generated_length=len(tokens),
            generated_log_probs=None if live.generated_log_probs is None else list(live.generated_log_probs),
        ))

    def __call__(self, live: DynamicInferenceRequest, token: int | None) -> None:
        if token is not None:
            params = live.sampling_params
            text, segments = self.controller.detokenize_generations(
                live.generated_tokens, self.controller.termination_id(params), params.detokenize_stop_sequence,
                params.return_segments)
            self._put(live, text, segments)
            return
        if live.status != Status.COMPLETED:
            self.stream.finish(exception=RuntimeError(f"request {self.request.request_id!r} failed: {live.error}"))
            return
        if self.last != (list(live.generated_tokens), live.generated_text):
            self._put(live, live.generated_text, live.generated_segments)
        self.stream.finish()


def _copy_results(result: DynamicInferenceRequest, request: InferenceRequest) -> None:
    """Copy the result fields of the dynamic engine's ``result`` into the scheduler's ``request``."""
    for field in dataclasses.fields(InferenceRequest):
        if field.name not in _INPUT_FIELDS:
            setattr(request, field.name, getattr(result, field.name))


def generate_static_batch_on_dynamic_engine(
    engine: DynamicInferenceEngine, active_requests: OrderedDict[Any, InferenceRequest],
    active_streams: dict[Any, AsyncStream] | None = None,
) -> OrderedDict[Any, InferenceRequest]:
    """Serve ``active_requests`` (ids kept) to completion on ``engine``; the requests, filled in.

    A request the engine refuses raises here (the batch's other requests are cancelled first).
    """
    streams = active_streams or {}
    futures = {}
    try:
        for request_id, request in active_requests.items():
            stream = streams.get(request_id)
            if stream is not None:
                engine.add_token_listener(request_id, _StreamPublisher(engine.controller, request, stream))
            try:
                futures[request_id] = engine.add_request(request_id, request.prompt_tokens, request.sampling_params)
            except BaseException:
                engine.remove_token_listeners(request_id)
                raise
        while not all(f.done() for f in futures.values()):
            engine.step_modern()
    except BaseException:
        for request_id, future in futures.items():
            if not future.done():
                engine.cancel_request(request_id)
        if not all(f.done() for f in futures.values()):
            engine.step_modern()  # applies the cancellations, so the engine holds none of this batch
        raise
    for request_id, request in active_requests.items():
        _copy_results(futures[request_id].result(), request)
    return active_requests
