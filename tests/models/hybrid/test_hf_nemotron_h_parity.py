"""HybridModel ("M*M-": Mamba, GQA attention without RoPE, squared-ReLU MLP) against Hugging Face
``NemotronHForCausalLM`` (torch path, fp32 CPU) on the same random weights: logits within 1e-4."""

from __future__ import annotations

import pytest
import torch

from megatron_core.activations import squared_relu
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer import TransformerConfig

transformers = pytest.importorskip("transformers")

PATTERN, VOCAB = "M*M-", 64
HEADS, GROUPS, HEAD_DIM = 4, 2, 4  # attention: 4 query heads in 2 KV groups of width 4


def _hf_model(chunk_size: int):
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=len(PATTERN), hybrid_override_pattern=PATTERN,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM, intermediate_size=32,
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=chunk_size,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, use_mamba_kernels=False,
    )
    assert cfg.layers_block_type == ["linear_attention", "full_attention", "linear_attention", "mlp"]
    assert (cfg.mlp_hidden_act, cfg.attention_bias, cfg.mlp_bias, cfg.use_bias) == ("relu2", False, False, False)
    return transformers.NemotronHForCausalLM(cfg).eval()


def _megatron_model(chunk_size: int) -> HybridModel:
    config = TransformerConfig(
        num_layers=len(PATTERN), hidden_size=16, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=32, activation_func=squared_relu, gated_linear_unit=False,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, mamba_state_dim=8, mamba_head_dim=8,
        mamba_num_groups=2, mamba_num_heads=4,
    )
    model = HybridModel(config, hybrid_stack_spec, VOCAB, 32, hybrid_layer_pattern=PATTERN,
                        position_embedding_type="none").eval()
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            layer.mixer.chunk_size = chunk_size
    return model


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's ``linear_qkv`` rows: per KV group, its query heads, then its key, then its value."""
    hidden = q.shape[1]
    q = q.view(GROUPS, HEADS // GROUPS * HEAD_DIM, hidden)
    return torch.cat([q, k.view(GROUPS, HEAD_DIM, hidden), v.view(GROUPS, HEAD_DIM, hidden)], dim=1).reshape(-1, hidden)


def _hf_to_megatron(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"embedding.word_embeddings.weight": hf_state["model.embeddings.weight"],
           "decoder.final_norm.weight": hf_state["model.norm_f.weight"],
           "output_layer.weight": hf_state["lm_head.weight"]}
    for i, symbol in enumerate(PATTERN):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        if symbol == "M":
            out[ours + "norm.weight"] = hf_state[hf + "norm.weight"]
            for name in ("dt_bias", "A_log", "D", "in_proj.weight", "norm.weight", "out_proj.weight"):
                out[ours + "mixer." + name] = hf_state[hf + "mixer." + name]
            out[ours + "mixer.conv1d_weight"] = hf_state[hf + "mixer.conv1d.weight"]
            out[ours + "mixer.conv1d_bias"] = hf_state[hf + "mixer.conv1d.bias"]
        elif symbol == "*":
            out[ours + "input_layernorm.weight"] = hf_state[hf + "norm.weight"]
            out[ours + "self_attention.linear_qkv.weight"] = _fused_qkv(
                *(hf_state[hf + f"mixer.{p}_proj.weight"] for p in "qkv"))
            out[ours + "self_attention.linear_proj.weight"] = hf_state[hf + "mixer.o_proj.weight"]
        else:
            out[ours + "pre_mlp_layernorm.weight"] = hf_state[hf + "norm.weight"]
            out[ours + "mlp.linear_fc1.weight"] = hf_state[hf + "mixer.up_proj.weight"]
            out[ours + "mlp.linear_fc2.weight"] = hf_state[hf + "mixer.down_proj.weight"]
    return out


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_logits_match_hf_nemotron_h(chunk_size):
    torch.manual_seed(0)
    hf = _hf_model(chunk_size)
    with torch.no_grad():  # random (not initial) values for every parameter
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
        for i, symbol in enumerate(PATTERN):
            if symbol == "M":
                hf.model.layers[i].mixer.A_log.uniform_(-1.0, 1.0)
    model = _megatron_model(chunk_size)
    mapped = _hf_to_megatron({k: v.detach() for k, v in hf.named_parameters()})
    ours = dict(model.named_parameters())
    assert set(mapped) == set(ours)
    with torch.no_grad():
        for name, value in mapped.items():
            assert ours[name].shape == value.shape, name
            ours[name].copy_(value)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 11), generator=gen)
    pos = torch.arange(11).unsqueeze(0).expand(2, 11)
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids, pos, None)
    assert want.abs().max() > 1.0  # the layers do real work at this scale
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
