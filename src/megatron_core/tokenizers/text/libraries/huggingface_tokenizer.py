"""``huggingface`` library: a ``tokenizer.json`` (with optional ``tokenizer_config.json``) directory.

Takes Megatron's ``HuggingFaceTokenizer`` arguments on top of
:class:`megatron_core.tokenizers.legacy.HuggingFaceTokenizer` (Hugging Face ``tokenizers`` only, no
``transformers``; files are local, never downloaded). Special tokens not given as arguments are read
from ``tokenizer_config.json`` when present, else found by common names; ``sep`` defaults to eos and
``cls`` to bos, as in Megatron. ``include_special_tokens`` (default True) lets the tokenizer's
post-processor add its special tokens (e.g. a BOS) when encoding.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_core.tokenizers.legacy.huggingface import HuggingFaceTokenizer as _HFTokenizer

_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "sep_token", "cls_token")


def _read_config(tokenizer_path: str) -> dict:
    """``tokenizer_config.json`` next to the tokenizer, or an empty dict."""
    directory = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as stream:
        config = json.load(stream)
    for role in _ROLES:
        if isinstance(config.get(role), dict):
            config[role] = config[role].get("content")
    return config


class HuggingFaceTokenizer(_HFTokenizer):
    """Megatron's ``huggingface`` library tokenizer over a local ``tokenizer.json``."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_file: str | None = None,
        merges_file: str | None = None,
        mask_token: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        sep_token: str | None = None,
        cls_token: str | None = None,
        unk_token: str | None = None,
        additional_special_tokens: list[str] | None = None,
        use_fast: bool = True,
        trust_remote_code: bool = False,
        include_special_tokens: bool = True,
        chat_template: str | None = None,
    ) -> None:
        if vocab_file or merges_file:
            raise ValueError(
                "HuggingFaceTokenizer: vocab_file/merges_file are not supported (megatron_core reads tokenizer.json); "
                "use library 'megatron' with tokenizer_path='GPT2BPETokenizer' for GPT-2 vocab.json + merges.txt"
            )
        tokenizer_path = os.fspath(tokenizer_path)
        config = _read_config(tokenizer_path) if os.path.exists(tokenizer_path) else {}
        given = dict(
            bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token,
            mask_token=mask_token, sep_token=sep_token, cls_token=cls_token,
        )
        tokens = {role: given[role] if given[role] is not None else config.get(role) for role in _ROLES}
        super().__init__(
            tokenizer_path, eod_token=tokens["eos_token"], pad_token=tokens["pad_token"], bos_token=tokens["bos_token"]
        )
        for role in ("unk", "mask"):
            if tokens[f"{role}_token"] is not None:
                self._special[role] = self._find(role, tokens[f"{role}_token"])
        self._special["sep"] = self._lookup("sep", tokens["sep_token"], self._special["eod"])
        self._special["cls"] = self._lookup("cls", tokens["cls_token"], self._special["bos"])
        self._additional_special_tokens = list(additional_special_tokens or [])
        for token in self._additional_special_tokens:
            if token not in self._vocab:
                raise ValueError(
                    f"HuggingFaceTokenizer: additional special token {token!r} is not in the vocab "
                    "(megatron_core does not add tokens at load time)"
                )
        self.include_special_tokens = include_special_tokens
        self.use_fast = use_fast
        self.chat_template = chat_template if chat_template is not None else config.get("chat_template")
        self.original_vocab_size = self.vocab_size

    def _lookup(self, role: str, token: str | None, fallback: int | None) -> int | None:
        if token is None:
            return fallback
        if token not in self._vocab:
            raise ValueError(f"HuggingFaceTokenizer: {role} token {token!r} is not in the vocab")
        return self._vocab[token]

    def text_to_ids(self, text: str) -> list[int]:
        """Text to ids; with ``include_special_tokens`` the post-processor's special tokens are added."""
        return self._tokenizer.encode(text, add_special_tokens=self.include_special_tokens).ids

    def ids_to_text(self, ids: Any, remove_special_tokens: bool | None = None) -> str:
        """Ids to text; special tokens are removed when ``remove_special_tokens`` (default: not include)."""
        if remove_special_tokens is None:
            remove_special_tokens = not self.include_special_tokens
        return self._tokenizer.decode([int(token) for token in ids], skip_special_tokens=remove_special_tokens)

    def text_to_tokens(self, text: str) -> list[str]:
        """Text to token strings."""
        return self._tokenizer.encode(text, add_special_tokens=False).tokens

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        """Token strings to ids."""
        return [self._tokenizer.token_to_id(token) for token in tokens]

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Ids to token strings."""
        return [self._tokenizer.id_to_token(int(token)) for token in ids]

    def add_special_tokens(self, special_tokens: dict | list) -> int:
        """Add special tokens (a role dict such as ``{"pad_token": "<pad>"}`` or a list); returns how many were new."""
        if isinstance(special_tokens, dict):
            roles = {key: value for key, value in special_tokens.items() if key != "additional_special_tokens"}
            extra = list(special_tokens.get("additional_special_tokens", []))
        else:
            roles, extra = {}, list(special_tokens)
        added = self._tokenizer.add_special_tokens([*roles.values(), *extra])
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._inv_vocab = {index: token for token, index in self._vocab.items()}
        role_names = {"eos_token": "eod", "bos_token": "bos", "pad_token": "pad", "unk_token": "unk",
                      "mask_token": "mask", "sep_token": "sep", "cls_token": "cls"}
        for key, token in roles.items():
            if key not in role_names:
                raise ValueError(f"add_special_tokens: unknown role {key!r}; use one of {list(role_names)}")
            self._special[role_names[key]] = self._vocab[token]
        self._additional_special_tokens += [token for token in extra if token not in self._additional_special_tokens]
        return added

    def save_pretrained(self, save_directory: str) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template)."""
        os.makedirs(save_directory, exist_ok=True)
        self._tokenizer.save(os.path.join(save_directory, "tokenizer.json"))
        config: dict[str, Any] = {}
        for role, key in (("bos", "bos_token"), ("eod", "eos_token"), ("pad", "pad_token"), ("unk", "unk_token"),
                          ("mask", "mask_token"), ("sep", "sep_token"), ("cls", "cls_token")):
            if self._special.get(role) is not None:
                config[key] = self._inv_vocab[self._special[role]]
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(save_directory, "tokenizer_config.json"), "w", encoding="utf-8") as stream:
            json.dump(config, stream, indent=2)

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """Ids of ``additional_special_tokens``."""
        return [self._vocab[token] for token in self._additional_special_tokens]

    @property
    def unk(self) -> int:
        """Unknown-token id."""
        return self._special_id("unk")

    @property
    def sep(self) -> int:
        """Separator id (eos unless given)."""
        return self._special_id("sep")

    @property
    def cls(self) -> int:
        """Classification id (bos unless given)."""
        return self._special_id("cls")
