"""``MegatronTokenizer``: the one tokenizer interface the datasets and ``preprocess_data`` rely on.

Megatron-Core's legacy abstract tokenizer (``megatron.core.datasets.megatron_tokenizer``, called
``MegatronLegacyTokenizer`` since 0.14; that path re-exports it). Datasets read ``eod``, ``pad`` and ``vocab_size`` and put
``unique_identifiers`` (class, paths, options) into the hash that names their index caches, so two
tokenizers built from the same files and options share caches.
Special ids a tokenizer does not define raise ``NotImplementedError``, as in Megatron.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any


class MegatronTokenizer(ABC):
    """Abstract tokenizer; subclasses pass their source paths and options for ``unique_identifiers``."""

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [str(path) for path in tokenizer_paths]
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text to token ids."""

    def detokenize(self, ids: Any) -> str:
        """Token ids to text."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    def text_to_ids(self, text: str) -> list[int]:
        """Alias of :meth:`tokenize` (Megatron's newer tokenizer API)."""
        return self.tokenize(text)

    def ids_to_text(self, ids: Any) -> str:
        """Alias of :meth:`detokenize` (Megatron's newer tokenizer API)."""
        return self.detokenize(ids)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """Character offset in ``text`` where each token starts."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'offsets'")

    @property
    @abstractmethod
    def vocab(self) -> dict:
        """Token string to id."""

    @property
    @abstractmethod
    def inv_vocab(self) -> dict:
        """Id to token string."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (including special tokens)."""

    def _missing(self, name: str) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    @property
    def cls(self) -> int:
        """CLS id."""
        return self._missing("cls")

    @property
    def sep(self) -> int:
        """SEP id."""
        return self._missing("sep")

    @property
    def pad(self) -> int:
        """PAD id."""
        return self._missing("pad")

    @property
    def eod(self) -> int:
        """End-of-document id, appended by ``preprocess_data --append-eod``."""
        return self._missing("eod")

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id."""
        return self._missing("bos")

    @property
    def eos(self) -> int:
        """End-of-sequence id."""
        return self._missing("eos")

    @property
    def mask(self) -> int:
        """MASK id."""
        return self._missing("mask")

    @property
    def unk(self) -> int:
        """Unknown-token id."""
        return self._missing("unk")

    # Megatron's newer tokenizer API names the same ids with an ``_id`` suffix.
    @property
    def cls_id(self) -> int:
        """Alias of :attr:`cls`."""
        return self.cls

    @property
    def sep_id(self) -> int:
        """Alias of :attr:`sep`."""
        return self.sep

    @property
    def pad_id(self) -> int:
        """Alias of :attr:`pad`."""
        return self.pad

    @property
    def bos_id(self) -> int:
        """Alias of :attr:`bos`."""
        return self.bos

    @property
    def eos_id(self) -> int:
        """Alias of :attr:`eos`."""
        return self.eos

    @property
    def mask_id(self) -> int:
        """Alias of :attr:`mask`."""
        return self.mask

    @property
    def unk_id(self) -> int:
        """Alias of :attr:`unk`."""
        return self.unk


MegatronLegacyTokenizer = MegatronTokenizer
