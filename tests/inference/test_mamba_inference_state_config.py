"""MambaInferenceStateConfig: Megatron-Core 0.19's fields and defaults, validation, and ``from_model``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_core.inference.config import MambaInferenceStateConfig
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from tests.models.mamba.mamba_test_utils import build, config


def _valid(**overrides: object) -> MambaInferenceStateConfig:
    kwargs = dict(layer_type_list=["M", "*", "-"], conv_states_shape=(48, 4), ssm_states_shape=(4, 8, 8),
                  conv_states_dtype=torch.float32, ssm_states_dtype=torch.bfloat16)
    return MambaInferenceStateConfig(**{**kwargs, **overrides})


def test_fields_and_defaults_match_megatron() -> None:
    """Field names and order as Megatron-Core 0.19; only mamba_chunk_size has a default (128)."""
    fields = dataclasses.fields(MambaInferenceStateConfig)
    assert [f.name for f in fields] == ["layer_type_list", "conv_states_shape", "ssm_states_shape",
                                        "conv_states_dtype", "ssm_states_dtype", "mamba_chunk_size"]
    assert [f.default for f in fields if f.default is not dataclasses.MISSING] == [128]
    cfg = _valid(conv_states_shape=[48, 4])
    assert cfg.conv_states_shape == (48, 4) and cfg.mamba_chunk_size == 128


@pytest.mark.parametrize("overrides, field", [
    (dict(layer_type_list=["M", "Q"]), "layer_type_list"),
    (dict(layer_type_list="M*-"), "layer_type_list"),
    (dict(conv_states_shape=(48, 0)), "conv_states_shape"),
    (dict(ssm_states_shape=()), "ssm_states_shape"),
    (dict(ssm_states_shape=(4, 8.0, 8)), "ssm_states_shape"),
    (dict(conv_states_dtype="float32"), "conv_states_dtype"),
    (dict(ssm_states_dtype=torch.int32), "ssm_states_dtype"),
    (dict(mamba_chunk_size=0), "mamba_chunk_size"),
    (dict(mamba_chunk_size=True), "mamba_chunk_size"),
])
def test_invalid_values_name_the_field(overrides: dict, field: str) -> None:
    """Each bad value raises ValueError naming the field."""
    with pytest.raises(ValueError, match=f"MambaInferenceStateConfig.{field}"):
        _valid(**overrides)


def test_from_model_reads_the_hybrid_decoder() -> None:
    """Shapes from the first Mamba layer, the mixer's chunk size, dtypes from params_dtype unless given."""
    model = build("*M-M")
    mixer = model.decoder.layers[1].mixer
    cfg = MambaInferenceStateConfig.from_model(model)
    assert cfg.layer_type_list == ["*", "M", "-", "M"]
    # conv state: the depthwise conv's channels (x, B, C) by its kernel; SSM state: heads x head_dim x d_state.
    assert cfg.conv_states_shape == (mixer.conv1d_weight.shape[0], mixer.d_conv) == (16 * 2 + 2 * 2 * 8, 4)
    assert cfg.ssm_states_shape == (4, 8, 8)
    assert (cfg.conv_states_dtype, cfg.ssm_states_dtype, cfg.mamba_chunk_size) == (torch.float32, torch.float32,
                                                                                  mixer.chunk_size)
    typed = MambaInferenceStateConfig.from_model(model, ssm_states_dtype=torch.float16)
    assert (typed.conv_states_dtype, typed.ssm_states_dtype) == (torch.float32, torch.float16)


def test_from_model_is_none_without_mamba_layers() -> None:
    """A GPT model (no layer_type_list) and a hybrid without Mamba layers give None."""
    gpt = GPTModel(config("**"), get_gpt_layer_local_spec(), 64, 32)
    assert MambaInferenceStateConfig.from_model(gpt) is None
    assert MambaInferenceStateConfig.from_model(build("*-")) is None
