"""DeepSeek sparse attention against Hugging Face's ``DeepseekV32Attention`` (fp32, CPU).

Our MLA layer built from ``get_dsa_module_spec_for_backend`` gets the HF layer's weights; with ``topk`` (4) well
below the sequence length (16) the outputs agree to 1e-5, and the indexer's top-k equals HF's wherever a query
sees more keys than ``topk``. HF skips the Hadamard rotation (it only rotates q and k together, leaving their
dot products unchanged), so ours runs with ``dsa_indexer_rotate_activation`` both on and off.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_dsa_module_spec_for_backend,
)
from megatron_core.transformer import MLATransformerConfig
from megatron_core.transformer.spec_utils import build_module

pytest.importorskip("transformers.models.deepseek_v32")
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config  # noqa: E402
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (  # noqa: E402
    DeepseekV32Attention,
    DeepseekV32RotaryEmbedding,
)

SEQ, BATCH, TOPK = 16, 2, 4
TOL = dict(rtol=1e-5, atol=1e-5)


def _hf() -> tuple[DeepseekV32Config, DeepseekV32Attention]:
    cfg = DeepseekV32Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
                            index_n_heads=8, index_head_dim=16, index_topk=TOPK, num_hidden_layers=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            vocab_size=64, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = DeepseekV32Attention(cfg, layer_idx=0)
    with torch.no_grad():
        for name, param in attn.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if "norm" not in name else 0.1) + ("norm" in name and
                        name.endswith("weight")))
    return cfg, attn.eval()


def _ours(rotate: bool) -> torch.nn.Module:
    cfg = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12,
                               qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6, rope_type="rope",
                               rotary_base=10000.0, normalization="RMSNorm", layernorm_epsilon=1e-6,
                               qk_layernorm=True, add_bias_linear=False, use_cpu_initialization=True,
                               attention_dropout=0.0, hidden_dropout=0.0, experimental_attention_variant="dsa",
                               dsa_indexer_n_heads=8, dsa_indexer_head_dim=16, dsa_indexer_topk=TOPK,
                               dsa_indexer_k_norm_epsilon=1e-5, dsa_indexer_rotate_activation=rotate)
    return build_module(get_dsa_module_spec_for_backend(cfg), config=cfg, layer_number=1).eval()


_NAMES = {"q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj",
          "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
          "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj", "indexer.wq_b": "core_attention.indexer.linear_wq_b",
          "indexer.wk": "core_attention.indexer.linear_wk", "indexer.k_norm": "core_attention.indexer.k_norm",
          "indexer.weights_proj": "core_attention.indexer.linear_weights_proj"}


def _copy_weights(hf: torch.nn.Module, ours: torch.nn.Module) -> None:
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, value in hf.named_parameters():
            module, leaf = name.rsplit(".", 1)
            params[f"{_NAMES[module]}.{leaf}"].copy_(value)


def _inputs(hf_cfg: DeepseekV32Config) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    x = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    cos_sin = DeepseekV32RotaryEmbedding(hf_cfg)(x, pos)
    mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1).expand(BATCH, 1, SEQ, SEQ)
    return x, cos_sin, mask


@pytest.mark.parametrize("rotate", [True, False], ids=["hadamard", "no_hadamard"])
def test_layer_and_topk_match_hf(rotate: bool):
    hf_cfg, hf = _hf()
    hf.indexer.k_norm.eps = 1e-5
    ours = _ours(rotate)
    _copy_weights(hf, ours)
    x, cos_sin, mask = _inputs(hf_cfg)
    with torch.no_grad():
        expected = hf(x, cos_sin, mask, position_ids=None)[0]
        out, _ = ours(x.transpose(0, 1).contiguous(), None)
        torch.testing.assert_close(out.transpose(0, 1), expected, **TOL)
        q_resid = hf.q_a_layernorm(hf.q_a_proj(x))
        hf_topk = hf.indexer(x, q_resid, cos_sin, mask[:, 0], None)
        causal = mask[0, 0]
        _, topk = ours.core_attention.indexer.forward_with_scores(
            x.transpose(0, 1).contiguous(), q_resid.transpose(0, 1).contiguous(), causal)
    rows = slice(TOPK - 1, SEQ)  # queries that see at least TOPK keys: the selection is fully determined
    assert torch.equal(topk[:, rows].sort(-1).values, hf_topk[:, rows].long().sort(-1).values)
    assert (topk[:, : TOPK - 1] >= 0).sum(-1).tolist() == [list(range(1, TOPK))] * BATCH


def test_sparsity_changes_the_output():
    hf_cfg, hf = _hf()
    hf.indexer.k_norm.eps = 1e-5
    ours = _ours(True)
    _copy_weights(hf, ours)
    x, _, _ = _inputs(hf_cfg)
    dense = _ours(True)
    dense.load_state_dict(ours.state_dict())
    dense.core_attention.index_topk = SEQ
    with torch.no_grad():
        sparse_out, _ = ours(x.transpose(0, 1).contiguous(), None)
        dense_out, _ = dense(x.transpose(0, 1).contiguous(), None)
    assert (sparse_out - dense_out).abs().max() > 1e-3
