"""The T5 layer and block specs: the decoder's cross-attention sublayer, and Transformer Engine's absence."""

from __future__ import annotations

import pytest

from megatron_core.extensions._te_loader import HAVE_TE
from megatron_core.models.T5 import t5_spec
from megatron_core.transformer.attention import CrossAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.torch_norm import WrappedTorchNorm


def test_local_specs():
    encoder = t5_spec.get_t5_encoder_with_local_block_spec(3)
    decoder = t5_spec.get_t5_decoder_with_local_block_spec(2)
    assert len(encoder.layer_specs) == 3 and len(decoder.layer_specs) == 2
    assert encoder.layer_norm is WrappedTorchNorm and decoder.layer_norm is WrappedTorchNorm
    enc, dec = encoder.layer_specs[0].submodules, decoder.layer_specs[0].submodules
    assert enc.self_attention.params["attn_mask_type"] == AttnMaskType.arbitrary
    assert enc.cross_attention is IdentityOp
    assert dec.self_attention.params["attn_mask_type"] == AttnMaskType.causal
    assert dec.cross_attention.module is CrossAttention
    assert dec.cross_attention.params["attn_mask_type"] == AttnMaskType.arbitrary
    assert dec.pre_cross_attn_layernorm is WrappedTorchNorm
    assert dec.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    with pytest.raises(ValueError, match=r"num_layers \(0\)"):
        t5_spec.get_t5_encoder_with_local_block_spec(0)


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed")
@pytest.mark.parametrize("name", ["get_t5_encoder_with_transformer_engine_block_spec",
                                  "get_t5_decoder_with_transformer_engine_block_spec",
                                  "encoder_model_with_transformer_engine_default_spec",
                                  "decoder_model_with_transformer_engine_default_spec"])
def test_transformer_engine_specs_need_transformer_engine(name):
    args = (2,) if name.startswith("get_") else ()
    with pytest.raises(ImportError, match=rf"{name} needs NVIDIA Transformer Engine.*\[te\]"):
        getattr(t5_spec, name)(*args)
