"""Shared tiny DSA configs and models for the DSA tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_dsa_module_spec_for_backend,
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron_core.transformer import MLATransformerConfig
from megatron_core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
    DSAIndexerLossLoggingHelper,
)
from megatron_core.transformer.spec_utils import build_module

VOCAB, SEQ, BATCH, TOPK = 64, 16, 2, 5
TOL = dict(rtol=1e-5, atol=1e-5)
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
             qk_pos_emb_head_dim=8, v_head_dim=6, ffn_hidden_size=64, qk_layernorm=True, add_bias_linear=False,
             gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
             use_cpu_initialization=True, layernorm_epsilon=1e-6, normalization="RMSNorm", rope_type="yarn",
             rotary_base=1000.0, rotary_scaling_factor=4.0, original_max_position_embeddings=8, mscale_all_dim=0.7,
             experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=16,
             dsa_indexer_topk=TOPK, dsa_indexer_loss_coeff=0.1)


def dsa_config(**overrides) -> MLATransformerConfig:
    """A tiny DSA config (YaRN, qk_layernorm, top-5 of 16 tokens, indexer loss 0.1)."""
    return MLATransformerConfig(**{**SHAPE, **overrides})


def perturb(module: torch.nn.Module, seed: int = 11) -> None:
    """Move norm weights off 1 and biases off 0 so that checks see them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))


def dsa_layer(cfg: MLATransformerConfig, seed: int = 3) -> torch.nn.Module:
    """One DSA attention layer (MLA + DSAttention) from the spec."""
    torch.manual_seed(seed)
    layer = build_module(get_dsa_module_spec_for_backend(cfg), config=cfg, layer_number=1)
    perturb(layer)
    return layer


def dsa_gpt(cfg: MLATransformerConfig, seed: int = 3) -> GPTModel:
    """A GPTModel whose every layer is DSA."""
    torch.manual_seed(seed)
    model = GPTModel(cfg, get_transformer_block_with_experimental_attention_variant_spec(cfg), VOCAB, 32,
                     position_embedding_type="none")
    perturb(model)
    return model


def batch(seq: int = SEQ, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, position_ids, labels)`` of shape ``[BATCH, seq]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    return ids, torch.arange(seq).expand(BATCH, seq), labels


_COLUMN = ("linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
           "linear_kv_up_proj.weight", "word_embeddings.weight", "output_layer.weight")


def shard_tp(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s piece of the single-process DSA GPT parameter ``name``."""
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(tp)[rank], up.chunk(tp)[rank]), dim=0)
    if name.endswith(_COLUMN):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[rank]
    return full


def unshard_tp(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The whole parameter (or gradient) ``name`` from every TP rank's piece; replicated ones must agree."""
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(p.chunk(2, dim=0) for p in pieces))
        return torch.cat((*gates, *ups), dim=0)
    if name.endswith(_COLUMN):
        return torch.cat(pieces, dim=0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(pieces, dim=1)
    for piece in pieces[1:]:  # replicated (norms, the duplicated indexer): the same gradient on every rank
        torch.testing.assert_close(piece, pieces[0], **TOL)
    return pieces[0]


def reset_dsa_globals() -> None:
    """Forget the loss scale and the logged losses other tests may have left."""
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    DSAIndexerLossLoggingHelper.tracker.clear()
