"""DeepSeek sparse attention config fields (Megatron-Core 0.19's names and defaults), validation and refusals."""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_dsa_module_spec_for_backend,
    get_experimental_attention_variant_module_spec,
)
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
from megatron_core.transformer.experimental_attention_variant.dsa import DSAttention
from tests.transformer.experimental_attention_variant.dsa_common import BATCH, SEQ, dsa_config, dsa_layer

DEFAULTS = dict(dsa_indexer_n_heads=None, dsa_indexer_head_dim=None, dsa_indexer_topk=None, dsa_indexer_topk_freq=1,
                dsa_indexer_skip_topk_offset=0, dsa_indexer_loss_coeff=None, dsa_indexer_use_sparse_loss=False,
                dsa_kernel_backend="none", dsa_indexer_rope_interleaved=False, dsa_indexer_rotate_activation=True,
                dsa_indexer_scoring_relu=True, dsa_indexer_k_norm_epsilon=None, dsa_indexer_k_norm_fp32=False)


def test_fields_have_megatron_defaults():
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert {name: getattr(cfg, name) for name in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize("overrides,match", [
    (dict(dsa_kernel_backend="tilelang"), r"dsa_kernel_backend \('tilelang'\) is not supported"),
    (dict(dsa_kernel_backend="triton"), r"dsa_kernel_backend \('triton'\) must be one of"),
    (dict(add_bias_linear=True), r"requires add_bias_linear=False"),
    (dict(apply_rope_fusion=True), r"apply_rope_fusion=True is not supported"),
    (dict(dsa_indexer_n_heads=None), r"dsa_indexer_n_heads \(None\) must be a positive integer"),
    (dict(dsa_indexer_topk=0), r"dsa_indexer_topk \(0\) must be a positive integer"),
    (dict(dsa_indexer_head_dim=12), r"dsa_indexer_head_dim \(12\) must be a power of two"),
    (dict(dsa_indexer_head_dim=4, dsa_indexer_rotate_activation=False),
     r"dsa_indexer_head_dim \(4\) must be >= qk_pos_emb_head_dim \(8\)"),
    (dict(dsa_indexer_topk_freq=0), r"dsa_indexer_topk_freq \(0\) must be a positive integer"),
    (dict(dsa_indexer_skip_topk_offset=-1), r"dsa_indexer_skip_topk_offset \(-1\) must be a non-negative"),
    (dict(dsa_indexer_loss_coeff=-0.5), r"dsa_indexer_loss_coeff \(-0.5\) must be None or a number >= 0"),
    (dict(dsa_indexer_k_norm_epsilon=0.0), r"dsa_indexer_k_norm_epsilon \(0.0\) must be None or a positive"),
    (dict(context_parallel_size=2), r"cp_comm_type \(None\) must be 'all_gather'.*context_parallel_size \(2\)"),
    (dict(context_parallel_size=2, cp_comm_type="p2p"), r"cp_comm_type \('p2p'\) must be 'all_gather'"),
])
def test_bad_fields_raise_naming_them(overrides: dict, match: str):
    with pytest.raises(ValueError, match=match):
        dsa_config(**overrides)


def test_spec_is_absorbed_mla_with_dsa_core_attention():
    cfg = dsa_config()
    spec = get_experimental_attention_variant_module_spec(cfg)
    assert spec.module is AbsorbedMLASelfAttention and spec.submodules.core_attention.module is DSAttention
    assert spec.metainfo == {"fuse_input_layernorm": False}
    plain = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, add_bias_linear=False,
                              experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
                              dsa_indexer_topk=4)
    with pytest.raises(ValueError, match="needs multi_latent_attention=True"):
        get_dsa_module_spec_for_backend(plain)


def test_inference_and_bad_packed_inputs_are_refused():
    layer = dsa_layer(dsa_config()).eval()
    x = torch.randn(SEQ, BATCH, 32)
    with pytest.raises(NotImplementedError, match="inference_context"):
        layer(x, None, inference_context=object())
    cu = torch.tensor([0, 5, SEQ], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11)
    with pytest.raises(ValueError, match="micro-batch size 1, got 2"):
        layer.core_attention(torch.randn(SEQ, BATCH, 4, 20), torch.randn(SEQ, BATCH, 1, 20), None, None,
                             x=x, qr=torch.randn(SEQ, BATCH, 16), up_v_weight=torch.randn(4, 6, 12),
                             attn_mask_type=AttnMaskType.causal, packed_seq_params=packed)
    short = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must end at the packed token count \(16\)"):
        layer(x[:, :1], None, packed_seq_params=short)
