"""muP in ``TransformerConfig`` and the GPT model: derived fields, init stds, softmax scale, multipliers.

Expected values are hand-computed from Megatron-Core 0.19's formulas (``transformer_config.__post_init__``,
``utils.mup_scaled_init_method_normal``, ``LanguageModelEmbedding`` / ``LanguageModule._scale_logits``).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.utils import init_method_normal, mup_scaled_init_method_normal

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **kw})


def test_width_mult_and_base_default():
    cfg = _config(use_mup=True)
    assert (cfg.mup_base_hidden_size, cfg.mup_width_mult, cfg.mup_output_mult) == (64, 1.0, 1.0)
    cfg = _config(use_mup=True, mup_base_hidden_size=16)
    assert cfg.mup_width_mult == 4.0 and cfg.mup_output_mult == 0.25
    cfg = _config(use_mup=True, mup_base_hidden_size=128)
    assert cfg.mup_width_mult == 0.5 and cfg.mup_output_mult == 2.0
    cfg = _config(use_mup=True, mup_base_hidden_size=16, mup_output_mult=0.7)  # explicit value kept
    assert cfg.mup_output_mult == 0.7
    off = _config(mup_base_hidden_size=16)  # without use_mup nothing is derived
    assert (off.use_mup, off.mup_width_mult, off.mup_output_mult, off.softmax_scale) == (False, 1.0, 1.0, None)


def test_softmax_scale():
    d = 16  # kv_channels = 64 / 4
    assert _config(use_mup=True).softmax_scale == 1.0 / d
    assert _config(use_mup=True, mup_attn_scale_power=0.5).softmax_scale == pytest.approx(1.0 / math.sqrt(d))
    assert _config(use_mup=True, mup_base_head_dim=8).softmax_scale == pytest.approx(math.sqrt(8) / d)
    assert _config(use_mup=True, softmax_scale=0.3).softmax_scale == 0.3
    assert _config(use_mup=True, kv_channels=32).softmax_scale == 1.0 / 32


def test_init_stds():
    """Hidden N(0, s^2/m), output projections N(0, s^2/(2 L m)), embeddings N(0, s^2), measured on a big tensor."""
    cfg = _config(use_mup=True, mup_base_hidden_size=16, init_method_std=0.05)
    expected = {"init_method": 0.05 / 2, "output_layer_init_method": 0.05 / (2 * 2),
                "embedding_init_method": 0.05}
    for name, std in expected.items():
        torch.manual_seed(0)
        sample = getattr(cfg, name)(torch.empty(400, 400))
        assert sample.std().item() == pytest.approx(std, rel=0.01), name
    torch.manual_seed(0)
    a = mup_scaled_init_method_normal(0.1, 3, 4.0)(torch.empty(100, 100))
    torch.manual_seed(0)
    b = init_method_normal(0.1 / (math.sqrt(6) * 2))(torch.empty(100, 100))
    assert torch.equal(a, b)


def _gpt(seed: int = 0, tie: bool = False, **kw) -> GPTModel:
    torch.manual_seed(seed)
    cfg = _config(hidden_dropout=0.0, attention_dropout=0.0, **kw)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=96, max_sequence_length=16,
                    share_embeddings_and_output_weights=tie)


def test_model_weight_stds_and_tags():
    model = _gpt(use_mup=True, mup_base_hidden_size=16, init_method_std=0.05, hidden_size=128, ffn_hidden_size=512)
    layer = model.decoder.layers[0]
    checks = {  # m = 8, L = 2
        layer.self_attention.linear_qkv.weight: 0.05 / math.sqrt(8),
        layer.mlp.linear_fc1.weight: 0.05 / math.sqrt(8),
        layer.self_attention.linear_proj.weight: 0.05 / (2 * math.sqrt(8)),
        layer.mlp.linear_fc2.weight: 0.05 / (2 * math.sqrt(8)),
        model.embedding.word_embeddings.weight: 0.05,
        model.output_layer.weight: 0.05,  # untied: the embedding's init under muP
    }
    for weight, std in checks.items():
        assert weight.std().item() == pytest.approx(std, rel=0.1)
    assert model.embedding.word_embeddings.weight.is_embedding_parameter
    assert model.output_layer.weight.is_embedding_parameter
    assert not hasattr(layer.mlp.linear_fc1.weight, "is_embedding_parameter")
    assert model.decoder.layers[0].self_attention.core_attention.softmax_scale == 1.0 / 32
    assert not hasattr(_gpt().output_layer.weight, "is_embedding_parameter")


def test_base_width_equals_standard_parametrisation():
    """m = 1 and mup_base_head_dim = kv_channels: the same weights and logits as the standard model."""
    std, mup = _gpt(seed=3), _gpt(seed=3, use_mup=True, mup_base_head_dim=16)
    assert mup.config.mup_width_mult == 1.0 and mup.config.mup_output_mult == 1.0
    assert mup.config.softmax_scale == pytest.approx(1.0 / 4)
    for (name, a), (_, b) in zip(std.state_dict().items(), mup.state_dict().items(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(mup(tokens, positions, None), std(tokens, positions, None), rtol=1e-6, atol=1e-6)


def test_embedding_and_output_multipliers():
    """Embedding output times mup_embedding_mult; logits times mup_output_mult (auto 1/m)."""
    model = _gpt(use_mup=True, mup_base_hidden_size=16, mup_embedding_mult=3.0)
    seen = {}
    model.embedding.word_embeddings.register_forward_hook(lambda m, i, o: seen.__setitem__("word", o))
    model.embedding.position_embeddings.register_forward_hook(lambda m, i, o: seen.__setitem__("pos", o))
    model.embedding.register_forward_hook(lambda m, i, o: seen.__setitem__("emb", o))
    model.output_layer.register_forward_hook(lambda m, i, o: seen.__setitem__("raw", o[0]))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    logits = model(tokens, torch.arange(16).expand(2, 16), None)
    torch.testing.assert_close(seen["emb"], 3.0 * (seen["word"] + seen["pos"]).transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(logits, 0.25 * seen["raw"].transpose(0, 1), rtol=0, atol=0)
    labels = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=labels)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), expected, rtol=1e-5, atol=1e-6)


def test_custom_init_method_warns():
    with pytest.warns(UserWarning, match="custom init_method and output_layer_init_method"):
        _config(use_mup=True, init_method=init_method_normal(0.1), output_layer_init_method=init_method_normal(0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config(use_mup=True)


@pytest.mark.parametrize("kw, field", [
    (dict(mup_base_hidden_size=0), "mup_base_hidden_size"),
    (dict(mup_base_hidden_size=-8), "mup_base_hidden_size"),
    (dict(mup_base_head_dim=-4.0), "mup_base_head_dim"),
    (dict(mup_embedding_mult=float("nan")), "mup_embedding_mult"),
    (dict(mup_attn_scale_power=float("inf")), "mup_attn_scale_power"),
])
def test_invalid_mup_fields_raise(kw, field):
    with pytest.raises(ValueError, match=field):
        _config(use_mup=True, **kw)
    _config(**kw)  # ignored without use_mup, as in Megatron-Core


def test_mtp_logits_are_scaled(monkeypatch):
    """The MTP depths' logits get the same output multiplier (``scale_logits_fn``), as in Megatron-Core."""
    from megatron_core.models.gpt import gpt_model
    from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron_core.transformer import multi_token_prediction

    scaled = []
    real = multi_token_prediction.process_mtp_loss

    def spy(*args, scale_logits_fn=None, **kwargs):
        def record(logits):
            out = scale_logits_fn(logits)
            scaled.append(torch.allclose(out, 0.25 * logits))
            return out
        return real(*args, scale_logits_fn=record, **kwargs)

    monkeypatch.setattr(gpt_model, "process_mtp_loss", spy)
    torch.manual_seed(0)
    cfg = _config(use_mup=True, mup_base_hidden_size=16, mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0)
    block = get_gpt_decoder_block_spec(cfg, False)
    model = GPTModel(cfg, block, 96, 16, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, block, False))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    model(tokens, torch.arange(16).expand(2, 16), None, labels=torch.roll(tokens, -1, 1)).sum().backward()
    assert scaled == [True]
