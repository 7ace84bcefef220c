"""``sft`` library: chat conversations to token ids and loss targets (Megatron-Core 0.19's ``SFTTokenizer``).

A conversation is rendered with the prompt format's chat template and encoded without extra
special tokens. With ``return_target`` the target is a copy of the ids in which system, user and
tool turns, and the first ``assistant_prefix_len`` ids of each assistant turn, are
``IGNORE_INDEX`` (-100), so only the assistant's answers are trained (the loss mask is
``target != IGNORE_INDEX``). Turns are found by rendering each message alone, so the template must
render a conversation as the concatenation of its messages. The ``default`` and ``identity``
formats train on every id.

Megatron reads the files through ``transformers.AutoTokenizer``; this one reads the same
``tokenizer.json`` (with ``tokenizer_config.json``) through the ``tokenizers`` package
(:class:`HuggingFaceTokenizer`), renders templates with ``jinja2`` and never downloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_core.tokenizers.text.libraries.chat_template import render_and_tokenize
from megatron_core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer

__all__ = ["IGNORE_INDEX", "PromptConfig", "SFTTokenizer", "PROMPT_FORMATS", "mask_conversation_target",
           "render_conversation_ids", "template_variables"]

IGNORE_INDEX = -100
"""Target value of ids that take no loss."""

NEMOTRON_H_ALIGNED_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<SPECIAL_10>System\n{{ m.content | trim }}\n"
    "{% elif m.role == 'user' %}<SPECIAL_11>User\n{{ m.content | trim }}\n<SPECIAL_11>Assistant\n"
    "{% elif m.role == 'assistant' %}{{ m.content | trim }}\n"
    "{% endif %}{% endfor %}"
)
"""``nemotron-h-aligned``: the assistant header closes each user turn, so it takes no loss."""

NEMOTRON_NANO_V2_TEMPLATE = (
    "{% for m in messages %}"
    "{% set text = m.content | replace('/think', '') | replace('/no_think', '') %}"
    "{% if m.role == 'system' %}<SPECIAL_10>System\n{{ text | trim }}\n"
    "{% elif m.role == 'user' %}<SPECIAL_11>User\n{{ text | trim }}\n"
    "{% elif m.role == 'assistant' %}<SPECIAL_11>Assistant\n{{ m.content | trim }}\n<SPECIAL_12>\n"
    "{% endif %}{% endfor %}"
)
"""``nemotron-nano-v2``: ``/think`` and ``/no_think`` switches are removed from system and user text."""

IDENTITY_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
"""``identity``: the messages' text, concatenated."""


PROMPT_FORMATS = ("nemotron-nano-v2", "nemotron-h-aligned", "identity", "default")
"""The ``prompt_format`` names."""


@dataclass
class PromptConfig:
    """How one prompt format renders and masks a conversation."""

    assistant_prefix_len: int
    """Ids at the start of each assistant turn that take no loss (its header)."""
    pad_token_id: int | None
    """Padding id."""
    custom_chat_template: str | None
    """The Jinja chat template."""
    has_bos: bool
    """Whether each rendered message starts with BOS (dropped from every turn but the first)."""
    has_system_role: bool
    """Whether a leading system message is kept."""
    force_system_message: bool = False
    """Whether a system message is always inserted (used by multimodal formats)."""
    system_default: dict | None = None
    """The system message to insert."""


def _prompt_config(prompt_format: str, tokenizer: HuggingFaceTokenizer) -> PromptConfig:
    """The :class:`PromptConfig` of ``prompt_format`` for ``tokenizer``."""
    if prompt_format == "nemotron-nano-v2":
        return PromptConfig(3, _token_id(tokenizer, "<unk>"), NEMOTRON_NANO_V2_TEMPLATE, False, True)
    if prompt_format == "nemotron-h-aligned":
        return PromptConfig(0, _token_id(tokenizer, "<SPECIAL_233>"), NEMOTRON_H_ALIGNED_TEMPLATE, False, True)
    if prompt_format == "identity":
        return PromptConfig(0, _token_id(tokenizer, "<unk>"), IDENTITY_TEMPLATE, False, True)
    if prompt_format == "default":
        pad = _special(tokenizer, "pad")
        return PromptConfig(0, pad if pad is not None else _special(tokenizer, "eod"), tokenizer.chat_template,
                            _special(tokenizer, "bos") is not None, True)
    raise ValueError(f"SFTTokenizer: prompt_format {prompt_format!r} is not one of {list(PROMPT_FORMATS)}")


def _special(tokenizer: HuggingFaceTokenizer, role: str) -> int | None:
    """The tokenizer's ``role`` id, or ``None`` when it has none."""
    try:
        return getattr(tokenizer, role)
    except (NotImplementedError, AttributeError):
        return None


def _token_id(tokenizer: HuggingFaceTokenizer, token: str) -> int | None:
    """Id of ``token``; the unknown-token id (or ``None``) when it is not in the vocabulary."""
    return tokenizer.vocab.get(token, _special(tokenizer, "unk"))


def template_variables(tokenizer: HuggingFaceTokenizer) -> dict[str, str]:
    """The special tokens' texts (``bos_token``, ``eos_token``, ...), as chat templates expect them."""
    names = {"bos": "bos_token", "eod": "eos_token", "pad": "pad_token", "unk": "unk_token"}
    inverse = tokenizer.inv_vocab
    return {name: inverse[index] for role, name in names.items() if (index := _special(tokenizer, role)) is not None}


def render_conversation_ids(tokenizer: HuggingFaceTokenizer, config: PromptConfig, conversation: list[dict],
                            add_generation_prompt: bool) -> np.ndarray:
    """Ids of ``conversation`` rendered with ``config``'s template; the template writes its own special tokens."""
    ids = render_and_tokenize(tokenizer.tokenize, conversation, config.custom_chat_template,
                              add_generation_prompt=add_generation_prompt, **template_variables(tokenizer))
    return np.asarray(ids, dtype=np.int64)


def mask_conversation_target(target: np.ndarray, conversation: list[dict], tokenizer: HuggingFaceTokenizer,
                             config: PromptConfig, masked_roles: tuple[str, ...], owner: str) -> None:
    """Set ``target`` (the conversation's ids, edited in place) to :data:`IGNORE_INDEX` where no loss is taken.

    Each message is rendered alone (its BOS dropped after the first message when ``config.has_bos``)
    and must match the conversation's next ids. Messages whose role is in ``masked_roles`` are masked
    whole, the first ``assistant_prefix_len`` ids of an assistant message are masked, other roles are
    trained. Raises ``ValueError`` (prefixed with ``owner``) when the pieces do not add up to ``target``.
    """
    position = 0
    for index, turn in enumerate(conversation):
        role = str(turn["role"]).lower()
        turn_ids = render_conversation_ids(tokenizer, config, [turn], add_generation_prompt=False)
        if config.has_bos and index > 0 and len(turn_ids) and turn_ids[0] == _special(tokenizer, "bos"):
            turn_ids = turn_ids[1:]
        end = position + len(turn_ids)
        if not np.array_equal(target[position:end], turn_ids):
            raise ValueError(f"{owner}: messages[{index}] renders differently alone than in the conversation; "
                             "the template cannot be masked turn by turn")
        if role == "assistant":
            target[position:position + config.assistant_prefix_len] = IGNORE_INDEX
        elif role in masked_roles:
            target[position:end] = IGNORE_INDEX
        position = end
    if position != len(target):
        raise ValueError(f"{owner}: the messages cover {position} of the conversation's {len(target)} ids "
                         "(add_generation_prompt=True adds ids no message owns)")


class SFTTokenizer:
    """Tokenizer for supervised fine-tuning on conversations (``tokenize_conversation``)."""

    def __init__(self, tokenizer_path: str, prompt_format: str) -> None:
        self._tokenizer = HuggingFaceTokenizer(tokenizer_path)
        self._prompt_config = _prompt_config(prompt_format, self._tokenizer)
        self._prompt_format = prompt_format
        self._vocab_size = self._tokenizer.vocab_size

    def _render_ids(self, conversation: list[dict], add_generation_prompt: bool) -> np.ndarray:
        """Ids of the rendered ``conversation`` (:func:`render_conversation_ids`)."""
        return render_conversation_ids(self._tokenizer, self._prompt_config, conversation, add_generation_prompt)

    def tokenize_conversation(self, conversation: list[dict], return_target: bool, add_generation_prompt: bool):
        """Ids of ``conversation`` (``[{"role", "content"}, ...]``); with ``return_target``, ``(ids, target)``.

        The target masks with :data:`IGNORE_INDEX` what takes no loss (module docstring). Raises
        ``ValueError`` for an empty assistant turn, an assistant turn not after a user or tool turn,
        an unknown role, or a template whose per-message rendering does not add up to the whole.
        """
        config = self._prompt_config
        if not config.has_system_role and conversation and conversation[0]["role"] == "system":
            conversation = conversation[1:]
        tokens = self._render_ids(conversation, add_generation_prompt)
        if not return_target:
            return tokens
        target = tokens.copy()
        if self._prompt_format in ("default", "identity"):
            return tokens, target
        for index, turn in enumerate(conversation):
            role = str(turn["role"]).lower()
            if role == "assistant":
                if not turn["content"]:
                    raise ValueError(f"SFTTokenizer: messages[{index}] is an empty assistant turn")
                if index == 0 or str(conversation[index - 1]["role"]).lower() not in ("user", "tool"):
                    raise ValueError(f"SFTTokenizer: messages[{index}] (assistant) must follow a user or tool turn")
            elif role not in ("system", "user", "tool"):
                raise ValueError(f"SFTTokenizer: messages[{index}].role {turn['role']!r} is not system, user, "
                                 "tool or assistant")
        mask_conversation_target(target, conversation, self._tokenizer, config, ("system", "user", "tool"),
                                 f"SFTTokenizer ({self._prompt_format!r})")
        return tokens, target

    def text_to_ids(self, text: str | list[dict]) -> list[int]:
        """Ids of a string, or of a conversation with the generation prompt (the inference path)."""
        if isinstance(text, list):
            return self.tokenize_conversation(text, return_target=False, add_generation_prompt=True).tolist()
        return self._tokenizer.text_to_ids(text)

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        """Token strings to ids."""
        return self._tokenizer.tokens_to_ids(tokens)

    def ids_to_text(self, tokens: list[int]) -> str:
        """Ids to text, special tokens kept."""
        return self._tokenizer.ids_to_text(tokens, remove_special_tokens=False)

    def ids_to_tokens(self, *args: Any) -> list[str]:
        """Not supported (as in Megatron)."""
        raise NotImplementedError("This method is not supported for SFTTokenizer.")

    def text_to_tokens(self, *args: Any) -> list[str]:
        """Not supported (as in Megatron)."""
        raise NotImplementedError("This method is not supported for SFTTokenizer.")

    def tokens_to_text(self, *args: Any) -> str:
        """Not supported (as in Megatron)."""
        raise NotImplementedError("This method is not supported for SFTTokenizer.")

    def add_special_tokens(self, *args: Any) -> None:
        """Not supported (as in Megatron)."""
        raise NotImplementedError("This method is not supported for SFTTokenizer.")

    def get_special_tokens(self) -> dict[str, int]:
        """The added tokens of ``tokenizer.json`` (token text to id)."""
        added = self._tokenizer._tokenizer.get_added_tokens_decoder()
        return {token.content: index for index, token in sorted(added.items())}

    @property
    def pad_id(self) -> int | None:
        """The prompt format's padding id."""
        return self._prompt_config.pad_token_id

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id (``None`` when the tokenizer has none)."""
        return _special(self._tokenizer, "bos")

    @property
    def eod(self) -> int | None:
        """End-of-sequence id (``None`` when the tokenizer has none)."""
        return _special(self._tokenizer, "eod")

    @property
    def vocab(self) -> dict:
        """Not provided (Megatron does not use it)."""
        raise NotImplementedError("SFTTokenizer has no vocab")

    @property
    def inv_vocab(self) -> dict:
        """Not provided (Megatron does not use it)."""
        raise NotImplementedError("SFTTokenizer has no inv_vocab")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._vocab_size
