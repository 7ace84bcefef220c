"""``tiktoken`` library: Megatron's tiktoken JSON rank file, with Megatron's argument names.

Wraps :class:`megatron_core.tokenizers.legacy.TikTokenizer` (same file format and id layout).
"""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.legacy.tiktoken_tokenizer import TikTokenizer

DEFAULT_TIKTOKEN_MAX_VOCAB = 2**17
"""Default ``vocab_size`` (specials included)."""


class TikTokenTokenizer(TikTokenizer):
    """Megatron's ``tiktoken`` library tokenizer."""

    def __init__(
        self,
        tokenizer_path: str,
        special_tokens: list[str] | None = None,
        num_special_tokens: int = 1000,
        chat_template: str | None = None,
        pattern: str = "v2",
        vocab_size: int = DEFAULT_TIKTOKEN_MAX_VOCAB,
    ) -> None:
        super().__init__(
            tokenizer_path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens,
            special_tokens=special_tokens,
        )
        self.chat_template = chat_template

    def text_to_tokens(self, text: str) -> list[bytes]:
        """Text to token bytes."""
        return [self._token_bytes(token) for token in self.tokenize(text)]

    def tokens_to_ids(self, tokens: list[Any]) -> list[int]:
        """Special token strings or token bytes to ids."""
        ids = []
        for token in tokens:
            if isinstance(token, str) and token in self.special_tokens:
                ids.append(self.special_tokens.index(token))
            else:
                ids.append(self.token2id[token.encode("utf-8") if isinstance(token, str) else token])
        return ids

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Ids to token strings (special names for special ids)."""
        return [self._token_bytes(int(token)).decode("utf-8", errors="replace") for token in ids]

    def ids_to_text(self, ids: Any, remove_special_tokens: bool = False) -> str:
        """Ids to text, optionally dropping the special ids."""
        if remove_special_tokens:
            ids = [token for token in ids if int(token) >= self.num_special_tokens]
        return self.detokenize(ids)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        """Start offset of each id in the decoded text."""
        offsets, position = [], 0
        for token in ids:
            offsets.append(position)
            position += len(self._token_bytes(int(token)).decode("utf-8", errors="replace"))
        return offsets

    def add_special_tokens(self, special_tokens: Any) -> None:
        """Not supported (as in Megatron)."""
        raise NotImplementedError("This method is not supported for TikToken tokenizers.")

    @property
    def unk(self) -> int:
        """Id of ``<unk>``."""
        return self._ids["unk"]

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """Ids of the special tokens beyond the seven standard ones."""
        return list(range(7, self.num_special_tokens))
