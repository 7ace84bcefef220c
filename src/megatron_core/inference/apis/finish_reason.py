"""OpenAI's ``finish_reason`` of a finished request, shared by ``MegatronAsyncLLM`` and the HTTP server."""

from __future__ import annotations

from megatron_core.inference.engines.fault_isolation import CANCELLED
from megatron_core.inference.inference_request import DynamicInferenceRequest, Status

__all__ = ["request_finish_reason"]


def request_finish_reason(request: DynamicInferenceRequest) -> str:
    """OpenAI's ``finish_reason``: ``stop`` (termination token / stop word), ``length``, or ``cancelled``."""
    if request.status != Status.COMPLETED:
        return CANCELLED
    return request.finish_reason or "length"
