"""Chat templates for library tokenizers (Megatron-Core 0.19's ``MegatronTokenizerChatTemplate``).

:func:`render_and_tokenize` is the one rule every tokenizer applies a chat template by: check the
arguments, render the Jinja template (:func:`~megatron_core.tokenizers.text.chat_template.render_chat_template`,
sandboxed, needs ``jinja2``), then return the text or its ids, cut to ``max_length`` when
``truncation`` is set. The mixin gives a library tokenizer ``apply_chat_template`` over its own
``text_to_ids``; ``MegatronTokenizerText`` and ``SFTTokenizer`` call the function directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_core.tokenizers.text.chat_template import render_chat_template

__all__ = ["MegatronTokenizerChatTemplate", "render_and_tokenize"]


def render_and_tokenize(
    encode: Callable[[str], list[int]],
    conversation: list[dict[str, Any]],
    chat_template: str | None,
    tokenize: bool = True,
    truncation: bool = False,
    max_length: int | None = None,
    add_generation_prompt: bool = False,
    **variables: Any,
) -> str | list[int]:
    """``conversation`` rendered with ``chat_template``: the text, or ``encode(text)`` when ``tokenize``.

    ``variables`` (e.g. ``bos_token``, ``tools``, ``enable_thinking``) are visible to the template.
    """
    if not chat_template:
        raise ValueError("apply_chat_template: no chat_template given and the tokenizer has none "
                         "(set metadata 'chat_template')")
    if truncation and not max_length:
        raise ValueError(f"apply_chat_template: truncation=True needs max_length (got {max_length!r})")
    text = render_chat_template(chat_template, conversation, add_generation_prompt=add_generation_prompt, **variables)
    if not tokenize:
        return text
    ids = list(encode(text))
    return ids[:max_length] if truncation else ids


class MegatronTokenizerChatTemplate:
    """Mixin for a library tokenizer with ``text_to_ids``: ``apply_chat_template`` as Megatron's."""

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str,
        tokenize: bool | None = True,
        truncation: bool | None = False,
        max_length: int | None = None,
        add_generation_prompt: bool | None = False,
        **variables: Any,
    ) -> str | list[int]:
        """Render ``conversation`` with ``chat_template``; ids from ``self.text_to_ids`` when ``tokenize``."""
        return render_and_tokenize(self.text_to_ids, conversation, chat_template, bool(tokenize), bool(truncation),
                                   max_length, bool(add_generation_prompt), **variables)
