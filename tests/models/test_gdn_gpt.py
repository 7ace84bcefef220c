"""GPT decoders with gated delta net layers (``experimental_attention_variant="gated_delta_net"``).

A tiny GPT model whose layers are all gated delta nets matches Hugging Face's ``Qwen3NextForCausalLM`` (all layers
``linear_attention``, dense MLPs, zero-centred RMSNorms) on identical weights: logits and loss. Mixed patterns with
Qwen3-Next's gated softmax attention are compared through the HF bridge (``tests/models/hf/
test_qwen3_moe_next_bridge.py``). The pattern helpers and the per-layer specs are checked here too.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_dsa_module_spec_for_backend,
    get_linear_attention_pattern,
    get_transformer_block_with_experimental_attention_variant_spec,
    get_transformer_layer_with_experimental_attention_variant_spec,
    is_linear_attention_variant,
)
from megatron_core.ssm.gated_delta_net import GatedDeltaNet
from megatron_core.transformer.attention import SelfAttention
from tests.ssm.gdn_hf import SIZES, gdn_state_from_hf, hf_config, megatron_config

LAYERS, SEQ, VOCAB = 2, 10, 64


def _gpt_config(**overrides):
    cfg = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[1] * LAYERS,
               layernorm_zero_centered_gamma=True)
    cfg.update(overrides)
    return megatron_config(num_layers=LAYERS, **cfg)


def _state_from_hf(hf: dict) -> dict:
    """Our GPT parameters from Qwen3-Next's (zero-centred norms keep their values; the gated norm is not
    zero-centred in HF, so it loses 1)."""
    state = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
             "decoder.final_layernorm.weight": hf["model.norm.weight"], "output_layer.weight": hf["lm_head.weight"]}
    for i in range(LAYERS):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        state[ours + "input_layernorm.weight"] = hf[theirs + "input_layernorm.weight"]
        state[ours + "pre_mlp_layernorm.weight"] = hf[theirs + "post_attention_layernorm.weight"]
        state[ours + "mlp.linear_fc1.weight"] = torch.cat([hf[theirs + "mlp.gate_proj.weight"],
                                                           hf[theirs + "mlp.up_proj.weight"]])
        state[ours + "mlp.linear_fc2.weight"] = hf[theirs + "mlp.down_proj.weight"]
        gdn = gdn_state_from_hf(hf, theirs, SIZES["linear_num_key_heads"], SIZES["linear_key_head_dim"],
                                SIZES["linear_value_head_dim"], norm_offset=1.0)
        state.update({ours + "self_attention." + k: v for k, v in gdn.items()})
    return state


def test_all_gated_delta_net_gpt_matches_hugging_face_qwen3_next() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(hf_config(LAYERS)).eval()
    with torch.no_grad():  # HF initialises the zero-centred norms to 0 and the gated norm to 1: move them
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.uniform_(-0.3, 0.3).add_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
    config = _gpt_config()
    model = GPTModel(config, get_transformer_block_with_experimental_attention_variant_spec(config), VOCAB, SEQ,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    state = _state_from_hf(hf.state_dict())
    assert set(state) == {n for n, _ in model.named_parameters()}
    model.load_state_dict(state, strict=False)
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen), torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
        got = model(ids, torch.arange(SEQ).expand(2, SEQ), None)
        loss = model(ids, torch.arange(SEQ).expand(2, SEQ), None, labels=labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), want_loss, rtol=1e-5, atol=1e-5)


def test_linear_attention_pattern_and_layer_specs() -> None:
    config = megatron_config(num_layers=8, experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                             num_moe_experts=2, moe_layer_freq=2, moe_ffn_hidden_size=16)
    assert get_linear_attention_pattern(config) == [1, 1, 1, 0, 1, 1, 1, 0]
    assert is_linear_attention_variant("gated_delta_net") and not is_linear_attention_variant(None)
    specs = get_transformer_layer_with_experimental_attention_variant_spec(config)
    kinds = [spec.submodules.self_attention.module for spec in specs]
    assert kinds == [GatedDeltaNet] * 3 + [SelfAttention] + [GatedDeltaNet] * 3 + [SelfAttention]
    # Separate local norms are stored under Transformer Engine's fused names; MoE layers keep their own.
    assert specs[0].submodules.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.in_proj.layer_norm_"}
    assert specs[3].submodules.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    block = get_transformer_block_with_experimental_attention_variant_spec(config)
    assert len(block.layer_specs) == 8
    model = GPTModel(config, block, VOCAB, SEQ, position_embedding_type="rope")
    ids = torch.randint(0, VOCAB, (1, SEQ))
    model(ids, torch.arange(SEQ)[None], None, labels=ids).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_checkpoint_keys_use_fused_norm_names() -> None:
    config = _gpt_config()
    model = GPTModel(config, get_transformer_block_with_experimental_attention_variant_spec(config), VOCAB, SEQ)
    keys = {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys


def test_dsa_needs_mla_and_indexer_sizes() -> None:
    with pytest.raises(ValueError, match=r"multi_latent_attention"):
        get_dsa_module_spec_for_backend(megatron_config())
    with pytest.raises(ValueError, match=r"dsa_indexer_n_heads \(None\) must be a positive integer"):
        megatron_config(experimental_attention_variant="dsa")
