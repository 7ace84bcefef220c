"""``null-text`` library: ids written as space-separated integers (Megatron 0.19 semantics).

Unlike the legacy ``NullTokenizer`` (``vocab_size + 1`` ids), this one has exactly ``vocab_size``
ids, ``eod`` defaults to the last one (``vocab_size - 1``) and ``pad_id`` defaults to -1 (no pad).
"""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.legacy.null import NullTokenizer as _LegacyNullTokenizer


class NullTokenizer(_LegacyNullTokenizer):
    """Synthetic tokenizer for mock data and pre-tokenised text."""

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int = -1, **kwargs: Any) -> None:
        vocab_size = int(vocab_size)
        if vocab_size <= 0:
            raise ValueError(f"NullTokenizer: vocab_size ({vocab_size}) must be positive")
        super().__init__(vocab_size)
        self._vocab_size = vocab_size
        self._eod_id = vocab_size - 1 if eod_id is None else int(eod_id)
        self._pad_id = int(pad_id)
        if not 0 <= self._eod_id < vocab_size:
            raise ValueError(f"NullTokenizer: eod_id ({self._eod_id}) must be in [0, vocab_size={vocab_size})")

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        """Token strings to ids."""
        return [int(token) for token in tokens]

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Ids to token strings."""
        return [str(int(token)) for token in ids]

    @property
    def vocab_size(self) -> int:
        """``vocab_size`` as given."""
        return self._vocab_size

    @property
    def pad(self) -> int:
        """``pad_id`` as given (-1 by default)."""
        return self._pad_id
