"""``MegatronTokenizer.from_pretrained`` for every library, metadata files and clear errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from megatron_core.tokenizers import MegatronTokenizer, MegatronTokenizerBase
from megatron_core.tokenizers.text import MegatronTokenizerText
from megatron_core.tokenizers.text.models import DefaultTokenizerText, GPTTokenizer

TEXT = "Wrap the text into lines of at most width characters; the thing in the theatre."


def test_null_text_matches_megatron_semantics():
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=64)
    assert isinstance(tokenizer, DefaultTokenizerText) and isinstance(tokenizer, MegatronTokenizerBase)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, tokenizer.pad_id) == (64, 63, -1, -1)
    assert tokenizer.bos is None and tokenizer.cls == -1 and tokenizer.mask_id == -1
    assert tokenizer.tokenize("3 1 4") == [3, 1, 4] and tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    assert tokenizer.offsets([3, 14, 1], "3 14 1") == [0, 2, 5]
    assert tokenizer.library == "null-text" and tokenizer.metadata_path is None and tokenizer.path is None
    assert tokenizer.unique_identifiers["vocab_size"] == "64"
    custom = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=10, eod_id=0, pad_id=9)
    assert (custom.eod, custom.pad) == (0, 9)
    with pytest.raises(ValueError, match=r"eod_id \(10\) must be in \[0, vocab_size=10\)"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=10, eod_id=10)


def test_huggingface_matches_transformers(bpe_dir, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    # a post-processor that prepends <|endoftext|> shows include_special_tokens at work
    library = tokenizers.Tokenizer.from_file(bpe_dir["tokenizer_json"])
    eot = library.token_to_id("<|endoftext|>")
    library.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eot)]
    )
    directory = tmp_path / "hf"
    directory.mkdir()
    library.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": {"content": "<pad>"}, "chat_template": template})
    )
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    tokenizer = MegatronTokenizer.from_pretrained(str(directory), metadata_path={"library": "huggingface"})
    ids = tokenizer.tokenize(TEXT)
    assert ids == reference(TEXT).input_ids and ids[0] == eot
    assert tokenizer.detokenize(ids) == reference.decode(ids) == "<|endoftext|>" + TEXT
    assert tokenizer.detokenize(ids, skip_special_tokens=True) == TEXT
    assert (tokenizer.eod, tokenizer.eos_id, tokenizer.sep, tokenizer.pad) == (eot, eot, eot, library.token_to_id("<pad>"))
    assert tokenizer.vocab_size == len(reference) == 300
    assert tokenizer.space_sensitive is True
    plain = MegatronTokenizer.from_pretrained(
        str(directory), metadata_path={"library": "huggingface"}, include_special_tokens=False
    )
    assert plain.tokenize(TEXT) == ids[1:] and plain.detokenize(ids[1:]) == TEXT
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert plain.apply_chat_template(chat, tokenize=False) == "<user>hi<|endoftext|><assistant>yo<|endoftext|>"
    assert plain.apply_chat_template(chat) == plain.tokenize("<user>hi<|endoftext|><assistant>yo<|endoftext|>")
    assert plain.apply_chat_template(chat, truncation=True, max_length=3) == plain.apply_chat_template(chat)[:3]
    saved = tmp_path / "saved"
    plain.save_pretrained(str(saved))
    again = MegatronTokenizer.from_pretrained(str(saved), metadata_path={"library": "huggingface"})
    assert again.tokenize(TEXT) == ids and again.chat_template == template and again.pad == plain.pad
    with pytest.raises(ValueError, match="'<nope>' is not in the vocab"):
        MegatronTokenizer.from_pretrained(str(directory), metadata_path={"library": "huggingface"}, pad_token="<nope>")


def test_sentencepiece(sentencepiece_model):
    sentencepiece = pytest.importorskip("sentencepiece")
    processor = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    tokenizer = MegatronTokenizer.from_pretrained(sentencepiece_model, metadata_path={"library": "sentencepiece"})
    ids = tokenizer.tokenize(TEXT)
    assert ids == processor.encode(TEXT) and tokenizer.detokenize(ids) == TEXT
    assert (tokenizer.unk_id, tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (0, 1, 2, 2, 3)
    assert tokenizer.vocab_size == 200 and tokenizer.inv_vocab[ids[0]] == processor.id_to_piece(ids[0])
    assert tokenizer.offsets(ids, TEXT)[:2] == [0, len(processor.id_to_piece(ids[0]).lstrip("\u2581"))]
    with pytest.raises(ValueError, match="legacy is not supported"):
        MegatronTokenizer.from_pretrained(sentencepiece_model, metadata_path={"library": "sentencepiece"}, legacy=True)


def test_tiktoken(tiktoken_file):
    tiktoken = pytest.importorskip("tiktoken")
    tokenizer = MegatronTokenizer.from_pretrained(
        tiktoken_file, metadata_path={"library": "tiktoken"}, vocab_size=1262, num_special_tokens=1000
    )
    ids = tokenizer.tokenize(TEXT)
    # the same merges as a plain tiktoken Encoding, shifted past the 1000 special ids
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({token: 256 + i for i, token in enumerate([b"th", b"the", b" the", b"in", b"ing", b" t"])})
    from megatron_core.datasets.tokenizers.tiktoken_tokenizer import PATTERN_TIKTOKEN_V2

    plain = tiktoken.Encoding(name="plain", pat_str=PATTERN_TIKTOKEN_V2, mergeable_ranks=ranks, special_tokens={})
    assert ids == [token + 1000 for token in plain.encode(TEXT)] and 1000 + 258 in ids
    assert tokenizer.detokenize(ids) == TEXT
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eod, tokenizer.mask, tokenizer.pad, tokenizer.cls, tokenizer.sep) == (
        0, 1, 2, 3, 4, 5, 6
    )
    assert tokenizer.detokenize([1, *ids], skip_special_tokens=True) == TEXT
    assert tokenizer.vocab_size == 1262


def test_megatron_gpt2_bpe(bpe_dir):
    tokenizer = MegatronTokenizer.from_pretrained(
        "GPT2BPETokenizer", metadata_path={"library": "megatron", "model_type": "gpt"},
        vocab_file=bpe_dir["vocab_file"], merges_file=bpe_dir["merge_file"],
    )
    assert isinstance(tokenizer, GPTTokenizer) and tokenizer.vocab_file == bpe_dir["vocab_file"]
    hf = MegatronTokenizer.from_pretrained(bpe_dir["dir"], metadata_path={"library": "huggingface"})
    ids = tokenizer.tokenize(TEXT + "<|endoftext|>")
    assert ids == hf.tokenize(TEXT + "<|endoftext|>") and ids[-1] == tokenizer.eod
    assert tokenizer.detokenize(ids) == TEXT + "<|endoftext|>"
    assert tokenizer.vocab_size == 300 and tokenizer.eos == tokenizer.eod == tokenizer.bos
    with pytest.raises(ValueError, match="needs vocab_file and merges_file"):
        MegatronTokenizer.from_pretrained("GPT2BPETokenizer", metadata_path={"library": "megatron"})
    with pytest.raises(ValueError, match="WordPiece"):
        MegatronTokenizer.from_pretrained("BertWordPieceCase", metadata_path={"library": "megatron"})


def test_byte_level():
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"}, special_tokens=["<a>", "<b>"])
    ids = tokenizer.tokenize("héllo")
    assert ids == list("héllo".encode()) and tokenizer.detokenize([*ids, 513, 512]) == "héllo"
    assert tokenizer.vocab_size == 514 and (tokenizer.eod, tokenizer.pad, tokenizer.unk) == (0, 1, 259)
    assert tokenizer._tokenizer.tokens_to_ids(["<a>", "<b>", 65]) == [513, 512, 65]


def test_metadata_round_trip(bpe_dir, tmp_path):
    directory = tmp_path / "tok"
    shutil.copytree(bpe_dir["dir"], directory)
    MegatronTokenizer.write_metadata(str(directory), "huggingface", model_type="gpt", chat_template="{{ messages }}")
    metadata = json.loads((directory / "tokenizer_metadata.json").read_text())
    assert metadata == {
        "library": "huggingface", "class_name": None, "class_path": None, "model_type": "gpt",
        "chat_template": "{{ messages }}",
    }
    with pytest.raises(ValueError, match="already exists"):
        MegatronTokenizer.write_metadata(str(directory), "huggingface")
    for path in (directory, directory / "tokenizer.json"):  # a directory or a file inside it
        tokenizer = MegatronTokenizer.from_pretrained(str(path))
        assert isinstance(tokenizer, GPTTokenizer) and tokenizer.chat_template == "{{ messages }}"
        assert tokenizer.metadata_path == str(directory / "tokenizer_metadata.json")
        assert tokenizer.class_name == "GPTTokenizer" and tokenizer.class_path.endswith("text.models.gpt_tokenizer")
    # a custom class recorded by write_metadata (Megatron's module paths map onto ours)
    custom = tmp_path / "custom.json"
    MegatronTokenizer.write_metadata(str(directory), "huggingface", tokenizer_class=GPTTokenizer, metadata_path=str(custom))
    data = json.loads(custom.read_text())
    assert data["model_type"] is None and data["class_name"] == "GPTTokenizer"
    data["class_path"] = "megatron.core.tokenizers.text.models.gpt_tokenizer"
    custom.write_text(json.dumps(data))
    assert type(MegatronTokenizer.from_pretrained(str(directory), metadata_path=str(custom))) is GPTTokenizer


def test_clear_errors(tmp_path, bpe_dir):
    with pytest.raises(ValueError, match=r"library 'word2vec' is not supported; metadata 'library' must be one of"):
        MegatronTokenizer.from_pretrained(str(tmp_path), metadata_path={"library": "word2vec"})
    with pytest.raises(ValueError, match=r"'multimodal' needs the keyword arguments \['prompt_format'"):
        MegatronTokenizer.from_pretrained(str(tmp_path), metadata_path={"library": "multimodal"})
    with pytest.raises(FileNotFoundError, match="tokenizer_metadata.json does not exist.*write_metadata"):
        MegatronTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        MegatronTokenizer.from_pretrained(str(tmp_path), metadata_path={"library": "huggingface"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MegatronTokenizer.from_pretrained(str(tmp_path / "x.model"), metadata_path={"library": "sentencepiece"})
    with pytest.raises(ValueError, match="'tiktoken' needs tokenizer_path"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "tiktoken"})
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        MegatronTokenizer.from_pretrained(bpe_dir["dir"], metadata_path={"library": "huggingface", "model_type": "llama"})
    with pytest.raises(ValueError, match="Expected metadata_path to be str or dict"):
        MegatronTokenizer.from_pretrained(bpe_dir["dir"], metadata_path=3)
    with pytest.raises(OSError, match="from_pretrained"):
        MegatronTokenizer()
    with pytest.raises(ValueError, match="no chat_template"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=8).apply_chat_template([])
    assert issubclass(GPTTokenizer, MegatronTokenizerText)


def test_compile_helpers_is_a_noop_that_logs_once(caplog):
    from megatron_core.datasets import utils

    utils._helpers_logged = False
    with caplog.at_level(logging.INFO, logger="megatron_core.datasets.utils"):
        assert utils.compile_helpers() is None
        utils.compile_helpers()
    assert sum("nothing to compile" in record.message for record in caplog.records) == 1


def test_libraries_match_megatron_core_oracle(sentencepiece_model, tiktoken_file):
    """Ids and special ids equal megatron-core's library tokenizers (the test-oracle extra)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = pytest.importorskip("megatron.core.tokenizers.text.libraries")
    texts = [TEXT, "  two  spaces and\ttabs\n", "héllo 🙂 the theatre"]
    ours_sp = MegatronTokenizer.from_pretrained(sentencepiece_model, metadata_path={"library": "sentencepiece"})
    their_sp = reference.SentencePieceTokenizer(sentencepiece_model)
    ours_tt = MegatronTokenizer.from_pretrained(
        tiktoken_file, metadata_path={"library": "tiktoken"}, vocab_size=1262, num_special_tokens=1000
    )
    their_tt = reference.TikTokenTokenizer(tiktoken_file, vocab_size=1262, num_special_tokens=1000)
    ours_bl = MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"}, special_tokens=["<a>", "<b>"])
    their_bl = reference.ByteLevelTokenizer(special_tokens=["<a>", "<b>"])
    for ours, theirs in ((ours_sp, their_sp), (ours_tt, their_tt), (ours_bl, their_bl)):
        for text in texts:
            ids = ours.tokenize(text)
            assert ids == theirs.text_to_ids(text)
            if text.isascii():  # megatron-core 0.16.1's tiktoken decodes multi-byte characters token by token
                assert ours.detokenize(ids) == theirs.ids_to_text(ids)
        assert ours.vocab_size == theirs.vocab_size
        assert (ours.eod, ours.pad_id, ours.eos_id) == (theirs.eod, theirs.pad_id, theirs.eos_id)
    assert their_bl.tokens_to_ids(["<a>", "<b>"]) == ours_bl._tokenizer.tokens_to_ids(["<a>", "<b>"])
    # (megatron-core 0.16.1's null tokenizer still has the legacy vocab_size + 1 ids; 0.19 has vocab_size)
    null = reference.NullTokenizer(64)
    ours_null = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=64)
    assert ours_null.tokenize("5 7 9") == null.text_to_ids("5 7 9") == [5, 7, 9]
    assert ours_null.detokenize([5, 7, 9]) == null.ids_to_text([5, 7, 9])
