"""Logits parity with Hugging Face transformers on random weights mapped into GPTModel (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.models.hf_weight_mapping import gpt2_to_mcore, llama_to_mcore, load_into

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 96, 12, 2


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``gelu_new``."""
    return F.gelu(x, approximate="tanh")


def _ids():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


def _perturb(model: torch.nn.Module) -> None:
    """Random offsets on every parameter, so zero-initialised biases and unit norm weights are exercised too."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))


def test_llama_logits_match():
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=5000.0,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    _perturb(hf)
    hf.config._attn_implementation = "eager"
    cfg = TransformerConfig(
        num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=80,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, 64, position_embedding_type="rope", rotary_base=5000).eval()
    load_into(model, llama_to_mcore(hf.state_dict(), 2, 6, 2))
    ids, pos = _ids()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids, pos, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        loss = model(ids, pos, None, labels=labels)
    ref = F.cross_entropy(expected.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(BATCH, SEQ)
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)


def test_gpt2_logits_match():
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    _perturb(hf)
    hf.config._attn_implementation = "eager"
    cfg = TransformerConfig(
        num_layers=2, hidden_size=48, num_attention_heads=4, activation_func=gelu_tanh, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, 32, share_embeddings_and_output_weights=True).eval()
    load_into(model, gpt2_to_mcore(hf.state_dict(), 2, 4))
    ids, pos = _ids()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids, pos, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_mistral_sliding_window_logits_match():
    """Mistral's sliding window W (a key is seen while ``q - k < W``) is Megatron's ``window_size=(W - 1, 0)``."""
    torch.manual_seed(0)
    window = 4
    hf_cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=5000.0,
        sliding_window=window, tie_word_embeddings=False, head_dim=8,
    )
    hf = transformers.MistralForCausalLM(hf_cfg).eval()
    _perturb(hf)
    hf.config._attn_implementation = "eager"
    cfg = TransformerConfig(
        num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=80,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        window_size=(window - 1, 0),
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, 64, position_embedding_type="rope", rotary_base=5000).eval()
    load_into(model, llama_to_mcore(hf.state_dict(), 2, 6, 2))
    ids, pos = _ids()
    assert SEQ > 2 * window
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids, pos, None)
        # The plain causal mask tensor, as Megatron's loops pass it, changes nothing.
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
        got_with_mask = model(ids, pos, causal)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_with_mask, expected, rtol=1e-4, atol=1e-4)
    # The window matters: full causal attention gives different logits.
    cfg.window_size = None
    full = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, 64, position_embedding_type="rope", rotary_base=5000).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(full(ids, pos, None), expected, atol=1e-3)
