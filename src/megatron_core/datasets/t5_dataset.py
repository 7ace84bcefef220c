"""``T5MaskedWordPieceDataset``: T5 span-corruption samples over WordPiece sentences.

Megatron-Core's ``megatron.core.datasets.t5_dataset``. The sample's sentences are joined and cut
to the target length; each masked span is replaced in the encoder input by the next sentinel
(``tokenizer.additional_special_tokens_ids``, in order), and the decoder reads
``[BOS] s0 span0 s1 span1 ...`` and predicts ``s0 span0 s1 span1 ... [EOS]``. Encoder and decoder
inputs are padded to ``sequence_length_encoder`` (= ``sequence_length``) and
``sequence_length_decoder``; ``enc_mask``/``dec_mask`` are 1 on tokens, ``labels`` are padded with
-1 and ``loss_mask`` covers the decoder tokens. :meth:`T5MaskedWordPieceDataset.config_attention_mask`
turns the padding masks into the shapes the local and Transformer Engine attention expect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy
import torch
from packaging.version import Version

from megatron_core._version_utils import get_te_version
from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig
from megatron_core.datasets.utils import Split

__all__ = ["T5MaskedWordPieceDataset", "T5MaskedWordPieceDatasetConfig"]

_SPECIAL_TOKENS = 2  # room kept for [BOS] and [EOS]


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of the T5 dataset; ``sequence_length_decoder`` is required."""

    sequence_length_encoder: int | None = field(init=False, default=None)
    """Derived: the encoder length, equal to ``sequence_length``."""

    sequence_length_decoder: int | None = None
    """The decoder length."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sequence_length_encoder = self.sequence_length
        if self.sequence_length_decoder is None or self.sequence_length_decoder <= 0:
            raise ValueError(
                f"T5MaskedWordPieceDatasetConfig: sequence_length_decoder ({self.sequence_length_decoder}) must be a "
                "positive integer"
            )
        self.check_sequence_length(_SPECIAL_TOKENS)
        self.require_tokenizer_attributes(("bos", "eos", "additional_special_tokens_ids"))
        if len(self.tokenizer.additional_special_tokens_ids) == 0:
            raise ValueError("T5MaskedWordPieceDatasetConfig: the tokenizer has no additional_special_tokens_ids "
                             "(the sentinel tokens T5 masking needs)")


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """T5 samples from one split of a sentence-level ``IndexedDataset``; items are dicts of numpy arrays and ints."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: T5MaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.token_lookup = list(self.config.tokenizer.inv_vocab.keys())
        self.sample_index = self._build_sample_index(self.config.sequence_length - _SPECIAL_TOKENS, 1)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """The masked-dataset attributes plus ``sequence_length_decoder``."""
        return MaskedWordPieceDataset._key_config_attributes() + ["sequence_length_decoder"]

    @staticmethod
    def _build_b1ss_attention_mask(
        source_block: torch.Tensor, target_block: torch.Tensor, make_history_mask: bool = False
    ) -> torch.Tensor:
        """``[b, 1, q, kv]`` boolean mask (True = masked) of the query tokens ``source_block`` ``[b, q]``
        against the key tokens ``target_block`` ``[b, kv]``: ids below 1 (padding) are masked, and with
        ``make_history_mask`` so is every later position (q must equal kv)."""
        visible = (source_block[:, :, None] >= 1) & (target_block[:, None, :] >= 1)
        if make_history_mask:
            length = source_block.shape[1]
            visible = visible & torch.ones(length, length, dtype=torch.bool, device=visible.device).tril()
        return (~visible).unsqueeze(1)

    @staticmethod
    def config_attention_mask(
        encoder_tokens: torch.Tensor,
        decoder_tokens: torch.Tensor,
        encoder_mask: torch.Tensor,
        decoder_mask: torch.Tensor,
        use_local: bool = False,
        test_te_version: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """(encoder, decoder, encoder-decoder) masks for the attention implementation in use.

        Local attention: ``[b, 1, s, s]`` masks built from the tokens (the decoder's causal). Transformer
        Engine: the padding masks as ``[b, 1, 1, s]``, the decoder mask None (causal) and the cross mask a
        ``(decoder, encoder)`` pair; before TE 1.10, unless ``NVTE_FLASH_ATTN`` or ``NVTE_FUSED_ATTN`` is 1,
        the encoder and cross masks are ``[b, 1, q, kv]`` instead. ``test_te_version`` overrides the
        installed version (``0.0.0`` when TE is absent).
        """
        build = T5MaskedWordPieceDataset._build_b1ss_attention_mask
        if use_local:
            return (
                build(encoder_tokens, encoder_tokens),
                build(decoder_tokens, decoder_tokens, make_history_mask=True),
                build(decoder_tokens, encoder_tokens),
            )
        encoder_padding = encoder_mask.unsqueeze(1).unsqueeze(1)
        encoder_decoder_mask = (decoder_mask.unsqueeze(1).unsqueeze(1), encoder_padding)
        te_version = Version(test_te_version) if test_te_version is not None else get_te_version()
        if te_version >= Version("1.10.0"):
            return encoder_padding, None, encoder_decoder_mask
        flash = os.getenv("NVTE_FLASH_ATTN") == "1"
        fused = os.getenv("NVTE_FUSED_ATTN") == "1"
        if flash or fused:
            if te_version < Version("1.7.0"):
                raise ValueError(
                    f"Transformer Engine {te_version} (< 1.7) supports neither flash (NVTE_FLASH_ATTN="
                    f"{os.getenv('NVTE_FLASH_ATTN')}) nor fused (NVTE_FUSED_ATTN={os.getenv('NVTE_FUSED_ATTN')}) "
                    "attention with these masks: set both to 0 or upgrade Transformer Engine to 1.7 or later"
                )
            return encoder_padding, None, encoder_decoder_mask
        return build(encoder_tokens, encoder_tokens), None, build(decoder_tokens, encoder_tokens)

    def __getitem__(self, idx: int) -> dict[str, int | numpy.ndarray]:
        """Sample ``idx``: text_enc, text_dec, labels, loss_mask, truncated, enc_mask, dec_mask."""
        sentences, target = self._sample_sentences(idx)
        random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        tokenizer = self.config.tokenizer

        tokens = [token for sentence in sentences for token in sentence]
        truncated = len(tokens) > target
        tokens = tokens[:target]
        tokens, _, _, _, spans = self._create_masked_lm_predictions(tokens, target, random_state)

        sentinels = list(tokenizer.additional_special_tokens_ids)
        if len(spans) > len(sentinels):
            raise ValueError(f"T5 sample {idx} masks {len(spans)} spans but the tokenizer has only {len(sentinels)} "
                             "sentinel tokens (additional_special_tokens_ids)")
        encoder_input: list[int] = []
        decoder_input = [tokenizer.bos]
        decoder_output: list[int] = []
        kept_from = 0
        for sentinel, (positions, labels) in zip(sentinels, spans):
            encoder_input.extend(tokens[kept_from : positions[0]])
            encoder_input.append(sentinel)
            decoder_input.extend([sentinel, *labels])
            decoder_output.extend([sentinel, *labels])
            kept_from = positions[-1] + 1
        encoder_input.extend(tokens[kept_from:])
        decoder_output.append(tokenizer.eos)

        length_encoder = self.config.sequence_length_encoder
        length_decoder = self.config.sequence_length_decoder
        if len(encoder_input) > length_encoder or len(decoder_input) > length_decoder:
            raise ValueError(
                f"T5 sample {idx} has {len(encoder_input)} encoder and {len(decoder_input)} decoder tokens; "
                f"sequence_length_encoder is {length_encoder} and sequence_length_decoder {length_decoder} "
                "(raise sequence_length_decoder or lower masking_probability)"
            )
        pad = self._pad_token_id
        encoder_array = numpy.full(length_encoder, pad, dtype=numpy.int64)
        encoder_array[: len(encoder_input)] = encoder_input
        decoder_array = numpy.full(length_decoder, pad, dtype=numpy.int64)
        decoder_array[: len(decoder_input)] = decoder_input
        encoder_mask = (encoder_array != pad).astype(numpy.int64)
        decoder_mask = (decoder_array != pad).astype(numpy.int64)
        labels = numpy.full(length_decoder, -1, dtype=numpy.int64)
        labels[: len(decoder_output)] = decoder_output
        loss_mask = numpy.zeros(length_decoder, dtype=numpy.int64)
        loss_mask[: len(decoder_input)] = 1
        encoder_array[encoder_array == pad] = 0
        decoder_array[decoder_array == pad] = 0
        labels[labels == pad] = 0
        return {
            "text_enc": encoder_array,
            "text_dec": decoder_array,
            "labels": labels,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": encoder_mask,
            "dec_mask": decoder_mask,
        }

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> int:
        """Always the [MASK] id (T5 replaces the masked spans by sentinels afterwards)."""
        return self.config.tokenizer.mask
