"""``BERTMaskedWordPieceDataset``: BERT pre-training samples (masked LM, optional next-sentence prediction).

Megatron-Core's ``megatron.core.datasets.bert_dataset``. A sample is ``[CLS] A [SEP] B [SEP]``
padded to ``sequence_length``. With ``classification_head`` the sentences are cut into A and B at
a random point and swapped with probability 1/2 (``is_random``: the sentence-order label);
without it everything is segment A. Over-long pairs are trimmed one token at a time from a random
end of the longer segment. Masked tokens become ``[MASK]`` 80% of the time, a random vocabulary
id 10%, and stay unchanged 10%. Fields as Megatron returns them: ``labels`` is -1 where nothing is
predicted, ``padding_mask`` is 1 on tokens and the pad id on padding, and pad ids in ``text`` and
``labels`` are replaced by 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig
from megatron_core.datasets.utils import Split

__all__ = ["BERTMaskedWordPieceDataset", "BERTMaskedWordPieceDatasetConfig"]

_SPECIAL_TOKENS = 3  # [CLS] and two [SEP]


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of the BERT dataset; ``classification_head`` is required."""

    classification_head: bool | None = None
    """Build sentence pairs for next-sentence (sentence-order) prediction."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.classification_head is None:
            raise ValueError("BERTMaskedWordPieceDatasetConfig: classification_head must be set to True or False")
        self.check_sequence_length(_SPECIAL_TOKENS)


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """BERT samples from one split of a sentence-level ``IndexedDataset``; items are dicts of numpy arrays and ints."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: BERTMaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.token_lookup = sorted(self.config.tokenizer.inv_vocab.keys())
        self.sample_index = self._build_sample_index(
            self.config.sequence_length - _SPECIAL_TOKENS, 2 if self.config.classification_head else 1
        )

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """The masked-dataset attributes plus ``classification_head``."""
        return MaskedWordPieceDataset._key_config_attributes() + ["classification_head"]

    def __getitem__(self, idx: int) -> dict[str, int | numpy.ndarray]:
        """Sample ``idx``: text, types, labels, is_random, padding_mask, loss_mask, truncated."""
        sentences, target = self._sample_sentences(idx)
        random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        tokenizer = self.config.tokenizer

        pivot = len(sentences)
        is_next_random = False
        if self.config.classification_head:
            if len(sentences) < 2:
                raise ValueError(f"BERT sample {idx} has {len(sentences)} sentence(s); sentence pairs need 2")
            pivot = random_state.randint(low=1, high=len(sentences)) if len(sentences) >= 3 else 1
            is_next_random = random_state.random() < 0.5
        segment_a = [token for sentence in sentences[:pivot] for token in sentence]
        segment_b = [token for sentence in sentences[pivot:] for token in sentence]
        if is_next_random:
            segment_a, segment_b = segment_b, segment_a

        truncated = len(segment_a) + len(segment_b) > target
        while len(segment_a) + len(segment_b) > target:
            longer = segment_a if len(segment_a) > len(segment_b) else segment_b
            if random_state.random() < 0.5:
                del longer[0]
            else:
                del longer[-1]

        tokens = [tokenizer.cls, *segment_a, tokenizer.sep]
        types = [0] * len(tokens)
        if segment_b:
            tokens += [*segment_b, tokenizer.sep]
            types += [1] * (len(segment_b) + 1)

        tokens, positions, labels_at, _, _ = self._create_masked_lm_predictions(tokens, target, random_state)

        pad = self._pad_token_id
        length = self.config.sequence_length
        padding = length - len(tokens)
        text = numpy.pad(numpy.array(tokens, dtype=numpy.int64), (0, padding), constant_values=pad)
        types_array = numpy.pad(numpy.array(types, dtype=numpy.int64), (0, padding), constant_values=pad)
        padding_mask = numpy.ones(length, dtype=numpy.int64)
        padding_mask[text == pad] = pad
        labels = numpy.full(length, -1, dtype=numpy.int64)
        labels[positions] = labels_at
        loss_mask = numpy.zeros(length, dtype=numpy.int64)
        loss_mask[positions] = 1
        text[text == pad] = 0
        labels[labels == pad] = 0
        return {
            "text": text,
            "types": types_array,
            "labels": labels,
            "is_random": int(is_next_random),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> int | None:
        """[MASK] with probability 0.8, a random vocabulary id 0.1, unchanged (``None``) 0.1."""
        if numpy_random_state.random() < 0.8:
            return self.config.tokenizer.mask
        if numpy_random_state.random() >= 0.5:
            return self.token_lookup[numpy_random_state.randint(0, len(self.token_lookup))]
        return None
