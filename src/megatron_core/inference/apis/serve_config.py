"""Settings of ``MegatronAsyncLLM.serve`` (Megatron-Core's ``apis.serve_config.ServeConfig``).

Differences from Megatron-Core: ``host`` defaults to ``127.0.0.1`` (loopback; pass ``0.0.0.0`` to
listen on every interface), one frontend process (``frontend_replicas`` is accepted and must be 1),
and the admission queue is bounded (``max_pending_requests`` generations, streaming or not, each
counted until its response ends; over it the server answers 429). Request bodies are bounded in
size (``max_request_bytes``, else 413) and in time (``request_body_timeout_s``, else 408).
``parsers`` are names in :data:`~megatron_core.tokenizers.text.parsers.PARSER_MAPPING` (checked
here, so a wrong name fails before the server starts); chat completions then answer with
``reasoning_content`` and ``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_core.inference.text_generation_server.response_parsers import resolve_parsers

__all__ = ["ServeConfig"]


@dataclass
class ServeConfig:
    """HTTP frontend settings."""

    host: str = "127.0.0.1"
    port: int = 5000
    parsers: list[str] = field(default_factory=list)
    verbose: bool = False
    frontend_replicas: int = 1
    model_name: str = "megatron"
    max_pending_requests: int = 256
    default_max_tokens: int = 16
    shutdown_timeout_s: float = 10.0
    max_request_bytes: int = 4 * 1024 * 1024
    request_body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServeConfig.port ({self.port}) must be in [0, 65535]")
        if self.frontend_replicas != 1:
            raise ValueError(f"ServeConfig.frontend_replicas ({self.frontend_replicas}) must be 1")
        if self.max_pending_requests < 1:
            raise ValueError(f"ServeConfig.max_pending_requests ({self.max_pending_requests}) must be >= 1")
        if self.max_request_bytes < 1 or self.request_body_timeout_s <= 0 or self.shutdown_timeout_s < 0:
            raise ValueError("ServeConfig: max_request_bytes and request_body_timeout_s must be > 0, "
                             "shutdown_timeout_s >= 0")
        resolve_parsers(self.parsers)
