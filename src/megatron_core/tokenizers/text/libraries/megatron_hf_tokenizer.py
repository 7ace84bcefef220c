"""``megatron`` library: Megatron's named tokenizers from local files (GPT-2 BPE).

``tokenizer_path`` is a tokenizer name (``"GPT2BPETokenizer"`` or ``"megatron-gpt-345m"``) and
``vocab_file``/``merges_file`` are GPT-2's ``vocab.json``/``merges.txt``, read by the pure-Python
:class:`megatron_core.tokenizers.legacy.GPT2BPETokenizer`. Megatron downloads missing files and
also offers BERT WordPiece names; megatron_core does neither (a clear ``ValueError``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from megatron_core.tokenizers.legacy.gpt2_bpe import END_OF_TEXT, GPT2BPETokenizer

GPT2_NAMES = ("GPT2BPETokenizer", "megatron-gpt-345m")
"""Names served with GPT-2 BPE."""

UNSUPPORTED_NAMES = (
    "BertWordPieceLowerCase", "BertWordPieceCase", "megatron-bert-345m-uncased", "megatron-bert-345m-cased",
    "megatron-bert-uncased", "megatron-bert-cased", "biomegatron-bert-345m-uncased", "biomegatron-bert-345m-cased",
)
"""Megatron's BERT WordPiece names (not provided by megatron_core)."""


class MegatronHFTokenizer(GPT2BPETokenizer):
    """GPT-2 BPE under Megatron's tokenizer names."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_file: str | None = None,
        merges_file: str | None = None,
        additional_special_tokens: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if tokenizer_path in UNSUPPORTED_NAMES:
            raise ValueError(f"MegatronHFTokenizer: {tokenizer_path!r} (WordPiece) is not provided by megatron_core")
        if tokenizer_path not in GPT2_NAMES:
            raise ValueError(
                f"MegatronHFTokenizer: unknown tokenizer name {tokenizer_path!r}; supported: {list(GPT2_NAMES)}"
            )
        if not vocab_file or not merges_file:
            raise ValueError(
                f"MegatronHFTokenizer {tokenizer_path!r} needs vocab_file and merges_file "
                f"(got {vocab_file!r}, {merges_file!r}); megatron_core never downloads them"
            )
        for path in (vocab_file, merges_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"MegatronHFTokenizer: no such file {path}")
        super().__init__(vocab_file, merges_file)
        self.tokenizer_name = tokenizer_path
        self._files = (vocab_file, merges_file)
        self._additional_special_tokens = list(additional_special_tokens or [])
        missing = [token for token in self._additional_special_tokens if token not in self.encoder]
        if missing:
            raise ValueError(f"MegatronHFTokenizer: additional special tokens {missing} are not in the vocab")

    def tokenize(self, text: str) -> list[int]:
        """Text to ids; ``<|endoftext|>`` and the additional special tokens are kept whole."""
        specials = [token for token in (END_OF_TEXT, *self._additional_special_tokens) if token in self.encoder]
        ids: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(token), token) for token in specials if token in rest]
            if not hits:
                ids.extend(super().tokenize(rest))
                break
            position, token = min(hits)
            ids.extend(super().tokenize(rest[:position]))
            ids.append(self.encoder[token])
            rest = rest[position + len(token):]
        return ids

    def save_pretrained(self, save_directory: str) -> None:
        """Copy ``vocab.json`` and ``merges.txt`` into ``save_directory``."""
        os.makedirs(save_directory, exist_ok=True)
        shutil.copyfile(self._files[0], os.path.join(save_directory, "vocab.json"))
        shutil.copyfile(self._files[1], os.path.join(save_directory, "merges.txt"))

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """Ids of ``additional_special_tokens``."""
        return [self.encoder[token] for token in self._additional_special_tokens]

    @property
    def eos(self) -> int:
        """Same as ``eod`` (``<|endoftext|>``)."""
        return self.eod

    @property
    def bos(self) -> int:
        """GPT-2 uses ``<|endoftext|>`` as bos too."""
        return self.eod
