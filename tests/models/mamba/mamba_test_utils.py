"""Tiny hybrid Mamba model builders and a fixed batch shared by the MambaModel tests."""

from __future__ import annotations

import torch

from megatron_core.models.mamba import MambaModel
from megatron_core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron_core.transformer import TransformerConfig

VOCAB, SEQ, BATCH = 64, 11, 2


def config(pattern: str, **overrides) -> TransformerConfig:
    """A tiny RMSNorm config: 4 Mamba heads of 8 in 2 groups, state 8."""
    cfg = dict(num_layers=len(pattern.replace("|", "")), hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
               use_cpu_initialization=True, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
               layernorm_epsilon=1e-5)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def build(pattern: str, **overrides) -> MambaModel:
    """A MambaModel with the local spec and ``pattern``."""
    return MambaModel(config(pattern, **overrides), mamba_stack_spec, VOCAB, 32, hybrid_layer_pattern=pattern)


def batch(seed: int = 5, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, labels)``, each ``[b, s]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    return ids, torch.arange(seq).unsqueeze(0).expand(BATCH, seq), labels
