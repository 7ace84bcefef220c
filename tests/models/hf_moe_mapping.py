"""Map Hugging Face Mixtral / Qwen2-MoE weights onto GPTModel MoE keys (test helper, not library code).

transformers >= 5 stores a layer's experts fused: ``mlp.experts.gate_up_proj [E, 2 * ffn, h]``
(rows ``[gate; up]``, Megatron's SwiGLU fc1 layout) and ``mlp.experts.down_proj [E, h, ffn]``.
``grouped`` selects the ``TEGroupedMLP`` keys (``linear_fc1.weight<e>``) instead of
``SequentialMLP``'s (``local_experts.<e>.linear_fc1.weight``).
"""

from __future__ import annotations

import torch

from tests.models.hf_weight_mapping import fuse_qkv


def expert_key(layer: str, expert: int, fc: str, grouped: bool) -> str:
    """The state-dict key of expert ``expert``'s ``fc`` weight in layer prefix ``layer``."""
    if grouped:
        return f"{layer}mlp.experts.{fc}.weight{expert}"
    return f"{layer}mlp.experts.local_experts.{expert}.{fc}.weight"


def moe_to_mcore(hf: dict[str, torch.Tensor], num_layers: int, num_heads: int, num_groups: int,
                 num_experts: int, grouped: bool = False) -> dict:
    """Mixtral or Qwen2-MoE (with shared expert, gate and QKV biases) -> GPTModel keys."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], num_heads, num_groups)
        if attn + "q_proj.bias" in hf:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], num_heads, num_groups)
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
        for e in range(num_experts):
            out[expert_key(dst, e, "linear_fc1", grouped)] = hf[src + "mlp.experts.gate_up_proj"][e]
            out[expert_key(dst, e, "linear_fc2", grouped)] = hf[src + "mlp.experts.down_proj"][e]
        shared = src + "mlp.shared_expert."
        if shared + "gate_proj.weight" in hf:
            out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                (hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]), dim=0)
            out[dst + "mlp.shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
            out[dst + "mlp.shared_experts.gate_weight"] = hf[src + "mlp.shared_expert_gate.weight"]
    return out


def load_state(model: torch.nn.Module, mapped: dict[str, torch.Tensor]) -> None:
    """Load ``mapped`` with ``load_state_dict`` (strict on every tensor; ``_extra_state`` entries are ignored)."""
    result = model.load_state_dict(mapped, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
