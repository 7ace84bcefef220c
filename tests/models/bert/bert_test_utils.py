"""Tiny BERT sizes, config, builder, batch and weight randomiser shared by the BERT tests."""

from __future__ import annotations

import torch

from megatron_core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron_core.models.bert.bert_model import BertModel
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.spec_utils import ModuleSpec

VOCAB, SEQ, BATCH, MAX_SEQ, HIDDEN, HEADS, LAYERS = 64, 8, 3, 16, 32, 4, 2
# Sample 0 is full, samples 1 and 2 are right-padded (their real lengths).
LENGTHS = (SEQ, 5, 3)
CONFIG = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
              attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False)


def config(**overrides) -> TransformerConfig:
    """Our config for the tiny BERT (LayerNorm, GeLU, biases)."""
    return TransformerConfig(**{**CONFIG, **overrides})


def build(cfg: TransformerConfig | None = None, num_tokentypes: int = 2,
          transformer_layer_spec: ModuleSpec | None = None, **kwargs) -> BertModel:
    """A tiny BertModel (on the local spec unless ``transformer_layer_spec`` is given)."""
    spec = transformer_layer_spec or bert_layer_local_spec
    return BertModel(cfg or config(), num_tokentypes, spec, VOCAB, MAX_SEQ, **kwargs)


def batch(seed: int = 3) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (right padding per :data:`LENGTHS`), ``tokentype_ids``, ``lm_labels``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    types = (torch.arange(SEQ)[None, :] >= torch.tensor([4, 3, 2])[:, None]).long() * mask
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return dict(input_ids=ids, attention_mask=mask, tokentype_ids=types, lm_labels=labels)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm scales around 1), so that no mapping mistake hides behind an init value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm_scale = param.dim() == 1 and "norm" in name and name.endswith("weight")
            param.copy_(1.0 + 0.2 * noise if is_norm_scale else 0.2 * noise)


def masked_objective(loss: torch.Tensor, binary_logits: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """A scalar mixing the real tokens' LM loss with the binary logits (fixed weights), for gradients."""
    total = (loss * mask).sum()
    if binary_logits is not None:
        weights = torch.tensor([[0.7, -1.3]], dtype=binary_logits.dtype, device=binary_logits.device)
        total = total + (binary_logits * weights).sum()
    return total
