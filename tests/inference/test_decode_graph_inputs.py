"""The fixed-address inputs of padded decode steps (``DecodeGraphInputs``), on CPU."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.config import CudaGraphSizingDistribution, InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.contexts.decode_graph_inputs import DecodeGraphInputs, graph_batch_sizes
from megatron_core.transformer import TransformerConfig


def test_fill_pads_rows_and_reuses_unchanged_tables() -> None:
    inputs = DecodeGraphInputs(batch=4, width=3, block_size=2, scratch_block=9, device=torch.device("cpu"))
    addresses = [t.data_ptr() for t in (inputs.input_ids, inputs.tables, inputs.mask)]
    inputs.fill([5, 6], [2, 3], [12, 7], [[6, 1], [3, 4]], tables_key=(1, ("a", "b")))
    assert inputs.input_ids.tolist() == [[5, 6, 0, 0]]
    assert inputs.kv_len.tolist() == [3, 4, 1, 1]
    assert inputs.slot_mapping.tolist() == [12, 7, 18, 18]  # padding rows write into the scratch block
    assert inputs.tables.tolist() == [[6, 1, 9], [3, 4, 9], [9, 9, 9], [9, 9, 9]]
    assert inputs.mask[:, 0, 0].sum(dim=1).tolist() == [3, 4, 1, 1]

    # Same key: the header changes, the tables are not copied again (their contents are the same by contract).
    inputs.fill([7, 8], [3, 4], [13, 8], [[0, 0], [0, 0]], tables_key=(1, ("a", "b")))
    assert inputs.input_ids.tolist() == [[7, 8, 0, 0]] and inputs.kv_len.tolist() == [4, 5, 1, 1]
    assert inputs.tables.tolist()[:2] == [[6, 1, 9], [3, 4, 9]]

    # A new key (a block was added, or other requests): the tables are copied.
    inputs.fill([7, 8], [4, 5], [2, 8], [[6, 1, 2], [3, 4]], tables_key=(2, ("a", "b")))
    assert inputs.tables.tolist()[:2] == [[6, 1, 2], [3, 4, 9]]
    assert [t.data_ptr() for t in (inputs.input_ids, inputs.tables, inputs.mask)] == addresses


def test_take_tokens_gathers_the_previous_steps_samples_in_place() -> None:
    inputs = DecodeGraphInputs(batch=4, width=2, block_size=2, scratch_block=5, device=torch.device("cpu"))
    address = inputs.input_ids.data_ptr()
    inputs.fill([0, 0, 0], [4, 1, 2], [8, 3, 4], [[1, 4], [2], [3]], source_rows=[2, 0, 1])
    inputs.take_tokens(torch.tensor([10, 11, 12, 13]))
    assert inputs.input_ids.tolist() == [[12, 10, 11, 10]]  # the padding row reads row 0
    assert inputs.input_ids.data_ptr() == address
    assert inputs.position_ids.tolist() == [[4, 1, 2, 0]] and inputs.kv_len.tolist() == [5, 2, 3, 1]


def test_graph_batch_sizes_of_both_distributions() -> None:
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(40, "linear") == [1, 2, 4, 8, 16, 24, 32, 40]
    linear = graph_batch_sizes(300, "linear")
    assert linear[:5] == [1, 2, 4, 8, 16] and linear[-4:] == [256, 272, 288, 300]
    assert all(b % 8 == 0 for b in linear[3:-5]) and all(b % 16 == 0 for b in linear[-4:-1])
    assert linear == sorted(set(linear))
    with pytest.raises(ValueError, match="'cubic'"):
        graph_batch_sizes(8, "cubic")


def test_the_context_captures_the_configured_sizes() -> None:
    model_config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    settings = dict(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, num_cuda_graphs=8,
                    max_requests=40)
    linear = DynamicInferenceContext(model_config, InferenceConfig(**settings, cuda_graph_sizing_distribution="linear"))
    assert linear.graph_sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    default = DynamicInferenceContext(model_config, InferenceConfig(**settings))
    assert default.graph_sizes == [1, 2, 4, 8, 16, 32, 40]
    assert InferenceConfig(**settings).cuda_graph_sizing_distribution is CudaGraphSizingDistribution.EXPONENTIAL
    with pytest.raises(ValueError, match="cuda_graph_sizing_distribution"):
        InferenceConfig(**settings, cuda_graph_sizing_distribution="cubic")
