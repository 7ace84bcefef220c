"""``NullTokenizer``: ids written as space-separated integers, for mock data and pre-tokenised corpora.

Megatron semantics: ``NullTokenizer(vocab_size)`` has ``vocab_size + 1`` ids, the extra last id
being ``eod``; it defines no pad id (datasets then pad with -1 internally), and cls, sep and mask
are -1.
"""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Text ``"3 1 4"`` is ids ``[3, 1, 4]``; ``eod`` is ``vocab_size`` (the constructor argument)."""

    def __init__(self, vocab_size: int) -> None:
        if int(vocab_size) <= 0:
            raise ValueError(f"NullTokenizer: vocab_size ({vocab_size}) must be positive")
        super().__init__(vocab_size=int(vocab_size))
        self._vocab_size_without_eod = int(vocab_size)
        self._eod_id = self._vocab_size_without_eod

    def tokenize(self, text: str) -> list[int]:
        """Parse space-separated integers."""
        return [int(piece) for piece in text.split()]

    def detokenize(self, ids: Any) -> str:
        """Join ids with single spaces."""
        return " ".join(str(int(token)) for token in ids)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """Start offset of each id in its detokenised text."""
        offsets, position = [], 0
        for token in ids:
            offsets.append(position)
            position += 1 + len(str(token))
        return offsets

    @property
    def vocab_size(self) -> int:
        """``vocab_size + 1`` (the eod id is extra)."""
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self) -> dict:
        """Not defined for the null tokenizer."""
        raise NotImplementedError("NullTokenizer has no vocab")

    @property
    def inv_vocab(self) -> dict:
        """Not defined for the null tokenizer."""
        raise NotImplementedError("NullTokenizer has no inv_vocab")

    @property
    def cls(self) -> int:
        """-1."""
        return -1

    @property
    def sep(self) -> int:
        """-1."""
        return -1

    @property
    def mask(self) -> int:
        """-1."""
        return -1

    @property
    def eod(self) -> int:
        """The last id."""
        return self._eod_id

    @property
    def additional_special_tokens_ids(self) -> None:
        """None."""
        return None
