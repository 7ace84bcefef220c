"""Map Hugging Face Llama / GPT-2 weights onto GPTModel state-dict keys (test helper, not library code).

The fused ``linear_qkv`` weight is grouped per query group: for each KV group, its query heads'
rows, then that group's key rows, then its value rows.
"""

from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """``[nh*hd, ...]``, ``[ng*hd, ...]`` x2 -> Megatron's per-group ``[ng*(nh/ng+2)*hd, ...]``."""
    tail = q.shape[1:]
    q = q.reshape(num_groups, -1, *tail)
    k = k.reshape(num_groups, -1, *tail)
    v = v.reshape(num_groups, -1, *tail)
    return torch.cat((q, k, v), dim=1).reshape(-1, *tail)


def llama_to_mcore(hf: dict[str, torch.Tensor], num_layers: int, num_heads: int, num_groups: int) -> dict:
    """Llama (untied, no biases, SwiGLU) -> GPTModel keys."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[src + "self_attn.q_proj.weight"], hf[src + "self_attn.k_proj.weight"],
            hf[src + "self_attn.v_proj.weight"], num_heads, num_groups,
        )
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            (hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]), dim=0
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    return out


def gpt2_to_mcore(hf: dict[str, torch.Tensor], num_layers: int, num_heads: int) -> dict:
    """GPT-2 (Conv1D weights stored ``[in, out]``, tied, biases) -> GPTModel keys."""
    out = {
        "embedding.word_embeddings.weight": hf["transformer.wte.weight"],
        "embedding.position_embeddings.weight": hf["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": hf["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": hf["transformer.ln_f.bias"],
    }
    for i in range(num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[dst + ours + ".weight"] = hf[src + theirs + ".weight"]
            out[dst + ours + ".bias"] = hf[src + theirs + ".bias"]
        qkv_w = hf[src + "attn.c_attn.weight"].t()
        qkv_b = hf[src + "attn.c_attn.bias"]
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv_w.chunk(3, dim=0), num_heads, num_heads)
        out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(*qkv_b.chunk(3, dim=0), num_heads, num_heads)
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "attn.c_proj.weight"].t()
        out[dst + "self_attention.linear_proj.bias"] = hf[src + "attn.c_proj.bias"]
        out[dst + "mlp.linear_fc1.weight"] = hf[src + "mlp.c_fc.weight"].t()
        out[dst + "mlp.linear_fc1.bias"] = hf[src + "mlp.c_fc.bias"]
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.c_proj.weight"].t()
        out[dst + "mlp.linear_fc2.bias"] = hf[src + "mlp.c_proj.bias"]
    return out


def load_into(model: torch.nn.Module, mapped: dict[str, torch.Tensor]) -> None:
    """Copy ``mapped`` into ``model``; every parameter must be covered and every key used."""
    params = dict(model.named_parameters())
    assert set(params) == set(mapped), (sorted(set(params) ^ set(mapped)))
    with torch.no_grad():
        for name, value in mapped.items():
            assert params[name].shape == value.shape, (name, params[name].shape, value.shape)
            params[name].copy_(value)
