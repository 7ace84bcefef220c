"""Reasoning and tool calls in chat completions: the configured parsers applied to generated text.

``ServeConfig.parsers`` names parsers of
:data:`~megatron_core.tokenizers.text.parsers.PARSER_MAPPING`; :func:`resolve_parsers` checks the
names when the config is built. For each chat response the parsers run in order, each on the
content the previous one left (:func:`parse_generation`); ``reasoning`` becomes the message's
``reasoning_content`` and ``tool_calls`` its OpenAI ``tool_calls``, following Megatron-Core 0.19's
endpoint (and vLLM): tool calls count only when the request has ``tools`` and ``tool_choice`` is
not ``"none"``; ``parallel_tool_calls: false`` keeps the first; a named or ``"required"`` tool
choice empties the content; ``finish_reason`` ``"stop"`` becomes ``"tool_calls"`` unless a tool
was named. A parser that raises is logged and skipped: model output never fails a request.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from megatron_core.tokenizers.text.parsers import PARSER_MAPPING
from megatron_core.tokenizers.text.parsers.tool_arguments import (
    argument_schemas,
    normalize_structured_arguments,
)

__all__ = ["ChatOptions", "ParsedGeneration", "resolve_parsers", "accepts_tools", "parse_generation"]

logger = logging.getLogger(__name__)


def resolve_parsers(names: list[str]) -> list[tuple[str, type]]:
    """``(name, parser class)`` for each name; ``ValueError`` for unknown or repeated names or overlapping output."""
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"ServeConfig.parsers ({names!r}) must be a list of parser names such as "
                         f"['deepseek-r1-reasoning']")
    unknown = [name for name in names if name not in PARSER_MAPPING]
    if unknown:
        raise ValueError(f"ServeConfig.parsers: {unknown} are not parser names; choose from {list(PARSER_MAPPING)}")
    if len(set(names)) != len(names):
        raise ValueError(f"ServeConfig.parsers ({names}) names a parser twice")
    owner: dict[str, str] = {}
    for name in names:
        for key in getattr(PARSER_MAPPING[name], "extracts", ()):
            if key in owner:
                raise ValueError(f"ServeConfig.parsers: {owner[key]!r} and {name!r} both extract {key!r}; keep one")
            owner[key] = name
    return [(name, PARSER_MAPPING[name]) for name in names]


def accepts_tools(parsers: list[tuple[str, type]]) -> bool:
    """Whether one of the parsers extracts tool calls (only then does the server take ``tools``)."""
    return any("tool_calls" in getattr(parser, "extracts", ()) for _, parser in parsers)


@dataclass
class ChatOptions:
    """The tool and template fields of a validated chat request."""

    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def tools_requested(self) -> bool:
        """Tools were given and not switched off with ``tool_choice: "none"``."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def named_tool(self) -> bool:
        """``tool_choice`` names one function."""
        return isinstance(self.tool_choice, dict)


@dataclass
class ParsedGeneration:
    """One response after the parsers: the assistant message's fields."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The chat completion's ``message`` (``reasoning_content`` and ``tool_calls`` only when present)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        return out

    def finish_reason(self, generation_reason: str, options: ChatOptions) -> str:
        """``"tool_calls"`` when a generation that stopped by itself called tools (not a named one), else as given."""
        if generation_reason == "stop" and self.tool_calls and not options.named_tool:
            return "tool_calls"
        return generation_reason


def _openai_tool_call(call: Any, tools: list[dict] | None) -> dict[str, Any] | None:
    """``call`` in OpenAI's shape, or ``None`` when it has no function name.

    ``arguments`` becomes a JSON string; array and object arguments the tool declares that came as
    JSON text are parsed (:func:`normalize_structured_arguments`); text that is not JSON stays as is.
    """
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        return None
    raw = function.get("arguments", "{}")
    parsed = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
    if isinstance(parsed, dict):
        arguments = json.dumps(normalize_structured_arguments(parsed, argument_schemas(name, tools)),
                               ensure_ascii=False, default=str)
    elif isinstance(raw, str):
        arguments = raw  # not a JSON object: as the parser wrote it
    else:
        arguments = json.dumps(raw, ensure_ascii=False, default=str)
    call_id = call.get("id")
    return {"id": call_id if isinstance(call_id, str) and call_id else f"call_{uuid.uuid4().hex[:24]}",
            "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_generation(text: str, parsers: list[tuple[str, type]], options: ChatOptions) -> ParsedGeneration:
    """Run ``parsers`` over one generated ``text`` (module docstring for the rules)."""
    content, info = text, {}
    for name, parser in parsers:
        try:
            parsed, found = parser.parse(content, tools=options.tools,
                                         chat_template_kwargs=options.chat_template_kwargs)
        except Exception as error:  # noqa: BLE001 - model output must never fail the request
            logger.warning("parser %r failed on a response (%s: %s); its output is left as content",
                           name, type(error).__name__, error)
            continue
        if "tool_calls" in found and not options.tools_requested:
            continue  # tool-call syntax in a plain chat is content
        content = parsed if isinstance(parsed, str) else ""
        for key, value in found.items():
            info.setdefault(key, value)
    calls = [c for c in (_openai_tool_call(call, options.tools) for call in info.get("tool_calls") or []) if c is not None]
    if not options.parallel_tool_calls:
        calls = calls[:1]
    if calls and (options.named_tool or options.tool_choice == "required"):
        content = ""
    reasoning = info.get("reasoning")
    return ParsedGeneration(content, reasoning if isinstance(reasoning, str) else None, calls)
