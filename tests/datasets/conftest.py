"""Fixtures for the dataset tests: small corpora on disk and the optional megatron-core oracle.

``mcore`` imports megatron-core, installed beside us by the ``test-oracle`` extra (also in ``dev``;
our distribution is ``megatron-core-lite``), and skips when it is absent.
"""

from __future__ import annotations

import importlib
import json
import os
import textwrap
import warnings

import numpy
import pytest
import torch

from megatron_core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_core.datasets.tokenizers import train_bpe_tokenizer

VOCAB = 100
EOD = VOCAB  # NullTokenizer(VOCAB).eod


def write_corpus(
    prefix: str, num_documents: int, seed: int, dtype=numpy.uint16, max_length: int = 60, empty_every: int = 0
) -> None:
    """Random documents of 1..max_length tokens in [0, VOCAB), each ending with EOD.

    With ``empty_every`` > 0 every such document is a zero-length sequence instead.
    """
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for index in range(num_documents):
        length = int(rng.integers(1, max_length))
        if empty_every and index % empty_every == 0:
            builder.add_item(torch.tensor([], dtype=torch.int64))
        else:
            builder.add_item(torch.tensor([*rng.integers(0, VOCAB, length).tolist(), EOD]))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="session")
def corpora(tmp_path_factory) -> dict[str, str]:
    """Small GPT corpora as ``.bin``/``.idx`` prefixes: a, b, c (200, 150, 90 documents) and z (120
    documents, every third a zero-length sequence)."""
    directory = tmp_path_factory.mktemp("corpora")
    prefixes = {}
    for name, count, seed, empty_every in (("a", 200, 1, 0), ("b", 150, 2, 0), ("c", 90, 3, 0), ("z", 120, 4, 3)):
        prefixes[name] = os.path.join(directory, name)
        write_corpus(prefixes[name], count, seed, empty_every=empty_every)
    return prefixes


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory) -> dict[str, str]:
    """A 400-token byte-level BPE trained on two standard-library sources (offline everywhere)."""
    pytest.importorskip("tokenizers")
    sources = [json.__file__, textwrap.__file__]
    return train_bpe_tokenizer(sources, 400, str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="session")
def mcore():
    """The megatron-core package (oracle), or skip."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module("megatron.core")
            for name in ("indexed_dataset", "gpt_dataset", "blended_megatron_dataset_builder", "helpers"):
                importlib.import_module(f"megatron.core.datasets.{name}")
        except ImportError as error:
            pytest.skip(f"megatron-core oracle not installed: {error}")
    return module


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Small per-sample tensor ops are ~50x slower with intra-op threads on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
