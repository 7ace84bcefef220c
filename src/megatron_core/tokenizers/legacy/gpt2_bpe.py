"""``GPT2BPETokenizer``: byte-level BPE from a GPT-2 style ``vocab.json`` + ``merges.txt``, pure Python.

The GPT-2 algorithm: split text with GPT-2's pre-tokenisation pattern, map each piece's UTF-8
bytes to printable characters (the byte-to-unicode table), then apply merges lowest rank first.
The pattern needs the Unicode classes ``\\p{L}`` and ``\\p{N}``, which the standard ``re`` module
lacks, so they are built once from ``unicodedata`` (about half a second on first use); no
third-party package is needed. ``eod`` is the id of ``<|endoftext|>``.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import unicodedata
from typing import Any

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer

END_OF_TEXT = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes (controls, space, ...) map
    to code points 256, 257, ... in byte order.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _ranges_to_class(code_points: list[int]) -> str:
    parts, start, previous = [], None, None
    for point in code_points:
        if start is None:
            start = previous = point
        elif point == previous + 1:
            previous = point
        else:
            parts.append((start, previous))
            start = previous = point
    if start is not None:
        parts.append((start, previous))
    return "".join(
        re.escape(chr(low)) if low == high else f"{re.escape(chr(low))}-{re.escape(chr(high))}" for low, high in parts
    )


@functools.lru_cache(maxsize=1)
def gpt2_pattern() -> re.Pattern:
    """GPT-2's pre-tokenisation regex, with ``\\p{L}``/``\\p{N}`` expanded into explicit classes."""
    letters, numbers = [], []
    for point in range(sys.maxunicode + 1):
        category = unicodedata.category(chr(point))
        if category[0] == "L":
            letters.append(point)
        elif category[0] == "N":
            numbers.append(point)
    letter, number = _ranges_to_class(letters), _ranges_to_class(numbers)
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^\s{letter}{number}]+|\s+(?!\S)|\s+"
    )


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE over ``vocab_file`` (token -> id JSON) and ``merge_file`` (one merge per line)."""

    def __init__(self, vocab_file: str, merge_file: str, errors: str = "replace") -> None:
        super().__init__(vocab_file, merge_file)
        with open(vocab_file, encoding="utf-8") as stream:
            self.encoder: dict[str, int] = json.load(stream)
        self.decoder = {index: token for token, index in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as stream:
            lines = stream.read().split("\n")
        merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
        for number, merge in enumerate(merges):
            if len(merge) != 2:
                raise ValueError(f"{merge_file}: merge {number} is not a pair of symbols: {merge}")
        self.bpe_ranks = {merge: rank for rank, merge in enumerate(merges)}
        self.errors = errors
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        self.pattern = gpt2_pattern()
        self._cache: dict[str, list[str]] = {}

    def _bpe(self, word: str) -> list[str]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        symbols = list(word)
        while len(symbols) > 1:
            pairs = zip(symbols[:-1], symbols[1:])
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, position = [], 0
            while position < len(symbols):
                if (
                    position < len(symbols) - 1
                    and symbols[position] == best[0]
                    and symbols[position + 1] == best[1]
                ):
                    merged.append(best[0] + best[1])
                    position += 2
                else:
                    merged.append(symbols[position])
                    position += 1
            symbols = merged
        if len(self._cache) < 100_000:
            self._cache[word] = symbols
        return symbols

    def tokenize(self, text: str) -> list[int]:
        """Text to ids."""
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_encoder[byte] for byte in piece.encode("utf-8"))
            try:
                ids.extend(self.encoder[symbol] for symbol in self._bpe(word))
            except KeyError as error:
                raise ValueError(f"GPT2BPETokenizer: symbol {error.args[0]!r} is not in the vocab") from None
        return ids

    def detokenize(self, ids: Any) -> str:
        """Ids to text (invalid UTF-8 handled per ``errors``)."""
        text = "".join(self.decoder[int(token)] for token in ids)
        return bytes(self.byte_decoder[char] for char in text).decode("utf-8", errors=self.errors)

    @property
    def vocab_size(self) -> int:
        """Entries in ``vocab.json``."""
        return len(self.encoder)

    @property
    def vocab(self) -> dict:
        """Token to id."""
        return self.encoder

    @property
    def inv_vocab(self) -> dict:
        """Id to token."""
        return self.decoder

    @property
    def eod(self) -> int:
        """Id of ``<|endoftext|>``."""
        if END_OF_TEXT not in self.encoder:
            raise ValueError(f"GPT2BPETokenizer: the vocab has no {END_OF_TEXT} token to use as eod")
        return self.encoder[END_OF_TEXT]
