"""Hugging Face Qwen3-Next <-> megatron_core weight mapping for the gated delta net (test oracle helpers).

Hugging Face stores ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head (``[q_g, k_g, v_g, z_g]`` and
``[b_g, a_g]`` for each key head ``g``); Megatron-Core's ``in_proj`` stacks whole sections
``q | k | v | z | beta | alpha``. The convolution, ``A_log``, ``dt_bias`` and the projections map one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.transformer import TransformerConfig

SIZES = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4)


def hf_config(num_layers: int = 1, **overrides):
    """A tiny Qwen3-Next config whose layers are all gated delta nets with dense MLPs."""
    from transformers import Qwen3NextConfig

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, hidden_act="silu",
               layer_types=["linear_attention"] * num_layers, mlp_only_layers=list(range(num_layers)),
               num_experts=0, tie_word_embeddings=False, **SIZES)
    cfg.update(overrides)
    return Qwen3NextConfig(**cfg)


def megatron_config(num_layers: int = 1, **overrides) -> TransformerConfig:
    """The matching megatron_core config (RMSNorm, SwiGLU MLP, no bias, fp32, no dropout)."""
    cfg = dict(num_layers=num_layers, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
               normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False, gated_linear_unit=True,
               activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
               **SIZES)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def in_proj_from_hf(qkvz: torch.Tensor, ba: torch.Tensor, key_heads: int, key_dim: int, value_dim: int
                    ) -> torch.Tensor:
    """Megatron's ``in_proj.weight`` ``[q|k|v|z|beta|alpha, h]`` from HF's per-key-head grouped weights."""
    hidden = qkvz.shape[-1]
    group = qkvz.reshape(key_heads, -1, hidden)
    per_group_v = (group.shape[1] - 2 * key_dim) // 2
    q, k, v, z = group.split([key_dim, key_dim, per_group_v, per_group_v], dim=1)
    b, a = ba.reshape(key_heads, -1, hidden).chunk(2, dim=1)
    assert per_group_v % value_dim == 0
    return torch.cat([x.reshape(-1, hidden) for x in (q, k, v, z, b, a)], dim=0)


def gdn_state_from_hf(hf: dict, prefix: str, key_heads: int, key_dim: int, value_dim: int,
                      norm_offset: float = 0.0) -> dict:
    """Our ``GatedDeltaNet`` parameters (unprefixed names) from HF's ``<prefix>linear_attn.*`` tensors;
    ``norm_offset`` is subtracted from the output norm's weight (1 for zero-centred norms)."""
    p = f"{prefix}linear_attn."
    return {
        "in_proj.weight": in_proj_from_hf(hf[p + "in_proj_qkvz.weight"], hf[p + "in_proj_ba.weight"], key_heads,
                                          key_dim, value_dim),
        "conv1d.weight": hf[p + "conv1d.weight"],
        "A_log": hf[p + "A_log"],
        "dt_bias": hf[p + "dt_bias"],
        "out_norm.weight": hf[p + "norm.weight"] - norm_offset,
        "out_proj.weight": hf[p + "out_proj.weight"],
    }
