"""``GET /health`` and ``/v1/health`` (Megatron-Core's ``dynamic_text_gen_server.endpoints.health``)."""

from __future__ import annotations

from typing import Any

from megatron_core.inference.text_generation_server.dynamic_text_gen_server.endpoints.common import (
    ServerState,
)

__all__ = ["health"]


async def health(state: ServerState) -> tuple[int, dict[str, Any]]:
    """200 ``{"status": "ok", "ready": true}`` while the replica has its client, else 503."""
    body = {"status": "ok", "service": "Megatron Inference Server", "ready": state.client is not None}
    if state.client is None:
        return 503, {**body, "status": "error", "details": "Inference client not initialized"}
    return 200, body
