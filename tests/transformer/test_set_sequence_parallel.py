"""transformer.utils: set_model_to_sequence_parallel and is_layer_window_attention's error (Megatron-Core 0.19)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.utils import is_layer_window_attention, set_model_to_sequence_parallel


def _model(position_embedding_type="rope"):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8,
                    position_embedding_type=position_embedding_type)


def _flags(model, attr):
    return {name: getattr(m, attr) for name, m in model.named_modules() if hasattr(m, attr)}


def test_switches_every_sequence_parallel_attribute():
    model = _model()
    assert _flags(model, "sequence_parallel")
    set_model_to_sequence_parallel(model, set_to=True)
    assert model.config.sequence_parallel is True
    for attr in ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings"):
        assert all(_flags(model, attr).values()), attr
    set_model_to_sequence_parallel(model, set_to=False, exclude_modules=[model.decoder])
    assert model.config.sequence_parallel is False
    flags = _flags(model, "sequence_parallel")
    assert all(v for k, v in flags.items() if k.startswith("decoder"))
    assert not any(v for k, v in flags.items() if not k.startswith("decoder"))


def test_learned_absolute_keeps_reduce_scatter_embeddings():
    model = _model("learned_absolute")
    before = _flags(model, "reduce_scatter_embeddings")
    set_model_to_sequence_parallel(model, set_to=True)
    assert _flags(model, "reduce_scatter_embeddings") == before


def test_invalid_skip_frequency_names_type_and_value():
    with pytest.raises(ValueError, match=r"Invalid `window_attn_skip_freq`: str 'invalid'"):
        is_layer_window_attention((10, 0), "invalid", 1)
    assert torch.tensor([is_layer_window_attention((4, 0), 2, n) for n in (1, 2)]).tolist() == [True, False]
