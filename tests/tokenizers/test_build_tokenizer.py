"""``tokenizers.utils.build_tokenizer.build_tokenizer(args)`` and a dataset built on a 0.19 tokenizer."""

from __future__ import annotations

from argparse import Namespace

import numpy
import pytest

from megatron_core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron_core.tokenizers import MegatronTokenizer
from megatron_core.tokenizers.utils.build_tokenizer import build_tokenizer, vocab_size_with_padding


def test_build_tokenizer_from_args(bpe_dir, sentencepiece_model):
    args = Namespace(tokenizer_type="NullTokenizer", vocab_size=1000, make_vocab_size_divisible_by=128,
                     tensor_model_parallel_size=2, rank=0)
    null = build_tokenizer(args)
    assert (null.vocab_size, null.eod, args.padded_vocab_size) == (1000, 999, 1024)
    args = Namespace(tokenizer_type="NullTokenizer", vocab_size=10, null_tokenizer_eod_id=3, null_tokenizer_pad_id=4,
                     padded_vocab_size=77)
    null = build_tokenizer(args)
    assert (null.eod, null.pad, args.padded_vocab_size) == (3, 4, 77)  # an existing padded size is kept
    gpt2 = build_tokenizer(Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=bpe_dir["vocab_file"],
                                     merge_file=bpe_dir["merge_file"], pad_vocab_size=False))
    hf = build_tokenizer(Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=bpe_dir["dir"],
                                   pad_vocab_size=False))
    assert gpt2.library == "megatron" and hf.library == "huggingface"
    assert gpt2.tokenize("the text wraps") == hf.tokenize("the text wraps")
    sp = build_tokenizer(Namespace(tokenizer_type="Llama2Tokenizer", tokenizer_model=sentencepiece_model,
                                   make_vocab_size_divisible_by=64))
    assert sp.library == "sentencepiece" and sp.vocab_size == 200
    with pytest.raises(ValueError, match="tokenizer_type Word2Vec is not supported"):
        build_tokenizer(Namespace(tokenizer_type="Word2Vec"))
    with pytest.raises(ValueError, match="'multimodal' needs tokenizer_path"):
        build_tokenizer(Namespace(tokenizer_type="MultimodalTokenizer"))
    with pytest.raises(ValueError, match="NullTokenizer needs args.vocab_size"):
        build_tokenizer(Namespace(tokenizer_type="NullTokenizer"))
    assert vocab_size_with_padding(50257, Namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=1)) == 50304


def test_mock_gpt_dataset_with_null_text_tokenizer(tmp_path):
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=64)
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=64, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=tokenizer, mid_level_dataset_surplus=0.005, path_to_cache=str(tmp_path),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [40, None, None], lambda: True, config).build()
    assert len(train) >= 40 and all(split is not None for split in (valid, test))  # one epoch each
    sample = train[0]
    tokens = sample["tokens"].numpy()
    assert tokens.shape == (64,) and tokens.max() < 64 and numpy.all(sample["loss_mask"].numpy() == 1.0)
    assert (sample["labels"][:-1] == sample["tokens"][1:]).all()
