"""``BaseParser``: the interface of Megatron-Core 0.19's response parsers.

A parser turns the whole generated text of one response into ``(text, info)``: the text left for
``message.content`` and a dict of what it took out (``{"reasoning": str}``,
``{"tool_calls": [...]}``). Parsers are stateless static functions of the complete text, so one
instance serves concurrent requests; they never raise on malformed model output.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BaseParser"]


class BaseParser:
    """Parser that extracts nothing: returns the text unchanged and an empty dict."""

    extracts: tuple[str, ...] = ()
    """The ``info`` keys this parser may return (the server refuses two parsers sharing one)."""

    @staticmethod
    def parse(text: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        """``(remaining text, extracted information)``; keyword arguments are request context."""
        return text, {}
