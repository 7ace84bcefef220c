"""``TikTokenizer``: Megatron's tiktoken tokenizer over a JSON rank file, via the ``tiktoken`` library.

File format (Megatron's): a JSON list of ``{"rank": i, "token_bytes": <base64>, "token_str": ...}``
with rank i at position i and the first 256 ranks the single bytes. The first
``num_special_tokens`` ids (default 1000) are special: ``<unk> <s> </s> <mask> <pad> <cls> <sep>``
(or ``special_tokens``, which must include them) followed by ``<SPECIAL_i>`` fillers; rank r of the
file is id ``r + num_special_tokens``, and the file is cut to ``vocab_size - num_special_tokens``
ranks. ``eod`` is ``</s>``. ``pattern`` is ``"v1"`` or ``"v2"`` (Megatron's split regexes).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer
from megatron_core.tokenizers.legacy.optional import import_tiktoken

PATTERN_TIKTOKEN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_TIKTOKEN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def load_tiktoken_ranks(path: str, max_vocab: int | None, num_special_tokens: int) -> dict[bytes, int]:
    """Read a Megatron tiktoken JSON file into ``{token_bytes: id}`` with ids shifted past the specials."""
    with open(path, encoding="utf-8") as stream:
        entries = json.load(stream)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of rank entries")
    if max_vocab is not None:
        entries = entries[:max_vocab]
    ranks: dict[bytes, int] = {}
    for position, entry in enumerate(entries):
        if entry.get("rank") != position:
            raise ValueError(f"{path}: entry {position} has rank {entry.get('rank')}")
        token = base64.b64decode(entry["token_bytes"])
        if position < 256 and token != bytes([position]):
            raise ValueError(f"{path}: rank {position} must be the single byte {position}")
        ranks[token] = position + num_special_tokens
    return ranks


class TikTokenizer(MegatronTokenizer):
    """Megatron's ``TikTokenizer`` (``--tokenizer-type TikTokenizer --tokenizer-model <file.json>``)."""

    def __init__(
        self,
        tokenizer_path: str,
        pattern: str = "v2",
        vocab_size: int = 2**17,
        num_special_tokens: int = 1000,
        special_tokens: list[str] | None = None,
    ) -> None:
        super().__init__(
            tokenizer_path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens,
            special_tokens=special_tokens,
        )
        if not os.path.isfile(tokenizer_path):
            raise FileNotFoundError(f"TikTokenizer: no vocabulary file at {tokenizer_path}")
        patterns = {"v1": PATTERN_TIKTOKEN_V1, "v2": PATTERN_TIKTOKEN_V2}
        if pattern not in patterns:
            raise ValueError(f"TikTokenizer: pattern must be 'v1' or 'v2', got {pattern!r}")
        special_tokens = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
        missing = set(SPECIAL_TOKENS) - set(special_tokens)
        if missing or len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"TikTokenizer: special_tokens must be unique and include {SPECIAL_TOKENS}")
        if not len(special_tokens) <= num_special_tokens < vocab_size:
            raise ValueError(
                f"TikTokenizer: need len(special_tokens) ({len(special_tokens)}) <= num_special_tokens "
                f"({num_special_tokens}) < vocab_size ({vocab_size})"
            )
        self.special_tokens = special_tokens + [
            f"<SPECIAL_{index}>" for index in range(len(special_tokens), num_special_tokens)
        ]
        self.num_special_tokens = num_special_tokens
        self.token2id = load_tiktoken_ranks(tokenizer_path, vocab_size - num_special_tokens, num_special_tokens)
        self._vocab_size = vocab_size
        self._ids = {name: self.special_tokens.index(token) for name, token in zip(
            ("unk", "bos", "eos", "mask", "pad", "cls", "sep"), SPECIAL_TOKENS
        )}
        self._encoding = import_tiktoken().Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(tokenizer_path))),
            pat_str=patterns[pattern],
            mergeable_ranks=self.token2id,
            special_tokens={token: index for index, token in enumerate(self.special_tokens)},
        )
        self._inv_vocab = {index: token for token, index in self.token2id.items()}

    def tokenize(self, text: str) -> list[int]:
        """Text to ids; special-token text is encoded as the special id."""
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Any) -> str:
        """Ids to text; special ids become their token text."""
        return b"".join(self._token_bytes(int(token)) for token in ids).decode("utf-8", errors="replace")

    def _token_bytes(self, token: int) -> bytes:
        if token < self.num_special_tokens:
            return self.special_tokens[token].encode("utf-8")
        return self._encoding.decode_single_token_bytes(token)

    @property
    def vocab_size(self) -> int:
        """``vocab_size`` as configured (specials included)."""
        return self._vocab_size

    @property
    def vocab(self) -> dict:
        """Token bytes to id (specials excluded)."""
        return self.token2id

    @property
    def inv_vocab(self) -> dict:
        """Id to token bytes (specials excluded)."""
        return self._inv_vocab

    @property
    def eod(self) -> int:
        """Id of ``</s>``."""
        return self._ids["eos"]

    @property
    def eos(self) -> int:
        """Id of ``</s>``."""
        return self._ids["eos"]

    @property
    def bos(self) -> int:
        """Id of ``<s>``."""
        return self._ids["bos"]

    @property
    def pad(self) -> int:
        """Id of ``<pad>``."""
        return self._ids["pad"]

    @property
    def cls(self) -> int:
        """Id of ``<cls>``."""
        return self._ids["cls"]

    @property
    def sep(self) -> int:
        """Id of ``<sep>``."""
        return self._ids["sep"]

    @property
    def mask(self) -> int:
        """Id of ``<mask>``."""
        return self._ids["mask"]
