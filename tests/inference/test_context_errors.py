"""The dynamic context's errors (Megatron-Core 0.19's names): transience, messages and the plain-data round trip."""

from __future__ import annotations

import pickle

import pytest

from megatron_core.inference.contexts import dynamic_context as dc


def test_max_sequence_length_overflow_is_permanent_and_a_token_overflow():
    error = dc.MaxSequenceLengthOverflowError(7, "too long")
    assert not error.is_transient and isinstance(error, dc.TokenOverflowError)
    assert str(error) == "request 7 | too long"


def test_active_request_count_overflow_names_both_counts():
    error = dc.ActiveRequestCountOverflowError(4, 6)
    assert error.request_id is None and "active_request_count (6) > max_request_count (4)" in str(error)
    with pytest.raises(ValueError, match="needs active_request_count"):
        dc.ActiveRequestCountOverflowError(4, 4)


@pytest.mark.parametrize("error", [
    dc.ContextOverflowError(1, "a", is_transient=False), dc.RequestOverflowError(2), dc.BlockOverflowError(3, "b"),
    dc.MaxSequenceLengthOverflowError(4, "c"), dc.ActiveRequestCountOverflowError(1, 2),
    dc.TensorStateDeallocatedError(None, "suspended"),
])
def test_factory_round_trips_through_plain_data(error):
    data = dc.ContextErrorFactory.serialize(error)
    again = dc.ContextErrorFactory.deserialize(pickle.loads(pickle.dumps(data)))
    assert type(again) is type(error)
    assert (again.request_id, again.message, again.is_transient, str(again)) == \
           (error.request_id, error.message, error.is_transient, str(error))


def test_factory_refuses_unknown_types():
    with pytest.raises(ValueError, match="unknown error type 'Nope'"):
        dc.ContextErrorFactory.deserialize({"type": "Nope", "request_id": 1})
    with pytest.raises(TypeError):
        dc.ContextErrorFactory.serialize(ValueError("x"))


def test_context_raises_max_sequence_length_overflow():
    from megatron_core.inference.config import InferenceConfig
    from megatron_core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    context = dc.DynamicInferenceContext(config, InferenceConfig(block_size_tokens=8, buffer_size_gb=0.001,
                                                                 max_sequence_length=16))
    context.add_request("r")
    assert context.grow_request("r", 16)
    with pytest.raises(dc.MaxSequenceLengthOverflowError, match="17 tokens exceed max_sequence_length"):
        context.grow_request("r", 17)
