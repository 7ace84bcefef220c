"""``SentencePieceTokenizer``: a SentencePiece ``.model`` file through the ``sentencepiece`` library.

Follows Megatron's GPT-style SentencePiece tokenizer (``GPTSentencePieceTokenizer``/``Llama2Tokenizer``):
ids are the model's own, ``eod``/``eos`` is the model's eos id, ``bos`` and ``pad`` the model's (pad
raises when the model has none). Megatron's older ``SentencePieceTokenizer`` type additionally
appended BERT/T5 tokens (``<CLS>``, ``<SEP>``, ``<MASK>``, extra ids) to the vocab; that variant is not
reproduced (see docs/compat.md).
"""

from __future__ import annotations

import os
from typing import Any

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer
from megatron_core.tokenizers.legacy.optional import import_sentencepiece


class SentencePieceTokenizer(MegatronTokenizer):
    """Tokenizer over a SentencePiece model file."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePieceTokenizer: no model file at {model_file}")
        self._processor = import_sentencepiece().SentencePieceProcessor(model_file=model_file)
        self._vocab = {self._processor.id_to_piece(index): index for index in range(self._processor.vocab_size())}
        self._inv_vocab = {index: piece for piece, index in self._vocab.items()}

    def _special(self, name: str, value: int) -> int:
        if value < 0:
            raise NotImplementedError(f"SentencePieceTokenizer: the model defines no {name} id")
        return value

    def tokenize(self, text: str) -> list[int]:
        """Text to ids."""
        return self._processor.encode_as_ids(text)

    def detokenize(self, ids: Any) -> str:
        """Ids to text."""
        return self._processor.decode_ids([int(token) for token in ids])

    @property
    def vocab_size(self) -> int:
        """Pieces in the model."""
        return self._processor.vocab_size()

    @property
    def vocab(self) -> dict:
        """Piece to id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        """Id to piece."""
        return self._inv_vocab

    @property
    def eod(self) -> int:
        """The model's eos id."""
        return self._special("eos", self._processor.eos_id())

    @property
    def eos(self) -> int:
        """The model's eos id."""
        return self._special("eos", self._processor.eos_id())

    @property
    def bos(self) -> int:
        """The model's bos id."""
        return self._special("bos", self._processor.bos_id())

    @property
    def pad(self) -> int:
        """The model's pad id."""
        return self._special("pad", self._processor.pad_id())
