"""HybridModel ("M*M-": Mamba, GQA attention without RoPE, squared-ReLU MLP) against Hugging Face
``NemotronHForCausalLM`` (torch path, fp32 CPU) on the same random weights: logits within 1e-4.

The config correspondence and the weight mapping are the HF bridge's (``megatron_core.models.hf.hybrid``):
the HF model is saved with ``save_pretrained`` and imported with ``AutoBridge``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.activations import squared_relu
from megatron_core.models.hybrid import HybridModel

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.hf import AutoBridge  # noqa: E402

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


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_logits_match_hf_nemotron_h(chunk_size, tmp_path):
    torch.manual_seed(0)
    hf = _hf_model(chunk_size)
    with torch.no_grad():  # random (not initial) values for every parameter
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
        for i, symbol in enumerate(PATTERN):
            if symbol == "M":
                hf.model.layers[i].mixer.A_log.uniform_(-1.0, 1.0)
    hf.save_pretrained(tmp_path)
    bridge = AutoBridge.from_hf_pretrained(tmp_path)
    (model,) = bridge.to_megatron_model()
    assert isinstance(model, HybridModel) and model.hybrid_layer_pattern == PATTERN
    config = model.config
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (HEADS, GROUPS, HEAD_DIM)
    assert (config.mamba_num_heads, config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_dim) == (
        4, 8, 2, 8)
    assert config.activation_func is squared_relu and not config.gated_linear_unit
    assert model.position_embedding_type == "none" and not model.share_embeddings_and_output_weights
    assert {layer.mixer.chunk_size for layer in model.decoder.layers if hasattr(layer, "mixer")} == {chunk_size}
    hf_state = {k: v.detach() for k, v in hf.named_parameters()}
    ours = dict(model.named_parameters())
    assert torch.equal(ours["decoder.layers.0.mixer.in_proj.weight"], hf_state["model.layers.0.mixer.in_proj.weight"])
    assert torch.equal(ours["decoder.layers.3.mlp.linear_fc1.weight"], hf_state["model.layers.3.mixer.up_proj.weight"])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 11), generator=gen)
    pos = torch.arange(11).unsqueeze(0).expand(2, 11)
    model.eval()
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids, pos, None)
    assert want.abs().max() > 1.0  # the layers do real work at this scale
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
