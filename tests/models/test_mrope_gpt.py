"""``GPTModel(position_embedding_type="mrope")`` with ``TransformerConfig.mrope_section`` (Megatron-Core 0.19).

On the same weights and the same 3-D positions ``[3, b, s]`` (temporal, height, width differing, as for image
tokens) its logits equal Hugging Face's Qwen2-VL text decoder (``Qwen2VLTextModel`` + an untied head), fp32 on
CPU; the inputs it cannot serve raise ``ValueError`` naming the field or argument, the value and the rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import MLATransformerConfig, TransformerConfig

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, S, B = 2, 32, 4, 2, 48, 64, 10, 2
SECTION = [1, 1, 2]  # head_dim 8: four frequencies, 1 temporal, 1 height, 2 width


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
                layernorm_epsilon=1e-6, use_cpu_initialization=True, mrope_section=SECTION)
    return TransformerConfig(**{**base, **overrides})


def _model(**overrides) -> GPTModel:
    return GPTModel(_config(**overrides), get_gpt_layer_local_spec(), VOCAB, 32, position_embedding_type="mrope",
                    rotary_base=1000)


def _positions() -> torch.Tensor:
    """Text, then a 2 x 3 image grid, then text again (Qwen2-VL's ``get_rope_index`` layout), per sample."""
    text = torch.arange(2)
    t, h, w = torch.zeros(6, dtype=torch.long) + 2, torch.arange(2).repeat_interleave(3) + 2, torch.arange(3).repeat(2) + 2
    tail = torch.arange(2) + 5
    grid = torch.stack((torch.cat((text, t, tail)), torch.cat((text, h, tail)), torch.cat((text, w, tail))))
    return torch.stack((grid, grid + 3), dim=1)  # [3, 2, 10]


def _hf_model():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    cfg = Qwen2VLTextConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                            intermediate_size=FFN, num_hidden_layers=LAYERS, vocab_size=VOCAB, rms_norm_eps=1e-6,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": SECTION})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen2VLTextModel(cfg).eval()
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():  # Hugging Face initialises the norms to ones; make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model, head


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's per-group ``[q heads of the group | k | v]`` rows from separate q / k / v tensors."""
    hd = k.shape[0] // GROUPS
    q = q.reshape(GROUPS, HEADS // GROUPS * hd, *q.shape[1:])
    return torch.cat((q, k.reshape(GROUPS, hd, *k.shape[1:]), v.reshape(GROUPS, hd, *v.shape[1:])), dim=1).flatten(0, 1)


def _load(model: GPTModel, hf, head: torch.nn.Linear) -> None:
    src = hf.state_dict()
    dst = {"embedding.word_embeddings.weight": src["embed_tokens.weight"], "decoder.final_layernorm.weight":
           src["norm.weight"], "output_layer.weight": head.weight.detach()}
    for i in range(LAYERS):
        h, m = f"layers.{i}.", f"decoder.layers.{i}."
        attn = {p: src[f"{h}self_attn.{p}"] for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                      "q_proj.bias", "k_proj.bias", "v_proj.bias")}
        dst.update({
            m + "input_layernorm.weight": src[h + "input_layernorm.weight"],
            m + "self_attention.linear_qkv.weight": _fused(*(attn[f"{p}_proj.weight"] for p in "qkv")),
            m + "self_attention.linear_qkv.bias": _fused(*(attn[f"{p}_proj.bias"] for p in "qkv")),
            m + "self_attention.linear_proj.weight": src[h + "self_attn.o_proj.weight"],
            m + "pre_mlp_layernorm.weight": src[h + "post_attention_layernorm.weight"],
            m + "mlp.linear_fc1.weight": torch.cat((src[h + "mlp.gate_proj.weight"], src[h + "mlp.up_proj.weight"])),
            m + "mlp.linear_fc2.weight": src[h + "mlp.down_proj.weight"],
        })
    missing, unexpected = model.load_state_dict(dst, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def test_mrope_gpt_logits_match_hugging_face_qwen2_vl_text_model():
    hf, head = _hf_model()
    model = _model().eval()
    _load(model, hf, head)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    positions = _positions()
    with torch.no_grad():
        expected = head(hf(input_ids=ids, position_ids=positions).last_hidden_state)
        logits = model(ids, positions, None)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        # the 3-D positions matter: plain 1-D positions repeated three times give other logits
        plain = torch.arange(S).expand(3, B, S)
        assert not torch.allclose(model(ids, plain, None), logits, atol=1e-3)
        torch.testing.assert_close(model(ids, plain, None), head(hf(input_ids=ids, position_ids=plain).last_hidden_state),
                                   rtol=1e-5, atol=1e-5)


def test_mrope_model_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match=r"position_embedding_type='mrope' needs TransformerConfig.mrope_section"):
        _model(mrope_section=None)
    with pytest.raises(ValueError, match=r"mrope_section \(\[2, 2, 2\]\) must sum to half the rotary width, "
                                         r"kv_channels \* rotary_percent / 2 = 4 \(got 6\)"):
        _model(mrope_section=[2, 2, 2])
    with pytest.raises(ValueError, match=r"mrope_section \(\[1, 1, 2\]\) must sum to half the rotary width.* = 2"):
        GPTModel(_config(), get_gpt_layer_local_spec(), VOCAB, 32, position_embedding_type="mrope", rotary_percent=0.5)
    mla = MLATransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, mrope_section=SECTION,
                               use_cpu_initialization=True)
    with pytest.raises(ValueError, match="position_embedding_type='mrope' with multi_latent_attention=True"):
        GPTModel(mla, get_gpt_layer_local_spec(multi_latent_attention=True), VOCAB, 32,
                 position_embedding_type="mrope")
    model = _model()
    ids = torch.randint(0, VOCAB, (B, S))
    with pytest.raises(ValueError, match=r"needs position_ids of shape \[3, batch, seq\]"):
        model(ids, None, None)
    with pytest.raises(ValueError, match=r"position_ids must be \[3, batch, seq\]"):
        model(ids, torch.arange(S).expand(B, S), None)
    with pytest.raises(ValueError, match=r"position_ids \(3, 2, 6\) must be \[3, batch, seq\] for the whole sequence "
                                         r"\(batch 2, seq 10"):
        model(ids, _positions()[..., :6], None)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, S], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, S], dtype=torch.int32), max_seqlen_q=S, max_seqlen_kv=S)
    with pytest.raises(ValueError, match="supports neither packed sequences"):
        model(ids[:1], _positions()[:, :1], None, packed_seq_params=packed)
