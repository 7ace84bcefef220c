"""A toy WordPiece vocabulary and sentence-level corpora for the BERT and T5 dataset tests.

Ids: 0 [PAD], 1 [CLS], 2 [SEP], 3 [MASK], 4 [BOS], 5 [EOS], then ``SENTINELS`` sentinel tokens,
``WORDS`` word starts ``w<i>`` and ``PIECES`` continuation pieces ``##p<i>``. Every sentence is a
sequence in the ``.bin``/``.idx`` files and every document ends with ``end_document``.
"""

from __future__ import annotations

import numpy
import torch

from megatron_core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_core.datasets.megatron_tokenizer import MegatronTokenizer

SENTINELS = 40
WORDS = 60
PIECES = 30
FIRST_SENTINEL = 6
FIRST_WORD = FIRST_SENTINEL + SENTINELS
FIRST_PIECE = FIRST_WORD + WORDS


class ToyWordPieceTokenizer(MegatronTokenizer):
    """Whitespace tokenizer over the fixed toy vocabulary (unknown strings are an error)."""

    def __init__(self) -> None:
        super().__init__("toy-wordpiece")
        names = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]"]
        names += [f"<extra_id_{i}>" for i in range(SENTINELS)]
        names += [f"w{i}" for i in range(WORDS)] + [f"##p{i}" for i in range(PIECES)]
        self._inv_vocab = dict(enumerate(names))
        self._vocab = {name: index for index, name in self._inv_vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        """Split on whitespace and look every piece up."""
        return [self._vocab[piece] for piece in text.split()]

    @property
    def vocab(self) -> dict:
        """Piece to id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        """Id to piece, in id order."""
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        """Number of ids."""
        return len(self._inv_vocab)

    pad = property(lambda self: 0, doc="PAD id.")
    cls = property(lambda self: 1, doc="CLS id.")
    sep = property(lambda self: 2, doc="SEP id.")
    mask = property(lambda self: 3, doc="MASK id.")
    bos = property(lambda self: 4, doc="BOS id.")
    eos = property(lambda self: 5, doc="EOS id.")
    additional_special_tokens_ids = property(lambda self: list(range(FIRST_SENTINEL, FIRST_WORD)),
                                             doc="The sentinel ids.")


def random_sentence(rng: numpy.random.Generator, num_words: int) -> list[int]:
    """``num_words`` words of one start piece and 0-2 ``##`` pieces each."""
    tokens = []
    for _ in range(num_words):
        tokens.append(FIRST_WORD + int(rng.integers(WORDS)))
        tokens.extend(FIRST_PIECE + rng.integers(PIECES, size=int(rng.choice(3, p=[0.6, 0.3, 0.1]))))
    return [int(token) for token in tokens]


def write_sentence_corpus(prefix: str, num_documents: int, seed: int, long_sentence_every: int = 0) -> None:
    """Documents of 0-8 sentences of 1-12 words; with ``long_sentence_every`` some hold a 600-token sentence."""
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for document in range(num_documents):
        for _ in range(int(rng.integers(0, 9))):
            builder.add_item(torch.tensor(random_sentence(rng, int(rng.integers(1, 13)))))
        if long_sentence_every and document % long_sentence_every == 0:
            builder.add_item(torch.tensor([FIRST_WORD] * 600))
        builder.end_document()
    builder.finalize(prefix + ".idx")
