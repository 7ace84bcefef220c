"""``MegatronTokenizerBase``: the abstract tokenizer that ``MegatronTokenizer.from_pretrained`` returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class MegatronTokenizerBase(ABC):
    """Abstract tokenizer built from a path and a metadata dict.

    Every metadata entry (``library``, ``class_name``, ``class_path``, ``model_type``,
    ``chat_template``, ``metadata_path``, ...) becomes an attribute of the tokenizer.
    """

    def __init__(self, path: str | None, config: dict, **kwargs: Any) -> None:
        self.path = path
        for key, value in config.items():
            setattr(self, key, value)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text to token ids."""

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str:
        """Token ids to text."""

    @property
    @abstractmethod
    def vocab(self) -> Any:
        """The vocabulary."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids."""

    @abstractmethod
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        """Render a conversation with the tokenizer's chat template."""
