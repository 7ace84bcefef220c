"""The heterogeneous tests' tiny model: five blocks, each different, and a builder for this library's GPTModel.

Block 0 has no attention, block 1 a linear in place of attention (and a 48-wide FFN), block 2 its own query
groups (``n_heads_in_group``), block 3 no MLP, block 4 a linear in place of the MLP; the widths come from
``ffn_hidden_size`` and DeciLM's ``ffn_mult`` (which rounds up to a multiple of 256).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron_core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

VOCAB, SEQ, BATCH, MAX_SEQ = 64, 8, 2, 16


def _block(attention: dict, ffn: dict) -> dict:
    return {"attention": {"no_op": False, "replace_with_linear": False, **attention},
            "ffn": {"no_op": False, "replace_with_linear": False, **ffn}}


BLOCKS = [
    _block({"no_op": True, "n_heads_in_group": None}, {"ffn_mult": 1.5}),
    _block({"replace_with_linear": True, "n_heads_in_group": None}, {"ffn_hidden_size": 48}),
    _block({"n_heads_in_group": 4}, {"ffn_hidden_size": 64}),
    _block({"num_query_groups": 4}, {"no_op": True, "ffn_mult": None}),
    _block({"n_heads_in_group": 2}, {"replace_with_linear": True, "ffn_mult": None}),
]
CONFIG = dict(num_layers=len(BLOCKS), hidden_size=32, num_attention_heads=8, ffn_hidden_size=64,
              normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, layernorm_epsilon=1e-5)


def encoded_blocks(blocks: list[dict] | None = None) -> str:
    """The DeciLM-style JSON document holding ``blocks`` (default: :data:`BLOCKS`)."""
    return json.dumps({"block_configs": BLOCKS if blocks is None else blocks})


def config(**overrides) -> HeterogeneousTransformerConfig:
    """The five-block config (``overrides`` replace base fields)."""
    return HeterogeneousTransformerConfig(**{**CONFIG, **overrides},
                                          heterogeneous_layers_config_encoded_json=encoded_blocks())


def build(cfg: HeterogeneousTransformerConfig, seed: int = 3) -> GPTModel:
    """A GPTModel on ``cfg`` with RoPE, its norm weights moved away from 1 so that they matter."""
    torch.manual_seed(seed)
    model = GPTModel(cfg, get_gpt_heterogeneous_layer_spec(cfg), VOCAB, MAX_SEQ, position_embedding_type="rope")
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, labels)``, each ``[b, s]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.arange(SEQ).expand(BATCH, SEQ), labels
