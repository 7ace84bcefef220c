"""``HuggingFaceTokenizer``: any ``tokenizer.json`` through the Hugging Face ``tokenizers`` library.

Megatron's version wraps ``transformers.AutoTokenizer``; this one needs only ``tokenizers`` (the
``hf`` extra) and a ``tokenizer.json`` (or a directory holding one). Special ids are looked up by
token text: pass ``eod_token``/``pad_token``/``bos_token`` to choose them, otherwise common names are
tried (``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>`` for eod; ``<pad>``, ``[PAD]`` for pad).
Text is encoded without adding the template's special tokens, as ``preprocess_data`` expects.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer
from megatron_core.tokenizers.legacy.optional import import_tokenizers

_DEFAULTS = {
    "eod": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]"),
    "unk": ("<unk>", "[UNK]"),
    "mask": ("<mask>", "[MASK]"),
}


class HuggingFaceTokenizer(MegatronTokenizer):
    """Tokenizer loaded from ``tokenizer_path`` (a ``tokenizer.json`` file or its directory)."""

    def __init__(
        self,
        tokenizer_path: str,
        eod_token: str | None = None,
        pad_token: str | None = None,
        bos_token: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer_path, eod_token=eod_token, pad_token=pad_token, bos_token=bos_token, **kwargs)
        path = tokenizer_path
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"HuggingFaceTokenizer: no tokenizer.json at {tokenizer_path}")
        try:
            self._tokenizer = import_tokenizers().Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library's message does not say which file
            raise ValueError(f"HuggingFaceTokenizer: cannot read {path}: {type(e).__name__}: {e}") from e
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._inv_vocab = {index: token for token, index in self._vocab.items()}
        self._special = {
            "eod": self._find("eod", eod_token),
            "pad": self._find("pad", pad_token),
            "bos": self._find("bos", bos_token),
            "unk": self._find("unk", None),
            "mask": self._find("mask", None),
        }

    def _find(self, role: str, explicit: str | None) -> int | None:
        if explicit is not None:
            if explicit not in self._vocab:
                raise ValueError(f"HuggingFaceTokenizer: {role} token {explicit!r} is not in the vocab")
            return self._vocab[explicit]
        for candidate in _DEFAULTS[role]:
            if candidate in self._vocab:
                return self._vocab[candidate]
        return None

    def _special_id(self, role: str) -> int:
        value = self._special[role]
        if value is None:
            raise NotImplementedError(f"HuggingFaceTokenizer: the vocab defines no {role} token; pass {role}_token")
        return value

    def tokenize(self, text: str) -> list[int]:
        """Text to ids (no template special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Any) -> str:
        """Ids to text, keeping special tokens."""
        return self._tokenizer.decode([int(token) for token in ids], skip_special_tokens=False)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """Start offset of each token of ``text``."""
        return [start for start, _ in self._tokenizer.encode(text, add_special_tokens=False).offsets]

    @property
    def vocab_size(self) -> int:
        """Vocabulary size, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict:
        """Token to id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        """Id to token."""
        return self._inv_vocab

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self._special_id("eod")

    @property
    def eos(self) -> int:
        """Same as ``eod``."""
        return self._special_id("eod")

    @property
    def pad(self) -> int:
        """Pad id."""
        return self._special_id("pad")

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id."""
        return self._special_id("bos")

    @property
    def mask(self) -> int:
        """Mask id."""
        return self._special_id("mask")
