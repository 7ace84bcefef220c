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
        moe_layers = len(range(0, layers, args.moe_layer_freq))
    positions = h * args.max_position_embeddings if args.position_embedding_type == "learned_absolute" else 0
    return (layers - moe_layers) * dense_layer + moe_layers * moe_layer + norm + vocab_size * h + positions


def flops_per_token(args: argparse.Namespace, vocab_size: int) -> float:
    """6 N + 12 L W T: training FLOPs per token (:func:`megatron_core.training_metrics.training_flops_per_token`)."""
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    return training_flops_per_token(non_embedding_parameters(args, vocab_size), args.num_layers,
                                    args.num_attention_heads * head_dim, args.seq_length)


def peak_flops() -> float | None:
    """The device's dense bf16 peak, or None where it is not known (CPUs)."""
    return device_peak_flops()
