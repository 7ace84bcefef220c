"""``NemotronV3ReasoningParser``: the R1 split, with the thought as answer when the client asks for one.

Nemotron 3 (Super, Ultra) emit ``<think>`` blocks like DeepSeek-R1. When the request's
``chat_template_kwargs`` turn thinking off (``enable_thinking: false``) or ask for
``force_nonempty_content: true``, a response whose answer would be empty (the thought never closed,
or nothing followed ``</think>``) returns its reasoning as the answer instead, as vLLM's Nemotron 3
parsers do.
"""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.text.parsers.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

__all__ = ["NemotronV3ReasoningParser"]


class NemotronV3ReasoningParser(DeepSeekR1ReasoningParser):
    """Reasoning parser for NVIDIA Nemotron 3 models."""

    @staticmethod
    def _should_force_content(chat_template_kwargs: dict | None) -> bool:
        """Whether an empty answer takes the reasoning (thinking disabled or non-empty content forced)."""
        if not isinstance(chat_template_kwargs, dict):
            return False
        return (chat_template_kwargs.get("enable_thinking") is False
                or chat_template_kwargs.get("force_nonempty_content") is True)

    @staticmethod
    def parse(text: str, **kwargs: Any) -> tuple[str, dict[str, str]]:
        """As :meth:`DeepSeekR1ReasoningParser.parse`; reads ``chat_template_kwargs`` from ``kwargs``."""
        answer, info = DeepSeekR1ReasoningParser.parse(text, **kwargs)
        if not answer and info and NemotronV3ReasoningParser._should_force_content(kwargs.get("chat_template_kwargs")):
            return info["reasoning"], {}
        return answer, info
