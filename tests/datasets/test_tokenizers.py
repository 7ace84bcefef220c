"""Tokenizers: round trips, agreement between implementations and with their libraries, factory errors."""

from __future__ import annotations

import base64
import json
import textwrap

import pytest

from megatron_core.datasets.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    TikTokenizer,
    build_tokenizer,
)
from megatron_core.datasets.tokenizers.optional import _require

TEXTS = [
    "def main(argv):\n    return 0  # done\n",
    "Hello,  world!\tTabs, ÜNICODE ünïcödé and emoji 🙂 stay intact.",
    "   leading spaces and trailing   ",
    "",
]


def test_gpt2_bpe_matches_huggingface_and_round_trips(bpe_files):
    tokenizers = pytest.importorskip("tokenizers")
    ours = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"])
    hf = HuggingFaceTokenizer(bpe_files["tokenizer_json"])
    library = tokenizers.Tokenizer.from_file(bpe_files["tokenizer_json"])
    source = open(textwrap.__file__, encoding="utf-8").read()[:3000]
    for text in [*TEXTS, source]:
        ids = ours.tokenize(text)
        assert ids == hf.tokenize(text) == library.encode(text).ids
        assert ours.detokenize(ids) == text and hf.detokenize(ids) == text
    assert ours.vocab_size == hf.vocab_size == 400
    assert ours.eod == hf.eod == library.token_to_id("<|endoftext|>")
    assert ours.inv_vocab[ours.vocab["def"]] == "def"
    assert len(ours.tokenize(source)) < 0.6 * len(source.encode("utf-8"))  # merges were applied


def test_build_tokenizer_types(bpe_files, tmp_path):
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files["vocab_file"], merge_file=bpe_files["merge_file"])
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_files["tokenizer_json"])
    assert gpt2.tokenize(TEXTS[1]) == hf.tokenize(TEXTS[1])
    null = build_tokenizer("NullTokenizer", vocab_size=50)
    assert isinstance(null, NullTokenizer) and null.eod == 50 and null.vocab_size == 51
    assert null.tokenize("3 1 4") == [3, 1, 4] and null.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="needs vocab_file, merge_file"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="unknown tokenizer_type 'Bert'"):
        build_tokenizer("Bert")
    with pytest.raises(ImportError, match=r"pip install not_a_package .*megatron-core-lite\[hf\]"):
        _require("not_a_package_xyz", "not_a_package", "SomeTokenizer")
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="merge 0 is not a pair"):
        GPT2BPETokenizer(bpe_files["vocab_file"], str(bad_merges))


def _tiktoken_file(path) -> str:
    """256 byte ranks plus a few merges, in Megatron's JSON rank format."""
    tokens = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"in", b"ing", b" t"]
    entries = [
        {"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": token.decode("latin-1")}
        for rank, token in enumerate(tokens)
    ]
    path.write_text(json.dumps(entries))
    return str(path)


def test_tiktoken_round_trip_and_megatron_ids(tmp_path):
    pytest.importorskip("tiktoken")
    path = _tiktoken_file(tmp_path / "tok.json")
    ours = TikTokenizer(path, pattern="v2", vocab_size=1262, num_special_tokens=1000)
    text = "the thing in the theatre is singing 🙂"
    ids = ours.tokenize(text)
    assert ours.detokenize(ids) == text
    assert 1000 + 258 in ids and min(ids) >= 1000  # " the" merged; ranks shifted past the specials
    assert ours.eod == 2 and ours.bos == 1 and ours.pad == 4 and ours.vocab_size == 1262
    try:
        from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer
    except ImportError:
        return
    reference = TikTokenTokenizer(path, pattern="v2", vocab_size=1262, num_special_tokens=1000)
    for sample in [text, *TEXTS]:
        assert ours.tokenize(sample) == reference.text_to_ids(sample)
    assert ours.eod == reference.eod


def test_sentencepiece_round_trip(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(open(textwrap.__file__, encoding="utf-8").read())
    prefix = str(tmp_path / "sp")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=prefix, vocab_size=200, character_coverage=1.0,
        minloglevel=2, bos_id=1, eos_id=2, pad_id=3, unk_id=0,
    )
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=prefix + ".model")
    processor = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
    text = "Wrap the text into lines of at most width characters."
    ids = tokenizer.tokenize(text)
    assert ids == processor.encode(text) and tokenizer.detokenize(ids) == text
    assert (tokenizer.eod, tokenizer.bos, tokenizer.pad, tokenizer.vocab_size) == (2, 1, 3, 200)
