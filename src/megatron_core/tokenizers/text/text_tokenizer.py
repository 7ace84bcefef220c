"""``MegatronTokenizerText``: the text tokenizer ``MegatronTokenizer.from_pretrained`` returns.

It wraps one library tokenizer (``self._tokenizer``, built from the metadata's ``library``; the
libraries are :mod:`megatron_core.tokenizers.text.libraries`) and exposes Megatron's text tokenizer
interface: ``tokenize``/``detokenize``, the vocab, chat templates and the special ids. A special id
the library does not define reads as ``None``.
"""

from __future__ import annotations

import importlib
import inspect
from collections import OrderedDict
from typing import Any

from megatron_core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron_core.tokenizers.text.libraries.chat_template import render_and_tokenize

TOKENIZER_MAPPING_LIBRARIES = OrderedDict(
    [
        ("sentencepiece", "SentencePieceTokenizer"),
        ("huggingface", "HuggingFaceTokenizer"),
        ("megatron", "MegatronHFTokenizer"),
        ("tiktoken", "TikTokenTokenizer"),
        ("byte-level", "ByteLevelTokenizer"),
        ("null-text", "NullTokenizer"),
        ("sft", "SFTTokenizer"),
    ]
)
"""Metadata ``library`` to class name in :mod:`megatron_core.tokenizers.text.libraries`."""


def _special_id(attribute: str, doc: str) -> property:
    """A property reading ``attribute`` of the library tokenizer; ``None`` when it defines no such id."""

    def getter(self: MegatronTokenizerText) -> int | None:
        try:
            return getattr(self._tokenizer, attribute)
        except (NotImplementedError, AttributeError):
            return None

    return property(getter, doc=doc)


class MegatronTokenizerText(MegatronTokenizerBase):
    """Base class of the text tokenizers (one per ``model_type``).

    Records the concrete class in the metadata (``class_name``, ``class_path``), so every subclass
    round-trips through ``MegatronTokenizer.from_pretrained`` without code of its own.
    """

    def __init__(self, path: str | None = None, config: dict | None = None, **kwargs: Any) -> None:
        self._init_library_tokenizer(path, config, TOKENIZER_MAPPING_LIBRARIES, **kwargs)
        config = config or {}
        self._tokenizer = self._restore_model(**kwargs)
        self.additional_args = kwargs
        self.path = path
        config_template = config.get("chat_template")
        kwargs_template = kwargs.get("chat_template")
        if config_template is not None:
            self.chat_template = config_template
        elif kwargs_template is not None:
            self.chat_template = kwargs_template
        else:
            self.chat_template = getattr(self._tokenizer, "chat_template", None)

    def _restore_model(self, **kwargs: Any) -> Any:
        """Build the library tokenizer named by ``self.library``."""
        libraries = importlib.import_module("megatron_core.tokenizers.text.libraries")
        library_class = getattr(libraries, TOKENIZER_MAPPING_LIBRARIES[self.library])
        if self.library in ("byte-level", "null-text"):
            return library_class(**kwargs)
        return library_class(self.path, **kwargs)

    def tokenize(self, text: str) -> list[int]:
        """Text to token ids."""
        return self._tokenizer.text_to_ids(text)

    def detokenize(self, ids: list[int], skip_special_tokens: bool | None = None) -> str:
        """Token ids to text; ``skip_special_tokens`` is honoured by libraries that support it."""
        ids_to_text = self._tokenizer.ids_to_text
        if skip_special_tokens is not None and "remove_special_tokens" in inspect.signature(ids_to_text).parameters:
            return ids_to_text(ids, remove_special_tokens=skip_special_tokens)
        return ids_to_text(ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        chat_template: str | None = None,
        tokenize: bool = True,
        truncation: bool = False,
        max_length: int | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``conversation`` with a Jinja chat template (the tokenizer's unless given).

        Returns the token ids (cut to ``max_length`` when ``truncation``) or, with
        ``tokenize=False``, the text. Needs the ``jinja2`` package.
        """
        return render_and_tokenize(
            self.tokenize, conversation, chat_template or self.chat_template, tokenize, truncation, max_length,
            add_generation_prompt, **self._template_tokens(), **kwargs,
        )

    def _template_tokens(self) -> dict[str, str]:
        """The bos/eos token texts, which chat templates commonly reference."""
        names = {}
        for name, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
            if token_id is not None and token_id >= 0:
                try:
                    names[name] = self.detokenize([token_id], skip_special_tokens=False)
                except (KeyError, IndexError, ValueError, NotImplementedError):
                    pass
        return names

    def tokenize_conversation(self, conversation: list[dict], return_target: bool, add_generation_prompt: bool):
        """Ids of a chat (and, with ``return_target``, its loss targets); the ``sft`` library only."""
        if self.library != "sft":
            raise NotImplementedError(f"tokenize_conversation is supported only for the 'sft' library, "
                                      f"not {self.library!r}")
        return self._tokenizer.tokenize_conversation(
            conversation=conversation, return_target=return_target, add_generation_prompt=add_generation_prompt
        )

    def save_pretrained(self, path: str) -> None:
        """Save the tokenizer files (``huggingface`` and ``megatron`` libraries) into directory ``path``."""
        if self.library not in ("huggingface", "megatron"):
            raise ValueError(f"save_pretrained method is not supported with {self.library} library.")
        self._tokenizer.save_pretrained(path)

    def add_special_tokens(self, special_tokens: list | dict) -> None:
        """Add special tokens to the vocabulary (where the library supports it)."""
        self._tokenizer.add_special_tokens(special_tokens)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """Character offset in ``text`` where each token starts."""
        return self._tokenizer.offsets(ids=ids, text=text)

    @property
    def space_sensitive(self) -> bool:
        """Whether ``tokenize('x y')`` differs from ``tokenize('x') + tokenize('y')``."""
        if self.library not in ("sentencepiece", "huggingface"):
            raise NotImplementedError(f"This method is not supported for {self.library} tokenizers.")
        return self.tokenize("x y") != self.tokenize("x") + self.tokenize("y")

    @property
    def additional_special_tokens_ids(self) -> list | None:
        """Ids of the library's additional special tokens."""
        return getattr(self._tokenizer, "additional_special_tokens_ids", None)

    @property
    def vocab_size(self) -> int:
        """Number of ids."""
        return self._tokenizer.vocab_size

    @property
    def vocab(self) -> Any:
        """The library's vocabulary."""
        return self._tokenizer.vocab

    @property
    def inv_vocab(self) -> dict:
        """Id to token."""
        return self._tokenizer.inv_vocab

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Class, path and options; datasets hash them into their index-cache names."""
        identifiers: OrderedDict[str, Any] = OrderedDict()
        identifiers["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        identifiers["tokenizer_path"] = self.path
        for name, value in self.additional_args.items():
            identifiers[name] = str(value)
        return identifiers

    @property
    def vocab_file(self) -> str | None:
        """``vocab_file`` keyword argument, if given."""
        return self.additional_args.get("vocab_file")

    @property
    def merges_file(self) -> str | None:
        """``merges_file`` keyword argument, if given."""
        return self.additional_args.get("merges_file")

    eod = _special_id("eod", "End-of-document id.")
    pad = _special_id("pad_id", "Padding id.")
    pad_id = _special_id("pad_id", "Padding id.")
    bos = _special_id("bos_id", "Beginning-of-sequence id.")
    bos_id = _special_id("bos_id", "Beginning-of-sequence id.")
    eos = _special_id("eos_id", "End-of-sequence id.")
    eos_id = _special_id("eos_id", "End-of-sequence id.")
    unk = _special_id("unk_id", "Unknown-token id.")
    unk_id = _special_id("unk_id", "Unknown-token id.")
    mask = _special_id("mask_id", "Mask id.")
    mask_id = _special_id("mask_id", "Mask id.")
    cls = _special_id("cls_id", "Classification id.")
    cls_id = _special_id("cls_id", "Classification id.")
    sep = _special_id("sep_id", "Separator id.")
    sep_id = _special_id("sep_id", "Separator id.")
