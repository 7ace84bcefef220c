"""``Qwen3CoderToolParser``: Qwen3-Coder's XML tool calls as OpenAI ``tool_calls``.

The model writes::

    some text<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each ``<function=NAME>`` becomes ``{"type": "function", "id": "call_...", "function": {"name",
"arguments"}}`` with ``arguments`` a JSON string, typed by the request's ``tools`` schema
(:mod:`.tool_arguments`). ``<function=`` blocks outside ``<tool_call>`` tags count when no tags are
present; a truncated block (missing closing tags) still yields what it holds. The text before
the first call is the remaining content; text after the calls is dropped. Output with no
parsable call comes back unchanged with no ``tool_calls``; nothing here raises on model output.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from megatron_core.tokenizers.text.parsers.base_parser import BaseParser
from megatron_core.tokenizers.text.parsers.tool_arguments import argument_schemas, convert_argument

__all__ = ["Qwen3CoderToolParser"]

logger = logging.getLogger(__name__)

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"


def _sections(text: str, start: str, end: str) -> list[str]:
    """Bodies of ``start ... end`` in order; an unclosed last ``start`` runs to the end of ``text``."""
    bodies, position = [], 0
    while (opened := text.find(start, position)) >= 0:
        body_start = opened + len(start)
        closed = text.find(end, body_start)
        if closed < 0:
            bodies.append(text[body_start:])
            break
        bodies.append(text[body_start:closed])
        position = closed + len(end)
    return bodies


def _parameters(body: str) -> list[tuple[str, str]]:
    """``(name, raw value)`` of each ``<parameter=NAME>value`` in a function body.

    A value ends at ``</parameter>``, at the next ``<parameter=`` or at the end of the body; one
    newline on each side of it is layout, not value.
    """
    found = []
    chunks = body.split(PARAMETER_START)[1:]
    for chunk in chunks:
        name, separator, value = chunk.split(PARAMETER_END, 1)[0].partition(">")
        if not separator:
            continue  # no name: truncated, or malformed
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        found.append((name, value))
    return found


def _tool_call(body: str, tools: Any) -> dict[str, Any] | None:
    """One OpenAI tool call from the text after ``<function=``, or ``None`` when its name is unclosed."""
    name, separator, rest = body.partition(">")
    if not separator:
        return None
    schemas = argument_schemas(name, tools)
    arguments = {key: convert_argument(value, schemas.get(key), key in schemas) for key, value in _parameters(rest)}
    return {"type": "function", "id": f"call_{uuid.uuid4().hex[:24]}",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def extract_tool_calls(text: str, tools: Any = None) -> tuple[str, list[dict[str, Any]]]:
    """``(content before the calls, tool calls)``; ``(text, [])`` when there is no parsable call."""
    if FUNCTION_START not in text:
        return text, []
    blocks = _sections(text, TOOL_CALL_START, TOOL_CALL_END) or [text]
    calls = [_tool_call(body, tools) for block in blocks for body in _sections(block, FUNCTION_START, FUNCTION_END)]
    calls = [call for call in calls if call is not None]
    if not calls:
        return text, []
    cut = text.find(TOOL_CALL_START)
    return text[: cut if cut >= 0 else text.find(FUNCTION_START)], calls


class Qwen3CoderToolParser(BaseParser):
    """Tool-call parser for Qwen3-Coder's ``<tool_call><function=...>`` format."""

    extracts = ("tool_calls",)

    @staticmethod
    def parse(text: str, **kwargs: Any) -> tuple[str, dict[str, list[dict]]]:
        """``(content, {"tool_calls": [...]})``, or ``(text, {})`` when no call parses.

        ``kwargs["tools"]`` (the request's OpenAI ``tools``) types the arguments.
        """
        try:
            content, calls = extract_tool_calls(text, kwargs.get("tools"))
        except Exception:  # noqa: BLE001 - model output must never fail the request
            logger.exception("tool-call parsing failed; returning the text as content")
            return text, {}
        return (content, {"tool_calls": calls}) if calls else (text, {})
