"""TRTLLMLayers, the renaming of Megatron keys, the conversion dicts, model type strings and gated activations."""

from __future__ import annotations

import importlib.util
import types
import warnings

import pytest
import torch

from megatron_core.export.model_type import ModelType
from megatron_core.export.trtllm.model_to_trllm_mapping.default_conversion_dict import (
    DEFAULT_CONVERSION_DICT,
    NEMOTRON_NAS_CONVERSION_DICT,
)
from megatron_core.export.trtllm.trt_model_type import TRT_MODEL_TYPE_STRING
from megatron_core.export.trtllm.trtllm_layers import (
    NON_TRANSFORMER_LAYERS_NAMES,
    TRTLLMLayers,
    get_layer_name_without_prefix,
)
from megatron_core.export.trtllm.trtllm_weights_converter.utils import GATED_ACTIVATION, is_gated_activation

HAVE_ORACLE = importlib.util.find_spec("megatron") is not None


def test_layer_name_and_number() -> None:
    split = TRTLLMLayers.return_layer_name_and_number
    assert split("decoder.layers.12.self_attention.linear_qkv.weight") == (
        "decoder.layers.self_attention.linear_qkv.weight", 12)
    assert split("decoder.final_layernorm.weight") == ("decoder.final_layernorm.weight", None)
    assert split("decoder.layers.mlp.linear_fc1.weight") == ("decoder.layers.mlp.linear_fc1.weight", None)
    assert get_layer_name_without_prefix(TRTLLMLayers.attention_qkv_weight) == "attention.qkv.weight"
    assert NON_TRANSFORMER_LAYERS_NAMES == ["transformer.vocab_embedding.weight", "transformer.position_embedding.weight",
                                            "lm_head.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]


def test_rename_puts_layer_numbers_back_and_drops_extra_state() -> None:
    t = torch.zeros(1)
    sd = {"decoder.layers.3.self_attention.linear_qkv.weight": t, "output_layer.weight": t,
          "decoder.layers.3.mlp.linear_fc1._extra_state": None, "decoder.layers.0.adapter_layer.x": t,
          "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": t}
    renamed = TRTLLMLayers.rename_input_layer_names_to_trtllm_layer_names(sd, DEFAULT_CONVERSION_DICT)
    assert renamed is sd
    assert sorted(sd) == ["lm_head.weight", "transformer.layers.1.post_layernorm.weight",
                          "transformer.layers.3.attention.qkv.weight"]
    stacked = {"decoder.layers.mlp.linear_fc2.weight": t}
    TRTLLMLayers.rename_input_layer_names_to_trtllm_layer_names(stacked, DEFAULT_CONVERSION_DICT, False)
    assert list(stacked) == ["transformer.layers.mlp.proj.weight"]


@pytest.mark.parametrize(("sd", "mapping", "match"), [
    ({"decoder.layers.mlp.linear_fc2.weight": 0}, DEFAULT_CONVERSION_DICT, "no layer number"),
    ({"decoder.layers.0.mlp.unknown.weight": 0}, DEFAULT_CONVERSION_DICT, "'decoder.layers.mlp.unknown.weight'"),
    ({"output_layer.weight": 0}, {"output_layer.weight": "lm_head.weight"}, "must be a TRTLLMLayers member"),
])
def test_rename_errors(sd: dict, mapping: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TRTLLMLayers.rename_input_layer_names_to_trtllm_layer_names(sd, mapping)


def test_gated_activation() -> None:
    assert GATED_ACTIVATION == ["swiglu", "geglu", "fast-swiglu", "fast-geglu"]
    config = types.SimpleNamespace(gated_linear_unit=False)
    assert is_gated_activation(types.SimpleNamespace(activation="swiglu", transformer_config=config))
    assert not is_gated_activation(types.SimpleNamespace(activation="gelu", transformer_config=config))
    config.gated_linear_unit = True
    assert is_gated_activation(types.SimpleNamespace(activation="gelu", transformer_config=config))


def test_model_type_strings() -> None:
    assert set(TRT_MODEL_TYPE_STRING) == set(ModelType)
    assert TRT_MODEL_TYPE_STRING[ModelType.llama] == "LlamaForCausalLM"
    assert TRT_MODEL_TYPE_STRING[ModelType.nemotron_nas] == "DeciLMForCausalLM"


@pytest.mark.skipif(not HAVE_ORACLE, reason="megatron-core (the oracle) not installed")
def test_names_and_dicts_match_megatron_core() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.export.trtllm import trt_model_type as their_types
        from megatron.core.export.trtllm import trtllm_layers as their_layers
        from megatron.core.export.trtllm.model_to_trllm_mapping import default_conversion_dict as their_dicts
    assert [(m.name, m.value) for m in TRTLLMLayers] == [(m.name, m.value) for m in their_layers.TRTLLMLayers]
    assert NON_TRANSFORMER_LAYERS_NAMES == their_layers.NON_TRANSFORMER_LAYERS_NAMES
    for ours, theirs in ((DEFAULT_CONVERSION_DICT, their_dicts.DEFAULT_CONVERSION_DICT),
                         (NEMOTRON_NAS_CONVERSION_DICT, their_dicts.NEMOTRON_NAS_CONVERSION_DICT)):
        assert {k: v.name for k, v in ours.items()} == {k: v.name for k, v in theirs.items()}
    assert {k.name: v for k, v in TRT_MODEL_TYPE_STRING.items()} == {
        k.name: v for k, v in their_types.TRT_MODEL_TYPE_STRING.items()}
    for name in ("decoder.layers.7.mlp.experts.experts.linear_fc1.weight", "embedding.word_embeddings.weight"):
        assert TRTLLMLayers.return_layer_name_and_number(name) == \
            their_layers.TRTLLMLayers.return_layer_name_and_number(name)
