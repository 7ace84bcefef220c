"""Shared builders for the T5 tests: a small config, the model on the local specs, inputs and masks."""

from __future__ import annotations

import torch

from megatron_core.models.T5 import T5Model
from megatron_core.models.T5.t5_model import t5_extended_attention_mask
from megatron_core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_encoder_with_local_block_spec,
)
from megatron_core.transformer import TransformerConfig

HIDDEN, HEADS, FFN, LAYERS, VOCAB, MAX_SEQ = 64, 4, 128, 2, 96, 32
BATCH, ENC_LEN, DEC_LEN = 2, 12, 8
CONFIG_FIELDS = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                     hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                     masked_softmax_fusion=False, use_cpu_initialization=True)


def config(**overrides) -> TransformerConfig:
    """A small fp32 config without dropout."""
    return TransformerConfig(**{**CONFIG_FIELDS, **overrides})


def model(cfg: TransformerConfig | None = None, **kwargs) -> T5Model:
    """A T5 model on the local specs (encoder and decoder share the config)."""
    cfg = cfg or config()
    return T5Model(cfg, cfg, get_t5_encoder_with_local_block_spec(LAYERS), get_t5_decoder_with_local_block_spec(LAYERS),
                   vocab_size=VOCAB, max_sequence_length=MAX_SEQ, **kwargs)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm scales around 1), so that no mapping mistake hides behind an init value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm_scale = param.dim() == 1 and "norm" in name and name.endswith("weight")
            param.copy_(1.0 + 0.2 * noise if is_norm_scale else 0.2 * noise)


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Ids, labels and Megatron masks (True = masked): padded encoder keys, causal + padded decoder, cross."""
    gen = torch.Generator().manual_seed(seed)
    enc_ids = torch.randint(0, VOCAB, (BATCH, ENC_LEN), generator=gen)
    dec_ids = torch.randint(0, VOCAB, (BATCH, DEC_LEN), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, DEC_LEN), generator=gen)
    enc_valid = torch.tensor([ENC_LEN, ENC_LEN - 4])  # the second sample's last encoder tokens are padding
    dec_valid = torch.tensor([DEC_LEN, DEC_LEN - 3])
    enc_pad = torch.arange(ENC_LEN)[None, :] >= enc_valid[:, None]  # [b, se]
    dec_pad = torch.arange(DEC_LEN)[None, :] >= dec_valid[:, None]  # [b, sd]
    future = torch.ones(DEC_LEN, DEC_LEN, dtype=torch.bool).triu(1)
    enc_mask = enc_pad[:, None, :].expand(BATCH, ENC_LEN, ENC_LEN)
    dec_mask = future[None] | dec_pad[:, None, :]
    cross_mask = enc_pad[:, None, :].expand(BATCH, DEC_LEN, ENC_LEN)
    enc_mask, dec_mask, cross_mask = t5_extended_attention_mask([enc_mask, dec_mask, cross_mask])
    return dict(encoder_input_ids=enc_ids, decoder_input_ids=dec_ids, encoder_attn_mask=enc_mask,
                decoder_attn_mask=dec_mask, encoder_decoder_attn_mask=cross_mask, lm_labels=labels)
