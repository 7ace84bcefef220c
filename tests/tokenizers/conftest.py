"""Fixtures: small tokenizer files built locally for every library (no downloads)."""

from __future__ import annotations

import base64
import json
import textwrap

import pytest

from megatron_core.datasets.tokenizers import train_bpe_tokenizer


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory) -> dict[str, str]:
    """A 300-token byte-level BPE (tokenizer.json, vocab.json, merges.txt) trained on a stdlib source."""
    pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("bpe")
    paths = train_bpe_tokenizer([textwrap.__file__], 300, str(directory), special_tokens=["<|endoftext|>", "<pad>"])
    paths["dir"] = str(directory)
    return paths


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory) -> str:
    """A 200-piece SentencePiece model (unk 0, bos 1, eos 2, pad 3) trained on a stdlib source."""
    sentencepiece = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("sp")
    corpus = directory / "corpus.txt"
    corpus.write_text(open(textwrap.__file__, encoding="utf-8").read())
    prefix = str(directory / "sp")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=prefix, vocab_size=200, character_coverage=1.0,
        minloglevel=2, bos_id=1, eos_id=2, pad_id=3, unk_id=0,
    )
    return prefix + ".model"


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory) -> str:
    """Megatron's tiktoken JSON: the 256 byte ranks plus a few merges."""
    pytest.importorskip("tiktoken")
    tokens = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"in", b"ing", b" t"]
    entries = [
        {"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": token.decode("latin-1")}
        for rank, token in enumerate(tokens)
    ]
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.json"
    path.write_text(json.dumps(entries))
    return str(path)
