"""Throughput and MFU of a GPT training step: the example's parameter count fed to
:mod:`megatron_core.training_metrics` (the one MFU formula and peak-FLOP/s table)."""

from __future__ import annotations

import argparse

from megatron_core.training_metrics import device_peak_flops, training_flops_per_token


def non_embedding_parameters(args: argparse.Namespace, vocab_size: int) -> int:
    """N in the MFU formula: every (active, for MoE) parameter except the input embedding (the output layer counts)."""
    h, layers = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    head_dim = args.kv_channels or h // heads
    groups = args.num_query_groups or heads
    ffn = args.ffn_hidden_size or 4 * h
    bias = 0 if args.disable_bias_linear else 1
    norm = 2 * h if args.normalization == "LayerNorm" else h
    if getattr(args, "multi_latent_attention", False):
        attention = _mla_parameters(args)
    else:
        attention = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
        attention += bias * (head_dim * (heads + 2 * groups) + h)
    glu = 2 if args.swiglu else 1

    def mlp_params(width: int) -> int:
        return h * width * glu + width * h + bias * (width * glu + h)

    dense_layer = attention + mlp_params(ffn) + 2 * norm
    num_experts = getattr(args, "num_experts", None)
    if not num_experts:
        moe_layers, moe_layer = 0, 0
    else:
        # Active parameters: the router, top-k routed experts and the shared expert (MFU over active params).
        shared = args.moe_shared_expert_intermediate_size
        active = args.moe_router_topk * mlp_params(args.moe_ffn_hidden_size or ffn) + h * num_experts
        active += mlp_params(shared) if shared else 0
        moe_layer = attention + active + 2 * norm
        freq = args.moe_layer_freq
        moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, layers, freq))
    positions = h * args.max_position_embeddings if args.position_embedding_type == "learned_absolute" else 0
    # Each MTP depth: the [embedding; hidden] projection, three norms and a copy of the last decoder layer.
    last_is_moe = bool(num_experts) and (args.moe_layer_freq[-1] == 1 if isinstance(args.moe_layer_freq, list)
                                         else (layers - 1) % args.moe_layer_freq == 0)
    mtp = (getattr(args, "mtp_num_layers", None) or 0) * (
        2 * h * h + 3 * norm + (moe_layer if last_is_moe else dense_layer))
    return (layers - moe_layers) * dense_layer + moe_layers * moe_layer + norm + vocab_size * h + positions + mtp


def _mla_parameters(args: argparse.Namespace) -> int:
    """One multi-latent attention block's weights (q and kv latents with their norms, up projections, output)."""
    h, heads = args.hidden_size, args.num_attention_heads
    qk, rope, v = args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim
    if args.q_lora_rank:
        q = h * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * heads * (qk + rope)
    else:
        q = h * heads * (qk + rope)
    kv = h * (args.kv_lora_rank + rope) + args.kv_lora_rank + args.kv_lora_rank * heads * (qk + v)
    return q + kv + heads * v * h


def flops_per_token(args: argparse.Namespace, vocab_size: int) -> float:
    """6 N + 12 L W T: training FLOPs per token (:func:`megatron_core.training_metrics.training_flops_per_token`)."""
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    return training_flops_per_token(non_embedding_parameters(args, vocab_size), args.num_layers,
                                    args.num_attention_heads * head_dim, args.seq_length)


def peak_flops() -> float | None:
    """The device's dense bf16 peak, or None where it is not known (CPUs)."""
    return device_peak_flops()
