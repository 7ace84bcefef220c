"""``byte-level`` library: text as its UTF-8 bytes, with configurable special ids."""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer as _LegacyTokenizer


class ByteLevelTokenizer(_LegacyTokenizer):
    """Each UTF-8 byte is one id; ``special_tokens`` take the last ids of the vocabulary.

    ``vocab_size`` (default 512, at least 256) grows by ``len(special_tokens)``; eos (also eod) is
    ``_eos_id`` (0), pad ``_pad_id`` (1), bos ``_bos_id`` (none), unk 259, as in Megatron.
    """

    def __init__(
        self,
        special_tokens: dict[str, str] | list[str] | None = None,
        vocab_size: int = 512,
        _eos_id: int = 0,
        _pad_id: int = 1,
        _bos_id: int | None = None,
    ) -> None:
        if vocab_size < 256:
            raise ValueError(f"ByteLevelTokenizer: vocab_size ({vocab_size}) must be at least 256")
        super().__init__(vocab_size=vocab_size, special_tokens=special_tokens)
        self._eos_id, self._pad_id, self._bos_id = _eos_id, _pad_id, _bos_id
        special_tokens = list(special_tokens or [])
        self._vocab_size = vocab_size + len(special_tokens)
        self.special_start = self._vocab_size - len(special_tokens)
        self.special_token_to_id: dict[Any, int] = {
            token: self.special_start + index for index, token in enumerate(reversed(special_tokens))
        }
        self.id_to_special_token = {index: token for token, index in self.special_token_to_id.items()}

    def tokenize(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Any) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 ignored, trailing space stripped."""
        data = bytes(int(token) for token in ids if int(token) < min(self.special_start, 256))
        return data.decode("utf-8", errors="ignore").rstrip()

    def text_to_tokens(self, text: str) -> list[int]:
        """Tokens are the byte ids."""
        return self.tokenize(text)

    def tokens_to_ids(self, tokens: Any) -> list[int]:
        """Special token names map to their ids; bytes map to themselves."""
        tokens = [tokens] if isinstance(tokens, str) else tokens
        return [self.special_token_to_id.get(token, token) for token in tokens]

    def ids_to_tokens(self, ids: Any) -> list[Any]:
        """Special ids map to their names; bytes map to themselves."""
        ids = [ids] if isinstance(ids, int) else ids
        return [self.id_to_special_token.get(token, token) for token in ids]

    def add_special_tokens(self, special_tokens: Any) -> None:
        """Not supported (as in Megatron)."""
        raise NotImplementedError("This method is not supported for byte-level tokenizers.")

    @property
    def vocab_size(self) -> int:
        """Byte ids plus special tokens."""
        return self._vocab_size

    @property
    def vocab(self) -> dict:
        """Not defined."""
        raise NotImplementedError("ByteLevelTokenizer has no vocab")

    @property
    def inv_vocab(self) -> dict:
        """Not defined."""
        raise NotImplementedError("ByteLevelTokenizer has no inv_vocab")

    @property
    def eos(self) -> int:
        """``_eos_id``."""
        return self._eos_id

    @property
    def eod(self) -> int:
        """Same as eos."""
        return self._eos_id

    @property
    def pad(self) -> int:
        """``_pad_id``."""
        return self._pad_id

    @property
    def bos(self) -> int:
        """``_bos_id`` (raises when None)."""
        return self._missing("bos") if self._bos_id is None else self._bos_id

    @property
    def unk(self) -> int:
        """259, as in Megatron."""
        return 259
