"""The TensorRT-LLM weights of a tiny GPT, written out by hand from Megatron-Core 0.19's export rules.

Independent of the converters' code: everything is done on Megatron's ``[out, in]`` weights with views and
slices. TensorRT-LLM weights are ``[out, in]``; a rank's QKV is all its query heads, then its key heads, then
its value heads (Megatron interleaves them per query group); fewer query groups than ranks repeat each
key/value head; column-parallel weights split along ``out``, row-parallel ones along ``in``; a gated fc1's
first half is ``mlp.fc``, its second ``mlp.gate``; with a parallel embedding the vocabulary tables are
zero-padded to a multiple of the TP size and split by rows, the lm head is always split by rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Shape:
    """What the reference needs to know about the model."""

    num_layers: int
    num_heads: int
    num_groups: int
    gated: bool
    layernorm1p: bool = False


def _qkv(full: torch.Tensor, shape: Shape, tp: int, rank: int) -> torch.Tensor:
    """This rank's ``[q; k; v]`` rows of Megatron's grouped QKV weight ``[groups*(qpg+2)*hn, ...]`` (or bias)."""
    qpg = shape.num_heads // shape.num_groups
    grouped = full.reshape(shape.num_groups, qpg + 2, -1, *full.shape[1:])  # [g, qpg+2, hn, (h)]
    q = grouped[:, :qpg].flatten(0, 2)
    k, v = grouped[:, qpg], grouped[:, qpg + 1]  # [g, hn, (h)]
    if shape.num_groups < tp:
        k = k.repeat_interleave(tp // shape.num_groups, dim=0)
        v = v.repeat_interleave(tp // shape.num_groups, dim=0)
    k, v = k.flatten(0, 1), v.flatten(0, 1)
    return torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]], dim=0)


def expected_rank_weights(sd: dict, shape: Shape, tp: int, rank: int, parallel_embedding: bool,
                          layers: range | None = None, first_stage: bool = True, last_stage: bool = True) -> dict:
    """TensorRT-LLM weights of inference rank ``(tp rank, pipeline stage owning ``layers``)`` from the TP=1
    Megatron state dict ``sd`` (fp32)."""
    layers = layers if layers is not None else range(shape.num_layers)
    plus = 1.0 if shape.layernorm1p else 0.0
    out = {}
    for local, i in enumerate(layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.layers.{local}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"] + plus
        out[dst + "post_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"] + plus
        out[dst + "attention.qkv.weight"] = _qkv(sd[src + "self_attention.linear_qkv.weight"], shape, tp, rank)
        out[dst + "attention.dense.weight"] = sd[src + "self_attention.linear_proj.weight"].chunk(tp, dim=1)[rank]
        out[dst + "mlp.proj.weight"] = sd[src + "mlp.linear_fc2.weight"].chunk(tp, dim=1)[rank]
        for kind in ("weight", "bias"):
            fc1 = sd.get(src + f"mlp.linear_fc1.{kind}")
            if fc1 is None:
                continue
            if shape.gated:
                first, second = fc1.chunk(2, dim=0)
                out[dst + f"mlp.fc.{kind}"] = first.chunk(tp, dim=0)[rank]
                out[dst + f"mlp.gate.{kind}"] = second.chunk(tp, dim=0)[rank]
            else:
                out[dst + f"mlp.fc.{kind}"] = fc1.chunk(tp, dim=0)[rank]
        if src + "input_layernorm.bias" in sd:
            out[dst + "input_layernorm.bias"] = sd[src + "input_layernorm.bias"]
            out[dst + "post_layernorm.bias"] = sd[src + "pre_mlp_layernorm.bias"]
        if src + "self_attention.linear_qkv.bias" in sd:
            out[dst + "attention.qkv.bias"] = _qkv(sd[src + "self_attention.linear_qkv.bias"], shape, tp, rank)
            out[dst + "attention.dense.bias"] = sd[src + "self_attention.linear_proj.bias"]
            out[dst + "mlp.proj.bias"] = sd[src + "mlp.linear_fc2.bias"]
    if first_stage:
        for src, dst in (("embedding.word_embeddings.weight", "transformer.vocab_embedding.weight"),
                         ("embedding.position_embeddings.weight", "transformer.position_embedding.weight")):
            if src not in sd:
                continue
            table = sd[src]
            if parallel_embedding:
                if dst == "transformer.vocab_embedding.weight" and table.shape[0] % tp:
                    padding = torch.zeros(tp - table.shape[0] % tp, table.shape[1])
                    table = torch.cat([table, padding])
                table = table.chunk(tp)[rank]
            out[dst] = table
    if last_stage:
        if "output_layer.weight" in sd:
            out["lm_head.weight"] = sd["output_layer.weight"].chunk(tp)[rank]
        out["transformer.ln_f.weight"] = sd["decoder.final_layernorm.weight"] + plus
        if "decoder.final_layernorm.bias" in sd:
            out["transformer.ln_f.bias"] = sd["decoder.final_layernorm.bias"]
    return out


def assert_weights_equal(actual: dict, expected: dict) -> None:
    """Same names, shapes and values (bitwise: conversion only moves and casts)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert actual[name].shape == value.shape, (name, actual[name].shape, value.shape)
        assert torch.equal(actual[name], value), name
