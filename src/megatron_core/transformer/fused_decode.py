"""A transformer layer's decode step for a single token as four fused GEMVs (CUDA, batch 1).

At one token per step a layer is a chain of GEMVs, each bound by the bytes of its weight, with
elementwise kernels between them whose launches cost as much as they compute. When the layer is the
plain pre-norm GPT layer (RMSNorm, self-attention, a gated SiLU MLP, no tensor parallelism) the step
runs as

1. ``qkv = rmsnorm(h) @ W_qkv^T`` (the input norm folded into the GEMV),
2. rotary embedding, KV-cache write and paged attention (the inference context; the dynamic context
   rotates and writes the cache in one kernel, reading the fused projection in place),
3. ``h = h + attn @ W_proj^T`` (the residual folded in),
4. ``a = swiglu(rmsnorm(h) @ W_fc1^T)`` (the pre-MLP norm and the activation folded in),
5. ``h = h + a @ W_fc2^T``,

with :func:`~megatron_core.tensor_parallel.fused_gemv.fused_gemv`, which is the same arithmetic as the unfused
layer up to bf16 rounding. :func:`fused_decode_applies` holds the rule for when this path is taken; any
other layer, input or state takes the layer's normal forward. Set :data:`enabled` to ``False`` to turn
the path off (for comparisons).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._ground import get_pg_size
from megatron_core.fusions.norms import RMSNorm
from megatron_core.tensor_parallel.fused_gemv import fused_gemv, fused_gemv_supported
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.attention import SelfAttention
from megatron_core.transformer.mlp import MLP
from megatron_core.transformer.rope_options import layer_skips_rope

__all__ = ["enabled", "fused_decode_applies", "fused_decode_forward"]

enabled = True


def _plain_rmsnorm(norm: Any) -> bool:
    return type(norm) is RMSNorm and not norm.zero_centered_gamma


def _plain_linear(linear: Any, kind: type) -> bool:
    return (type(linear) is kind and get_pg_size(linear.tp_group) == 1 and linear.weight is not None
            and linear.weight.is_contiguous() and getattr(linear, "output_dtype", None) is None)


def fused_decode_applies(layer: Any, hidden_states: torch.Tensor) -> bool:
    """Whether ``layer`` runs its step on ``hidden_states`` (one token) by :func:`fused_decode_forward`."""
    if not enabled or layer.training or hidden_states.numel() != hidden_states.shape[-1]:
        return False
    config = layer.config
    attention, mlp = layer.self_attention, layer.mlp
    if (config.fp32_residual_connection or config.apply_residual_connection_post_layernorm
            or config.attention_output_gate
            or layer.has_cross_attention or not _plain_rmsnorm(layer.input_layernorm)
            or not _plain_rmsnorm(layer.pre_mlp_layernorm)):
        return False
    if not (type(attention) is SelfAttention and _plain_linear(attention.linear_qkv, ColumnParallelLinear)
            and _plain_linear(attention.linear_proj, RowParallelLinear)):
        return False
    if not (type(mlp) is MLP and mlp.gated and mlp.activation_func is F.silu
            and _plain_linear(mlp.linear_fc1, ColumnParallelLinear) and _plain_linear(mlp.linear_fc2, RowParallelLinear)):
        return False
    return all(fused_gemv_supported(hidden_states, linear.weight)
               for linear in (attention.linear_qkv, mlp.linear_fc1))


def fused_decode_forward(layer: Any, hidden_states: torch.Tensor, inference_context: Any,
                         rotary_pos_emb: Any) -> torch.Tensor:
    """The layer's output for one token ``hidden_states [1, 1, h]`` (check :func:`fused_decode_applies`)."""
    attention, mlp = layer.self_attention, layer.mlp
    qkv_linear = attention.linear_qkv
    mixed_qkv = fused_gemv(hidden_states, qkv_linear.weight, None if qkv_linear.skip_bias_add else qkv_linear.bias,
                           norm_weight=layer.input_layernorm.weight, norm_eps=layer.input_layernorm.eps)
    if layer_skips_rope(layer.config, attention.layer_number):
        rotary_pos_emb = None  # a layer without RoPE (no_rope_freq)
    context = inference_context.attention_from_qkv(attention, mixed_qkv, rotary_pos_emb)
    # The projection's and the MLP's biases are added either by the linear or by bias-dropout-add: here, by the GEMV.
    hidden_states = fused_gemv(context, attention.linear_proj.weight, attention.linear_proj.bias,
                               residual=hidden_states)
    intermediate = fused_gemv(hidden_states, mlp.linear_fc1.weight, mlp.linear_fc1.bias,
                              norm_weight=layer.pre_mlp_layernorm.weight, norm_eps=layer.pre_mlp_layernorm.eps,
                              gated_silu=True)
    return fused_gemv(intermediate, mlp.linear_fc2.weight, mlp.linear_fc2.bias, residual=hidden_states)
