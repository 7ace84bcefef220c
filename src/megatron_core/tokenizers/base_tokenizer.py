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

    def _init_library_tokenizer(self, path: str | None, config: dict | None, libraries: dict[str, str],
                                **kwargs: Any) -> None:
        """Shared start of the text and vision tokenizers: record the concrete class in the metadata
        (``class_name``, ``class_path``, so subclasses round-trip through ``from_pretrained``), set the metadata
        attributes, and check that ``library`` is one of ``libraries`` (``ValueError`` naming it)."""
        config = dict(config or {})
        config["class_name"] = type(self).__name__
        config["class_path"] = type(self).__module__
        MegatronTokenizerBase.__init__(self, path, config, **kwargs)
        if getattr(self, "library", None) not in libraries:
            raise ValueError(
                f"{type(self).__name__}: library {getattr(self, 'library', None)!r} is not one of {list(libraries)}"
            )

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
