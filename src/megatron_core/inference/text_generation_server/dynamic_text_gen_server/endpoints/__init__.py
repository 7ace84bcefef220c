"""The routes of the coordinator-fed server (Megatron-Core's ``dynamic_text_gen_server.endpoints``).

Megatron-Core lists Quart blueprints here; ours are framework-free handlers, each listed in
:data:`ROUTES` with its method and paths, and mounted on the FastAPI app by
:mod:`..text_generation_server`. A handler with a body returns the JSON response (or raises
``APIError``); one without returns ``(status, JSON)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_core.inference.text_generation_server.dynamic_text_gen_server.endpoints import (
    chat_completions,
    completions,
    health,
    profile,
)

__all__ = ["ROUTES", "Route"]


@dataclass(frozen=True)
class Route:
    """One endpoint: HTTP method, paths, handler, and whether the handler takes the JSON body."""

    method: str
    paths: tuple[str, ...]
    handler: Any
    takes_body: bool


ROUTES = (
    Route("POST", ("/completions", "/v1/completions"), completions.completions, True),
    Route("POST", ("/chat/completions", "/v1/chat/completions"), chat_completions.chat_completions, True),
    Route("GET", ("/health", "/v1/health"), health.health, False),
    Route("POST", ("/start_profile", "/v1/start_profile"), profile.start_profile, False),
    Route("POST", ("/stop_profile", "/v1/stop_profile"), profile.stop_profile, False),
)
