"""``DeepSeekR1ReasoningParser``: splits ``<think>...</think>`` reasoning from the answer.

The model's prompt usually ends with the opening ``<think>``, so generated text without any tag is
all reasoning (the model never closed its thought), as in vLLM's and Megatron-Core's R1 parser.
Text before the first ``<think>`` is dropped; the split is at the first ``</think>`` after it.
"""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.text.parsers.base_parser import BaseParser

__all__ = ["DeepSeekR1ReasoningParser", "THINK_START", "THINK_END"]

THINK_START = "<think>"
THINK_END = "</think>"


class DeepSeekR1ReasoningParser(BaseParser):
    """Reasoning parser for DeepSeek-R1-style ``<think>`` blocks."""

    extracts = ("reasoning",)

    @staticmethod
    def parse(text: str, **kwargs: Any) -> tuple[str, dict[str, str]]:
        """``(answer, {"reasoning": thought})``; the dict is empty when the thought is empty.

        Unterminated thought (no ``</think>``): everything after ``<think>`` is reasoning and the
        answer is ``""``.
        """
        opened = text.find(THINK_START)
        body = text[opened + len(THINK_START):] if opened >= 0 else text
        reasoning, closed, answer = body.partition(THINK_END)
        if not closed:
            answer = ""
        return answer, ({"reasoning": reasoning} if reasoning else {})
