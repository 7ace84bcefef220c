"""YaRN rotary embeddings: frequencies and attention factor against Hugging Face's ``_compute_yarn_parameters``,
the factor applied to query and key by ``apply_rotary_pos_emb`` (from the config's ``yarn_*`` fields), GPTModel's
``position_embedding_type='yarn'``, and the refusals (fused RoPE, inference, rotary_percent)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.models.common.embeddings import YarnRotaryEmbedding
from megatron_core.models.common.embeddings.yarn_rotary_pos_embedding import yarn_inv_freq
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.rope_utils import apply_rotary_pos_emb, yarn_concentration_factor

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402

HEAD_DIM = 16


def _hf(factor: float, original: int, truncate: bool, theta: float = 10000.0, **extra) -> tuple[torch.Tensor, float]:
    params = dict(rope_type="yarn", rope_theta=theta, factor=factor, original_max_position_embeddings=original,
                  beta_fast=32.0, beta_slow=1.0, truncate=truncate, **extra)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                   max_position_embeddings=4 * original, rope_parameters=params)
    return _compute_yarn_parameters(cfg)


def _config(**overrides) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, **overrides)


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("factor,original,theta", [(4.0, 16, 10000.0), (32.0, 4096, 150000.0), (1.5, 64, 500.0)])
def test_frequencies_and_attention_factor_match_hugging_face(truncate: bool, factor: float, original: int,
                                                              theta: float):
    hf_inv_freq, hf_factor = _hf(factor, original, truncate, theta)
    ours = yarn_inv_freq(HEAD_DIM, theta, factor, original, 32.0, 1.0, round_to_int=truncate)
    torch.testing.assert_close(ours, hf_inv_freq, rtol=1e-6, atol=0)
    emb = YarnRotaryEmbedding(HEAD_DIM, rotary_base=theta, scaling_factor=factor,
                              original_max_position_embeddings=original, correction_range_round_to_int=truncate,
                              use_cpu_initialization=True)
    angles, mscale = emb(5)
    assert mscale == pytest.approx(hf_factor)
    torch.testing.assert_close(angles[:, 0, 0, : HEAD_DIM // 2], torch.outer(torch.arange(5.0), hf_inv_freq))
    config = _config(yarn_rotary_scaling_factor=factor)
    assert yarn_concentration_factor(config) == pytest.approx(hf_factor)


def test_mscale_pair_matches_hugging_face():
    _, hf_factor = _hf(40.0, 16, True, mscale=0.707, mscale_all_dim=1.0)
    config = _config(yarn_rotary_scaling_factor=40.0, yarn_mscale=0.707, yarn_mscale_all_dim=1.0)
    assert yarn_concentration_factor(config) == pytest.approx(hf_factor)
    assert yarn_concentration_factor(_config()) == 1.0  # the defaults: no YaRN, no scaling


def test_rotation_scales_by_the_concentration_factor_from_the_config():
    config = _config(yarn_rotary_scaling_factor=8.0)
    factor = yarn_concentration_factor(config)
    t = torch.randn(6, 2, 4, HEAD_DIM)
    angles = torch.randn(6, 1, 1, HEAD_DIM)
    plain = apply_rotary_pos_emb(t, angles, config=_config())
    torch.testing.assert_close(apply_rotary_pos_emb(t, angles, config=config), plain * factor)
    torch.testing.assert_close(apply_rotary_pos_emb(t, angles, config=config, mscale=1.0), plain)


def test_gpt_model_builds_yarn_and_uses_its_angles():
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, yarn_rotary_scaling_factor=4.0,
                               yarn_original_max_position_embeddings=8)
    model = GPTModel(config, get_gpt_layer_local_spec(), 32, 64, position_embedding_type="yarn", rotary_base=1000)
    assert isinstance(model.rotary_pos_emb, YarnRotaryEmbedding)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, yarn_inv_freq(8, 1000, 4.0, 8))
    ids = torch.randint(0, 32, (2, 20))
    logits = model(ids, torch.arange(20).expand(2, 20), None)
    assert logits.shape == (2, 20, 32) and torch.isfinite(logits).all()


def test_refusals_name_the_fields():
    with pytest.raises(ValueError, match="apply_rope_fusion.*YaRN"):
        _config(yarn_rotary_scaling_factor=4.0, apply_rope_fusion=True)
    with pytest.raises(ValueError, match="yarn_rotary_scaling_factor"):
        _config(yarn_rotary_scaling_factor=0.0)
    with pytest.raises(ValueError, match="rotary_percent"):
        YarnRotaryEmbedding(HEAD_DIM, rotary_percent=0.5, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="YaRN"):
        BaseInferenceContext.check_attention_supported(SimpleNamespace(config=_config(yarn_rotary_scaling_factor=4.0)))
    _config(apply_rope_fusion=True)  # without YaRN scaling the fused kernel is fine
