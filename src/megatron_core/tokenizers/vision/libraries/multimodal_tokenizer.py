"""``multimodal`` library: LLaVA-style conversations with images to ids and loss targets.

Megatron-Core 0.19's ``MegatronMultimodalTokenizer``. The ``special_tokens`` (e.g. ``<image>``) are
added to the vocabulary as special tokens, so each ``<image>`` in a prompt becomes exactly one id;
the tokenizer never expands it: LLaVA (``image_token_index`` set to
``convert_tokens_to_ids("<image>")``) later gives that one position all ``tiles * img_seq_len``
image embeddings. An ``image_tag_type`` (``"nvlm"``: ``<Image>``/``</Image>``, ``"internvl"``:
``<img>``/``</img>``) wraps every ``<image>`` in its tags first.

Conversations are rendered in a ``prompt_format`` (:data:`PROMPT_FORMATS`) and masked with the
``sft`` library's rule (:func:`~megatron_core.tokenizers.text.libraries.sft_tokenizer.mask_conversation_target`):
system and user turns and each assistant header take no loss (``IGNORE_INDEX``); other roles are
trained, as in Megatron. ``vocab_size`` counts the ids before ``special_tokens`` were added, as in
Megatron. Files are read with the ``tokenizers`` package (no ``transformers``, no downloads).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
from megatron_core.tokenizers.text.libraries.sft_tokenizer import (
    IGNORE_INDEX,
    PromptConfig,
    _special,
    _token_id,
    mask_conversation_target,
    render_conversation_ids,
)
from megatron_core.tokenizers.vision.image_tokens import IMAGE_TOKEN
from megatron_core.tokenizers.vision.libraries import multimodal_templates as templates

__all__ = ["IGNORE_INDEX", "IMAGE_TAGS", "PROMPT_FORMATS", "MegatronMultimodalTokenizer"]

IMAGE_TAGS: dict[str, tuple[str, str] | None] = {
    "nvlm": ("<Image>", "</Image>"),
    "internvl": ("<img>", "</img>"),
    "": None,
}
"""``image_tag_type`` to the (opening, closing) tags put around each ``<image>`` (``""``: none)."""

PROMPT_FORMATS = ("mistral", "llama3", "llama3p1", "llama3p2", "nvlm-yi-34b", "chatml", "nemotron5",
                  "nemotron5-aligned", "qwen2p0", "qwen2p5")
"""The ``prompt_format`` names."""

QWEN_SYSTEM_DEFAULT = {"role": "system",
                       "content": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."}
"""System message the Qwen formats insert with ``force_system_message``."""


def _prompt_config(prompt_format: str, tokenizer: HuggingFaceTokenizer, force_system_message: bool) -> PromptConfig:
    """The :class:`PromptConfig` of ``prompt_format`` (assistant header length, pad id, template, BOS, system)."""
    own = tokenizer.chat_template
    pad = _special(tokenizer, "pad")
    configs = {
        "mistral": lambda: PromptConfig(0, _special(tokenizer, "unk"), templates.MISTRAL_TEMPLATE, True, False),
        "llama3": lambda: PromptConfig(4, _token_id(tokenizer, "<|end_of_text|>"), own, True, True),
        "llama3p1": lambda: PromptConfig(4, _token_id(tokenizer, "<|finetune_right_pad_id|>"),
                                         templates.LLAMA3P1_TEMPLATE, True, True),
        "nvlm-yi-34b": lambda: PromptConfig(4, pad, templates.NVLM_YI_34B_TEMPLATE, True, True),
        "chatml": lambda: PromptConfig(3, pad, own, False, True),
        "nemotron5": lambda: PromptConfig(3, _token_id(tokenizer, "<SPECIAL_233>"), templates.NEMOTRON5_TEMPLATE,
                                          True, True),
        "nemotron5-aligned": lambda: PromptConfig(2, _token_id(tokenizer, "<SPECIAL_233>"),
                                                  templates.NEMOTRON5_ALIGNED_TEMPLATE, True, True),
        "qwen2p0": lambda: PromptConfig(3, pad, templates.QWEN2P0_TEMPLATE, False, True,
                                        force_system_message, dict(QWEN_SYSTEM_DEFAULT)),
    }
    configs["llama3p2"] = configs["llama3p1"]
    configs["qwen2p5"] = configs["qwen2p0"]
    if prompt_format not in configs:
        raise ValueError(f"MegatronMultimodalTokenizer: prompt_format {prompt_format!r} is not one of "
                         f"{list(PROMPT_FORMATS)}")
    config = configs[prompt_format]()
    if force_system_message and config.system_default is None:
        raise ValueError(f"MegatronMultimodalTokenizer: force_system_message=True needs a prompt_format with a "
                         f"default system message (qwen2p0, qwen2p5), not {prompt_format!r}")
    return config


class MegatronMultimodalTokenizer:
    """Tokenizer for conversations with ``<image>`` placeholders (``tokenize_conversation``)."""

    def __init__(self, path: str, prompt_format: str, special_tokens: list[str] | None, image_tag_type: str | None,
                 force_system_message: bool = False, **kwargs: Any) -> None:
        if image_tag_type is None:
            image_tag_type = ""
        if image_tag_type not in IMAGE_TAGS:
            raise ValueError(f"MegatronMultimodalTokenizer: image_tag_type {image_tag_type!r} is not one of "
                             f"{list(IMAGE_TAGS)}")
        self.tokenizer = HuggingFaceTokenizer(path, **kwargs)
        self._vocab_size = self.tokenizer.vocab_size
        special_tokens = list(special_tokens or [])
        present = [token for token in special_tokens if token in self.tokenizer.vocab]
        if present or len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"MegatronMultimodalTokenizer: special_tokens {special_tokens} must be new and distinct; "
                             f"already in the vocabulary: {present}")
        self.tokenizer.add_special_tokens(special_tokens)
        self._prompt_config = _prompt_config(prompt_format, self.tokenizer, force_system_message)
        self._prompt_format = prompt_format
        self._image_tag = IMAGE_TAGS[image_tag_type]

    def _apply_image_tag(self, text: str) -> str:
        """``text`` with every ``<image>`` wrapped in the image tags (unchanged without tags)."""
        if self._image_tag is None:
            return text
        opening, closing = self._image_tag
        return text.replace(IMAGE_TOKEN, f"{opening}{IMAGE_TOKEN}{closing}")

    def _prepare(self, conversation: list[dict]) -> list[dict]:
        """A checked copy of ``conversation``: system message dropped or forced, image tags applied."""
        if not isinstance(conversation, list) or not conversation:
            raise ValueError(f"MegatronMultimodalTokenizer: conversation must be a non-empty list of messages, "
                             f"got {conversation!r}")
        for index, turn in enumerate(conversation):
            if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) \
                    or not isinstance(turn.get("content"), str):
                raise ValueError(f"MegatronMultimodalTokenizer: messages[{index}] must be a dict with string "
                                 f"'role' and 'content', got {turn!r}")
        config = self._prompt_config
        if not config.has_system_role and conversation[0]["role"] == "system":
            conversation = conversation[1:]
        if config.force_system_message:
            if conversation and conversation[0]["role"] == "system":
                conversation = conversation[1:]
            conversation = [config.system_default, *conversation]
        return [{**turn, "content": self._apply_image_tag(turn["content"])} for turn in conversation]

    def tokenize(self, text: str | list[dict]) -> list[int]:
        """Ids of a string (image tags applied), or of a conversation with the generation prompt (inference)."""
        if isinstance(text, list):
            return self.tokenize_conversation(text, return_target=False, add_generation_prompt=True).tolist()
        return self.tokenizer.text_to_ids(self._apply_image_tag(text))

    def tokenize_conversation(self, conversation: list[dict], return_target: bool, add_generation_prompt: bool):
        """Ids of ``conversation`` (``[{"role", "content"}, ...]``); with ``return_target``, ``(ids, target)``.

        Raises ``ValueError`` for a malformed or empty conversation and, with ``return_target``, for an
        empty message, an ``<image>`` in an assistant message, or a template that cannot be masked turn
        by turn (the generation prompt belongs to no message, so it cannot be combined with a target).
        """
        conversation = self._prepare(conversation)
        tokens = render_conversation_ids(self.tokenizer, self._prompt_config, conversation, add_generation_prompt)
        if not return_target:
            return tokens
        for index, turn in enumerate(conversation):
            if not turn["content"]:
                raise ValueError(f"MegatronMultimodalTokenizer: messages[{index}] ({turn['role']}) is empty")
            if turn["role"].lower() == "assistant" and IMAGE_TOKEN in turn["content"]:
                raise ValueError(f"MegatronMultimodalTokenizer: messages[{index}] (assistant) contains "
                                 f"{IMAGE_TOKEN!r}; images belong in user turns")
        target = tokens.copy()
        mask_conversation_target(target, conversation, self.tokenizer, self._prompt_config, ("system", "user"),
                                 f"MegatronMultimodalTokenizer ({self._prompt_format!r})")
        return tokens, target

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Token text(s) to id(s); unknown tokens give the unknown-token id (``None`` without one)."""
        if isinstance(tokens, str):
            return _token_id(self.tokenizer, tokens)
        return [_token_id(self.tokenizer, token) for token in tokens]

    def detokenize(self, tokens: list[int]) -> str:
        """Ids to text, special tokens kept."""
        return self.tokenizer.ids_to_text(np.asarray(tokens).tolist(), remove_special_tokens=False)

    def add_special_tokens(self, special_tokens: list[str] | dict) -> None:
        """Add special tokens (a list, or a role dict such as ``{"pad_token": "<pad>"}``)."""
        self.tokenizer.add_special_tokens(special_tokens)

    def get_special_tokens(self) -> dict[str, int]:
        """Every added token of the vocabulary (token text to id), ``special_tokens`` included."""
        added = self.tokenizer._tokenizer.get_added_tokens_decoder()
        return {token.content: index for index, token in sorted(added.items())}

    @property
    def pad(self) -> int | None:
        """The prompt format's padding id."""
        return self._prompt_config.pad_token_id

    @property
    def eod(self) -> int | None:
        """End-of-sequence id (``None`` when the tokenizer has none)."""
        return _special(self.tokenizer, "eod")

    @property
    def vocab_size(self) -> int:
        """Number of ids before ``special_tokens`` were added (as Megatron counts)."""
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        """Token text to id, added tokens included."""
        return dict(self.tokenizer.vocab)
