"""An MTP depth's self-attention must use one of ``SUPPORTED_ATTN_MASK`` (Megatron-Core 0.19's rule), by name."""

from __future__ import annotations

import copy

import pytest

from megatron_core.enums import AttnMaskType
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.multi_token_prediction import SUPPORTED_ATTN_MASK, MultiTokenPredictionBlock

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=1, use_cpu_initialization=True)


def _mtp_spec(mask_type: AttnMaskType):
    config = TransformerConfig(**CONFIG)
    block = get_gpt_decoder_block_spec(config, False)
    spec = copy.deepcopy(get_gpt_mtp_block_spec(config, block, False))
    layer_spec = spec.layer_specs[0].submodules.mtp_model_layer
    layer_spec.submodules.self_attention.params = {**layer_spec.submodules.self_attention.params,
                                                   "attn_mask_type": mask_type}
    return config, spec


def test_supported_masks_are_megatrons_list():
    assert SUPPORTED_ATTN_MASK == [AttnMaskType.padding, AttnMaskType.causal, AttnMaskType.no_mask,
                                   AttnMaskType.padding_causal]


@pytest.mark.parametrize("mask_type", SUPPORTED_ATTN_MASK)
def test_supported_mask_builds(mask_type):
    config, spec = _mtp_spec(mask_type)
    assert len(MultiTokenPredictionBlock(config, spec).layers) == 1


@pytest.mark.parametrize("mask_type", [AttnMaskType.arbitrary, AttnMaskType.causal_bottom_right])
def test_unsupported_mask_is_refused_by_name(mask_type):
    config, spec = _mtp_spec(mask_type)
    with pytest.raises(ValueError, match=f"attn_mask_type={mask_type}"):
        MultiTokenPredictionBlock(config, spec)
