"""``qk_l2_norm`` and ``no_rope_freq`` (Megatron-Core 0.19's ``TransformerConfig`` fields), fp32 on CPU.

``qk_l2_norm``: ``SelfAttention`` against a hand-written attention that scales each query / key head to unit RMS
before RoPE, and against Hugging Face's ``Llama4TextAttention`` (``use_qk_norm``) on a RoPE layer, where the two
agree (the norm of a head does not change under a rotation, so norm-then-rotate equals rotate-then-norm). They
differ on Llama 4's NoPE layers: Hugging Face builds no q/k norm there while Megatron-Core (and this library)
normalises every layer; the test pins that difference. ``no_rope_freq``: the config's per-layer flags, a GPTModel
whose NoPE layers equal the same layers called without angles, and a NoPE layer against Hugging Face's
(``use_qk_norm`` and ``attn_temperature_tuning`` off). Validation errors name the field, the value and the rule.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_with_inference_spec
from megatron_core.transformer import MLATransformerConfig, TransformerConfig
from megatron_core.transformer.attention import SelfAttention
from megatron_core.transformer.backend_specs import self_attention_spec
from megatron_core.transformer.backends import LocalSpecProvider
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.rotary_pos_embedding import RotaryEmbedding
from megatron_core.transformer.spec_utils import build_module
from megatron_core.transformer.torch_norm import L2Norm

HEADS, GROUPS, HD, S, B = 4, 2, 8, 6, 2
EPS = 1e-5
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=HEADS * HD, num_attention_heads=HEADS, num_query_groups=GROUPS,
                add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, layernorm_epsilon=EPS,
                use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu)
    return TransformerConfig(**{**base, **overrides})


def _attention(config: TransformerConfig, layer_number: int = 1) -> SelfAttention:
    torch.manual_seed(0)
    spec = self_attention_spec(LocalSpecProvider(), AttnMaskType.causal)
    return build_module(spec, config=config, layer_number=layer_number)


def _qkv(attention: SelfAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key, value ``[s, b, heads, hd]`` from the per-group fused weight, by hand."""
    w = attention.linear_qkv.weight.view(GROUPS, HEADS // GROUPS + 2, HD, -1)
    q = torch.einsum("sbh,gjdh->sbgjd", x, w[:, :-2]).reshape(S, B, HEADS, HD)
    k = torch.einsum("sbh,gdh->sbgd", x, w[:, -2])
    v = torch.einsum("sbh,gdh->sbgd", x, w[:, -1])
    return q, k, v


def _rope(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Half-split rotation by ``angles`` ``[s, 1, 1, hd]``."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * angles.cos() + rotated * angles.sin()


def _reference(attention: SelfAttention, x: torch.Tensor, angles: torch.Tensor | None, l2: bool) -> torch.Tensor:
    q, k, v = _qkv(attention, x)
    if l2:
        q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + EPS)
        k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + EPS)
    if angles is not None:
        q, k = _rope(q, angles), _rope(k, angles)
    k = k.repeat_interleave(HEADS // GROUPS, dim=2)
    v = v.repeat_interleave(HEADS // GROUPS, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(HD)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(S, B, HEADS * HD)
    return context @ attention.linear_proj.weight.t()


@pytest.mark.parametrize("no_rope", [False, True])
def test_qk_l2_norm_attention_matches_a_hand_written_one(no_rope: bool):
    config = _config(qk_l2_norm=True, no_rope_freq=[1, 0] if no_rope else None)
    attention = _attention(config)
    assert isinstance(attention.q_layernorm, L2Norm) and isinstance(attention.k_layernorm, L2Norm)
    assert attention.q_layernorm.eps == EPS
    angles = RotaryEmbedding(HD, 1.0)(S)
    x = torch.randn(S, B, HEADS * HD, requires_grad=True)
    out, _ = attention(x, None, rotary_pos_emb=angles)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = _reference(attention, x_ref, None if no_rope else angles, l2=True)
    torch.testing.assert_close(out, ref, **TOL)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    # the norm changes the result (the check is not vacuous)
    assert not torch.allclose(out, _reference(attention, x.detach(), None if no_rope else angles, l2=False), atol=1e-3)


def _hf_llama4_attention(use_rope: bool, use_qk_norm: bool):
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    cfg = Llama4TextConfig(hidden_size=HEADS * HD, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HD,
                           rms_norm_eps=EPS, use_qk_norm=use_qk_norm, no_rope_layers=[int(use_rope)],
                           num_hidden_layers=1, attn_temperature_tuning=False, attention_bias=False,
                           intermediate_size=16, intermediate_size_mlp=16, vocab_size=32)
    cfg._attn_implementation = "eager"
    return Llama4TextAttention(cfg, layer_idx=0).eval(), Llama4TextRotaryEmbedding(cfg)


def _load_hf(hf, attention: SelfAttention) -> None:
    w = attention.linear_qkv.weight.detach().view(GROUPS, HEADS // GROUPS + 2, HD, -1)
    with torch.no_grad():
        hf.q_proj.weight.copy_(w[:, :-2].reshape(HEADS * HD, -1))
        hf.k_proj.weight.copy_(w[:, -2].reshape(GROUPS * HD, -1))
        hf.v_proj.weight.copy_(w[:, -1].reshape(GROUPS * HD, -1))
        hf.o_proj.weight.copy_(attention.linear_proj.weight)


def _hf_out(hf, rotary, x: torch.Tensor) -> torch.Tensor:
    hidden = x.transpose(0, 1)
    positions = torch.arange(S).expand(B, S)
    mask = torch.zeros(S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))[None, None]
    out, _ = hf(hidden, rotary(hidden, positions), mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("rope_layer", [True, False])
def test_layers_match_hugging_face_llama4_attention(rope_layer: bool):
    """A RoPE layer with qk_l2_norm = Llama 4's use_qk_norm (interleaved complex pairs = rotary_interleaved); a NoPE
    layer without q/k norm = Llama 4's NoPE layer (no temperature tuning)."""
    config = _config(qk_l2_norm=rope_layer, rotary_interleaved=True, no_rope_freq=None if rope_layer else [1, 1])
    attention = _attention(config)
    hf, rotary = _hf_llama4_attention(use_rope=rope_layer, use_qk_norm=rope_layer)
    _load_hf(hf, attention)
    x = torch.randn(S, B, HEADS * HD)
    angles = RotaryEmbedding(HD, 1.0, rotary_interleaved=True, rotary_base=int(hf.config.rope_parameters["rope_theta"]))
    with torch.no_grad():
        out, _ = attention(x, None, rotary_pos_emb=angles(S))
        torch.testing.assert_close(out, _hf_out(hf, rotary, x), **TOL)


def test_qk_l2_norm_on_nope_layers_differs_from_llama4():
    """Megatron-Core normalises q/k on every layer; Llama 4 (Hugging Face) only on its RoPE layers."""
    attention = _attention(_config(qk_l2_norm=True, no_rope_freq=[1, 1]))
    hf, rotary = _hf_llama4_attention(use_rope=False, use_qk_norm=True)
    assert not hasattr(hf, "qk_norm")
    _load_hf(hf, attention)
    x = torch.randn(S, B, HEADS * HD)
    with torch.no_grad():
        out, _ = attention(x, None, rotary_pos_emb=RotaryEmbedding(HD, 1.0)(S))
        assert not torch.allclose(out, _hf_out(hf, rotary, x), atol=1e-3)


def test_gpt_model_nope_layers_equal_layers_called_without_angles():
    """Every 2nd layer of a ``no_rope_freq=2`` model equals that layer of a plain model called without angles."""
    config = _config(num_layers=4, no_rope_freq=2, qk_l2_norm=True)
    assert config.no_rope_freq == [0, 1, 0, 1]
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), 32, 16, position_embedding_type="rope")
    plain = GPTModel(_config(num_layers=4, qk_l2_norm=True), get_gpt_layer_local_spec(), 32, 16,
                     position_embedding_type="rope")
    plain.load_state_dict(model.state_dict())
    ids, positions = torch.randint(0, 32, (B, S)), torch.arange(S).expand(B, S)
    with torch.no_grad():
        logits = model(ids, positions, None)
        hidden = plain.embedding(input_ids=ids, position_ids=None)
        angles = plain.rotary_pos_emb(S)
        for i, layer in enumerate(plain.decoder.layers):
            hidden, _ = layer(hidden, None, rotary_pos_emb=None if i % 2 else angles)
        ref = plain.output_layer(plain.decoder.final_layernorm(hidden))[0].transpose(0, 1)
        torch.testing.assert_close(logits, ref, **TOL)
        assert not torch.allclose(plain(ids, positions, None), logits, atol=1e-3)


def test_specs_build_l2_norms():
    layer = get_gpt_layer_local_spec(qk_l2_norm=True, qk_layernorm=True)
    assert layer.submodules.self_attention.submodules.q_layernorm is L2Norm
    inference = get_gpt_layer_with_inference_spec(qk_l2_norm=True)
    assert inference.submodules.self_attention.submodules.k_layernorm is L2Norm
    with pytest.raises(ValueError, match="qk_l2_norm=True is not supported with multi_latent_attention"):
        get_gpt_layer_local_spec(qk_l2_norm=True, multi_latent_attention=True)
    # a spec's L2Norm without the config flag is refused (Megatron-Core's rule)
    spec = get_gpt_layer_local_spec(qk_l2_norm=True).submodules.self_attention
    with pytest.raises(ValueError, match="qk_l2_norm and qk_layernorm are False"):
        build_module(spec, config=_config(), layer_number=1)
    # the config alone fills the local spec's empty q/k norm slots
    assert isinstance(_attention(_config(qk_l2_norm=True)).k_layernorm, L2Norm)
    assert _attention(_config()).q_layernorm is None


@pytest.mark.parametrize("value, expected", [
    (None, None), (0, 0), (1, [1, 1, 1, 1]), (4, [0, 0, 0, 1]), (2, [0, 1, 0, 1]), ([1, 0, 0, 1], [1, 0, 0, 1]),
])
def test_no_rope_freq_becomes_per_layer_flags(value, expected):
    assert _config(num_layers=4, no_rope_freq=value).no_rope_freq == expected


@pytest.mark.parametrize("overrides, message", [
    (dict(no_rope_freq=3), r"no_rope_freq \(3\) must be a positive divisor of num_layers \(4\)"),
    (dict(no_rope_freq=-2), r"no_rope_freq \(-2\) must be a positive divisor"),
    (dict(no_rope_freq=True), r"no_rope_freq \(True\) must be None, a positive int"),
    (dict(no_rope_freq=[0, 1]), r"no_rope_freq \(\[0, 1\]\) as a list must hold one 0 \(RoPE\) or 1 \(no RoPE\) per "
                                r"layer \(num_layers=4, got 2 entries\)"),
    (dict(no_rope_freq=[0, 2, 0, 1]), r"no_rope_freq \(\[0, 2, 0, 1\]\) as a list"),
    (dict(no_rope_freq="2"), r"no_rope_freq \('2'\) must be None"),
    (dict(no_rope_freq=2, flash_decode=True), r"no_rope_freq \(\[0, 1, 0, 1\]\) cannot be used with flash_decode"),
    (dict(qk_l2_norm=1), r"qk_l2_norm \(1\) must be a bool"),
    (dict(mrope_section=[1, -1]), r"mrope_section \(\[1, -1\]\) must be a non-empty list of non-negative ints"),
    (dict(mrope_section=4), r"mrope_section \(4\) must be a non-empty list"),
])
def test_bad_values_raise_naming_field_value_and_rule(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(num_layers=4, **overrides)


@pytest.mark.parametrize("overrides, message", [
    (dict(qk_l2_norm=True), "qk_l2_norm=True is not supported with multi_latent_attention=True"),
    (dict(no_rope_freq=2), r"no_rope_freq \(\[0, 1\]\) cannot be used with multi_latent_attention=True"),
])
def test_mla_refuses_qk_l2_norm_and_no_rope_freq(overrides, message):
    with pytest.raises(ValueError, match=message):
        MLATransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                             **overrides)


def test_modelopt_spec_takes_qk_l2_norm_from_the_config():
    pytest.importorskip("modelopt.torch")
    from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec

    spec = get_gpt_modelopt_spec(_config(qk_l2_norm=True), local_core_attention=True)
    assert spec.layer_specs[0].submodules.self_attention.submodules.q_layernorm is L2Norm
    spec = get_gpt_modelopt_spec(_config(), local_core_attention=True, qk_l2_norm=True)  # the config wins
    assert spec.layer_specs[0].submodules.self_attention.submodules.q_layernorm is not L2Norm
