"""``sentencepiece`` library: a SentencePiece ``.model`` file.

Takes Megatron's arguments on top of :class:`megatron_core.tokenizers.legacy.SentencePieceTokenizer`;
the legacy mode, extra special tokens and ``ignore_extra_whitespaces=False`` are not provided
(a ``ValueError`` names the argument).
"""

from __future__ import annotations

import os
from typing import Any

from megatron_core.tokenizers.legacy.sentencepiece_tokenizer import (
    SentencePieceTokenizer as _SentencePieceTokenizer,
)


class SentencePieceTokenizer(_SentencePieceTokenizer):
    """Megatron's ``sentencepiece`` library tokenizer."""

    def __init__(
        self,
        tokenizer_path: str,
        special_tokens: dict[str, str] | list[str] | None = None,
        legacy: bool = False,
        ignore_extra_whitespaces: bool = True,
        chat_template: str | None = None,
        trim_spm_separator_after_special_token: bool = True,
        spm_separator: str = "\u2581",
    ) -> None:
        unsupported = {
            "special_tokens": bool(special_tokens), "legacy": bool(legacy),
            "ignore_extra_whitespaces": not ignore_extra_whitespaces,
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"SentencePieceTokenizer: {name} is not supported by megatron_core (see docs/compat.md)")
        if not tokenizer_path or not os.path.exists(tokenizer_path):
            raise FileNotFoundError(f"SentencePieceTokenizer: tokenizer_path {tokenizer_path!r} does not exist")
        super().__init__(os.fspath(tokenizer_path))
        self.chat_template = chat_template
        self.original_vocab_size = self.vocab_size

    def text_to_tokens(self, text: str) -> list[str]:
        """Text to pieces."""
        return self._processor.encode_as_pieces(text)

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        """Pieces to ids."""
        return [self._processor.piece_to_id(token) for token in tokens]

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Ids to pieces."""
        return [self._processor.id_to_piece(int(token)) for token in ids]

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """Start offset of each id's piece in the decoded text (its leading space included)."""
        ids = [int(token) for token in ids]
        return [len(self._processor.decode_ids(ids[:index])) for index in range(len(ids))]

    def add_special_tokens(self, special_tokens: Any) -> None:
        """Not supported (Megatron allows it only in legacy mode)."""
        raise NotImplementedError("add_special_tokens is not supported for SentencePiece tokenizers")

    @property
    def unk(self) -> int:
        """The model's unk id."""
        return self._special("unk", self._processor.unk_id())

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """None are added."""
        return []
