"""``attention_output_gate``: ``linear_qkv`` also yields a per-head gate and the attention output is multiplied by
``sigmoid(gate)`` before ``linear_proj`` (Megatron-Core 0.19's layout: per query group ``[query heads | their gates |
key | value]``).

Checked against Hugging Face's ``Qwen3NextAttention`` on the same weights (zero-centred q/k norms, partial RoPE),
under TP=2 with and without sequence parallelism against one process (logits, loss, every gradient at 1e-5), and
through a distributed checkpoint saved at TP=2 and loaded at TP=1 (and back) bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_core.models.gpt import get_gpt_layer_local_spec
from megatron_core.transformer import MLATransformerConfig, TransformerConfig
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.spec_utils import build_module
from tests.dist_harness import run_on_ranks
from tests.transformer import attention_output_gate_checks as checks

H, HEADS, GROUPS, HD, SEQ, BATCH = 32, 4, 2, 8, 6, 2


def _gated_attention(**overrides):
    cfg = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HD,
               normalization="RMSNorm", layernorm_epsilon=1e-6, layernorm_zero_centered_gamma=True,
               qk_layernorm=True, attention_output_gate=True, add_bias_linear=False, hidden_dropout=0.0,
               attention_dropout=0.0, use_cpu_initialization=True)
    cfg.update(overrides)
    spec = get_gpt_layer_local_spec(qk_layernorm=True).submodules.self_attention
    spec.params = {"attn_mask_type": AttnMaskType.causal}
    return build_module(spec, config=TransformerConfig(**cfg), layer_number=1)


def _fused_qkv_from_hf(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Our ``linear_qkv.weight`` from HF's ``q_proj`` (per head ``[query; gate]``), ``k_proj`` and ``v_proj``."""
    per_group = HEADS // GROUPS
    q_gate = q_gate.reshape(GROUPS, per_group, 2, HD, H)
    query, gate = q_gate[:, :, 0].reshape(GROUPS, -1, H), q_gate[:, :, 1].reshape(GROUPS, -1, H)
    return torch.cat((query, gate, k.reshape(GROUPS, HD, H), v.reshape(GROUPS, HD, H)), dim=1).reshape(-1, H)


def test_gated_attention_matches_hugging_face_qwen3_next() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    hf_cfg = transformers.Qwen3NextConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                                          head_dim=HD, rms_norm_eps=1e-6, num_hidden_layers=1,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                           "partial_rotary_factor": 0.5})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = qn.Qwen3NextAttention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.3)
    ours = _gated_attention().eval()
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(_fused_qkv_from_hf(hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight))
        ours.linear_proj.weight.copy_(hf.o_proj.weight)
        ours.q_layernorm.weight.copy_(hf.q_norm.weight)  # both zero-centred: (1 + w)
        ours.k_layernorm.weight.copy_(hf.k_norm.weight)
    x = torch.randn(BATCH, SEQ, H)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    cos_sin = qn.Qwen3NextRotaryEmbedding(hf_cfg)(x, positions)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1).expand(BATCH, 1, SEQ, SEQ)
    rotary = RotaryEmbedding(HD, rotary_percent=0.5, rotary_base=1000)(SEQ)
    with torch.no_grad():
        want, _ = hf(x, cos_sin, mask)
        got, bias = ours(x.transpose(0, 1).contiguous(), None, rotary_pos_emb=rotary)
    assert bias is None
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=1e-5, atol=1e-5)
    # the gate comes per query head, like the query
    query, key, value, gate = ours.get_query_key_value_tensors(x.transpose(0, 1), output_gate=True)
    assert gate.shape == query.shape == (SEQ, BATCH, HEADS, HD)


def test_gate_channels_and_refusals() -> None:
    attention = _gated_attention()
    assert attention.linear_qkv.weight.shape == (2 * HEADS * HD + 2 * GROUPS * HD, H)
    with pytest.raises(ValueError, match=r"attention_output_gate=True .* fused_single_qkv_rope"):
        _gated_attention(fused_single_qkv_rope=True)
    with pytest.raises(ValueError, match=r"attention_output_gate \('yes'\) must be a bool"):
        _gated_attention(attention_output_gate="yes")
    with pytest.raises(ValueError, match=r"attention_output_gate=True .* multi_latent_attention"):
        MLATransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, attention_output_gate=True,
                             q_lora_rank=8, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    plain = _gated_attention(attention_output_gate=False)
    with pytest.raises(ValueError, match="output_gate=True needs a layer built with attention_output_gate"):
        plain.get_query_key_value_tensors(torch.randn(SEQ, BATCH, H), output_gate=True)


def test_gated_attention_tensor_parallel_and_checkpoint_resharding(tmp_path) -> None:
    for per_case in run_on_ranks(checks.TP, checks.all_checks, str(tmp_path)):
        assert len(per_case) == 2
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in per_case[0]
