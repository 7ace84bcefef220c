"""``MegatronTokenizerTextAbstract``: Megatron-Core 0.19's interface for a text library tokenizer.

The library tokenizers megatron_core ships derive from the legacy
:class:`~megatron_core.tokenizers.legacy.megatron_tokenizer.MegatronTokenizer` (same conversions,
``*_id`` aliases of the bare special-id names); this class is for code written against 0.19 that
subclasses the abstract interface itself. Its special-id properties read the bare name (``pad_id``
reads ``self.pad``; ``eod`` reads ``eod_id``, else ``eos_id``) and raise ``AttributeError``
naming both when the subclass defines neither.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["MegatronTokenizerTextAbstract"]


def _alias(owner: Any, name: str, alias: str) -> int:
    if hasattr(owner, name):
        return getattr(owner, name)
    raise AttributeError(f"{type(owner).__name__} has no attribute '{name}' or '{alias}'")


class MegatronTokenizerTextAbstract(ABC):
    """Conversions between text, token strings and ids, plus the special-id properties."""

    @abstractmethod
    def text_to_tokens(self, text: str) -> list[str]:
        """Text to token strings."""

    @abstractmethod
    def tokens_to_text(self, tokens: list[str]) -> str:
        """Token strings to text."""

    @abstractmethod
    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        """Token strings to ids."""

    @abstractmethod
    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Ids to token strings."""

    @abstractmethod
    def text_to_ids(self, text: str) -> list[int]:
        """Text to ids."""

    @abstractmethod
    def ids_to_text(self, ids: list[int]) -> str:
        """Ids to text."""

    @abstractmethod
    def add_special_tokens(self, *args: Any, **kwargs: Any) -> Any:
        """Add special tokens to the vocabulary."""

    @property
    def cls_id(self) -> int:
        """``self.cls``."""
        return _alias(self, "cls", "cls_id")

    @property
    def sep_id(self) -> int:
        """``self.sep``."""
        return _alias(self, "sep", "sep_id")

    @property
    def pad_id(self) -> int:
        """``self.pad``."""
        return _alias(self, "pad", "pad_id")

    @property
    def eod(self) -> int:
        """``self.eod_id``, else the end-of-sequence id ``self.eos_id``."""
        if hasattr(self, "eod_id"):
            return self.eod_id
        return _alias(self, "eos_id", "eod")

    @property
    def bos_id(self) -> int:
        """``self.bos``."""
        return _alias(self, "bos", "bos_id")

    @property
    def eos_id(self) -> int:
        """``self.eos``."""
        return _alias(self, "eos", "eos_id")

    @property
    def mask_id(self) -> int:
        """``self.mask``."""
        return _alias(self, "mask", "mask_id")
