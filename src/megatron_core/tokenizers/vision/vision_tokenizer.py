"""``MegatronTokenizerVision``: the vision tokenizer ``MegatronTokenizer.from_pretrained`` returns.

It wraps one library tokenizer (``self._tokenizer``, built from the metadata's ``library``; the
libraries are :mod:`megatron_core.tokenizers.vision.libraries`) and exposes Megatron's vision
tokenizer interface: ``tokenize`` (a string, or a conversation for inference),
``tokenize_conversation`` (ids and loss targets for training), ``detokenize`` and the special ids.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any

from megatron_core.tokenizers.base_tokenizer import MegatronTokenizerBase

TOKENIZER_MAPPING_LIBRARIES = OrderedDict(
    [
        ("multimodal", "MegatronMultimodalTokenizer"),
        ("null-multimodal", "MegatronNullMultimodalTokenizer"),
    ]
)
"""Metadata ``library`` to class name in :mod:`megatron_core.tokenizers.vision.libraries`."""


class MegatronTokenizerVision(MegatronTokenizerBase):
    """Base class of the vision tokenizers (one per ``model_type``).

    Records the concrete class in the metadata (``class_name``, ``class_path``) so that subclasses
    round-trip through ``MegatronTokenizer.from_pretrained``.
    """

    def __init__(self, path: str | None = None, config: dict | None = None, **kwargs: Any) -> None:
        self._init_library_tokenizer(path, config, TOKENIZER_MAPPING_LIBRARIES, **kwargs)
        self._tokenizer = self._restore_model(**kwargs)
        self.path = path

    def _restore_model(self, **kwargs: Any) -> Any:
        """Build the library tokenizer named by ``self.library``."""
        libraries = importlib.import_module("megatron_core.tokenizers.vision.libraries")
        library_class = getattr(libraries, TOKENIZER_MAPPING_LIBRARIES[self.library])
        if self.library == "null-multimodal":
            return library_class(**kwargs)
        return library_class(self.path, **kwargs)

    def tokenize(self, text: str | list[dict]) -> list[int]:
        """Ids of a string, or of a conversation with the generation prompt appended (inference)."""
        return self._tokenizer.tokenize(text)

    def detokenize(self, ids: list[int]) -> str:
        """Ids to text."""
        return self._tokenizer.detokenize(ids)

    def tokenize_conversation(self, conversation: list[dict], return_target: bool, add_generation_prompt: bool):
        """Ids of ``conversation`` (``[{"role", "content"}, ...]``); with ``return_target``, ``(ids, target)``.

        The target holds ``IGNORE_INDEX`` (-100) wherever no loss is taken (the library's rule).
        """
        return self._tokenizer.tokenize_conversation(
            conversation=conversation, return_target=return_target, add_generation_prompt=add_generation_prompt
        )

    def add_special_tokens(self, special_tokens: list | dict) -> None:
        """Add special tokens to the vocabulary (new ids follow the current last one)."""
        self._tokenizer.add_special_tokens(special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        """Token text(s) to id(s)."""
        return self._tokenizer.convert_tokens_to_ids(tokens)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported (as in Megatron): use :meth:`tokenize_conversation`."""
        raise NotImplementedError("This method is not supported for vision tokenizers.")

    def get_special_tokens(self) -> Any:
        """The library's added special tokens."""
        return self._tokenizer.get_special_tokens()

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """Character offset in ``text`` where each token starts (``null-multimodal`` only)."""
        return self._tokenizer.offsets(ids=ids, text=text)

    @property
    def vocab(self) -> Any:
        """The library's vocabulary."""
        return self._tokenizer.vocab

    @property
    def vocab_size(self) -> int:
        """Number of ids (as the library counts them)."""
        return self._tokenizer.vocab_size

    @property
    def pad(self) -> int | None:
        """Padding id (``None`` when the library has none)."""
        return getattr(self._tokenizer, "pad", None)

    @property
    def eod(self) -> int | None:
        """End-of-document id."""
        return self._tokenizer.eod
