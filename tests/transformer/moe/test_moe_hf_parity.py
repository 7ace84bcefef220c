"""Logits parity of MoE GPTModels with Hugging Face Mixtral and Qwen2-MoE on random weights (fp32, CPU).

Mixtral: top-2 of 4 experts, softmax over the chosen logits. Qwen2-MoE: softmax over all experts
before the top-k (``moe_router_pre_softmax``, no renormalisation) plus a shared expert with a
sigmoid gate and QKV biases. Both expert layouts (``SequentialMLP`` and grouped) are checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.models.hf_moe_mapping import load_state, moe_to_mcore

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, LAYERS, EXPERTS = 96, 12, 2, 2, 4


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


def _perturb(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=LAYERS, hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=80,
                normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                num_moe_experts=EXPERTS, moe_router_topk=2)
    return TransformerConfig(**{**base, **overrides})


def _compare(hf: torch.nn.Module, cfg: TransformerConfig, grouped: bool) -> None:
    hf.config._attn_implementation = "eager"
    _perturb(hf)
    model = GPTModel(cfg, get_gpt_layer_local_spec(EXPERTS, moe_grouped_gemm=grouped), VOCAB, 64,
                     position_embedding_type="rope", rotary_base=5000).eval()
    load_state(model, moe_to_mcore(hf.state_dict(), LAYERS, 6, 2, EXPERTS, grouped))
    ids, pos = _ids()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids, pos, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_mixtral_logits_match(grouped: bool):
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=LAYERS, num_attention_heads=6,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False)).eval()
    _compare(hf, _config(moe_ffn_hidden_size=40), grouped)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_qwen2_moe_logits_match(grouped: bool):
    torch.manual_seed(0)
    hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
        shared_expert_intermediate_size=56, num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=2,
        num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False, decoder_sparse_step=1,
        mlp_only_layers=[])).eval()
    cfg = _config(moe_ffn_hidden_size=24, moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=56,
                  moe_shared_expert_gate=True, add_qkv_bias=True)
    _compare(hf, cfg, grouped)
