"""What the endpoints of the coordinator-fed server share (Megatron-Core's ``dynamic_text_gen_server.endpoints.common``).

Megatron-Core's module holds the legacy multi-rank protocol (:data:`GENERATE_NUM`, :data:`LOCK`,
:func:`send_do_generate`), re-exported here from the legacy server. Ours adds the app state the
endpoints read (:class:`ServerState`) and the checks of finished requests (:func:`failed_requests`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from megatron_core.inference.text_generation_server.endpoints.common import (
    GENERATE_NUM,
    LOCK,
    send_do_generate,
)
from megatron_core.inference.text_generation_server.protocol import APIError

__all__ = ["GENERATE_NUM", "LOCK", "ServerState", "failed_requests", "flag", "gather", "integer", "number",
           "routing_indices", "send_do_generate"]

logger = logging.getLogger(__name__)

_REFUSED = "request refused"  # how the engine link words a request the engine would not take


@dataclass
class ServerState:
    """What one server replica's endpoints use: its client, the tokenizer, the resolved parsers."""

    client: Any
    tokenizer: Any
    parsers: list[tuple[str, type]]
    verbose: bool = False


def number(body: dict, name: str, default: float, low: float = -math.inf, high: float = math.inf) -> float:
    """``body[name]`` as a finite float in ``[low, high]`` (``default`` when absent or null), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise APIError(400, f"Invalid sampling parameter: '{name}' must be a number in [{low}, {high}], got {value!r}",
                       name)
    return float(value)


def integer(body: dict, name: str, default: int | None, low: int = 0) -> int | None:
    """``body[name]`` as an int ``>= low`` (``default`` when absent or null), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise APIError(400, f"Invalid sampling parameter: '{name}' must be an integer >= {low}, got {value!r}", name)
    return value


def flag(body: dict, name: str, default: bool) -> bool:
    """``body[name]`` as a boolean (``default`` when absent or null), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {value!r}", name)
    return value


async def gather(state: ServerState, prompts: list[list[int]], params: Any) -> list[dict]:
    """Submit every prompt through the client and wait for the finished (serialized) requests."""
    futures = [state.client.add_request(p, params) for p in prompts]
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:  # the client went away or the server stops
        for future in futures:
            future.cancel()
        raise


def failed_requests(results: list[dict]) -> APIError | None:
    """The error for a batch with failed requests (400 when a request was refused, else 500), or ``None``."""
    errors, refused = [], False
    for i, record in enumerate(results):
        if record.get("status") != "FAILED":
            continue
        events = [str(e) for e in record.get("events") or []]
        message = record.get("error") or next((e for e in reversed(events) if "ERROR" in e), "Unknown error")
        refused = refused or str(message).startswith(_REFUSED) or any("ERROR_NONTRANSIENT" in e for e in events)
        errors.append(f"Request {i}: {message}")
    if not errors:
        return None
    detail = "; ".join(errors)
    logger.error("inference request(s) failed: %s", detail)
    return APIError(400 if refused else 500, f"Inference request(s) failed: {detail}")


def routing_indices(result: dict) -> list | None:
    """A finished request's MoE routing indices as nested lists (``None`` when it has none)."""
    value = result.get("routing_indices")
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == "ndarray" and isinstance(value[1], dict):
        return value[1].get("data")
    return value
