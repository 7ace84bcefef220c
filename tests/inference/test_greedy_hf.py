"""Greedy generation through the dynamic engine equals Hugging Face ``generate`` token for token (fp32, CPU)."""

from __future__ import annotations

import pytest

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from tests.inference.llama_fixture import hf_greedy, hf_llama, mcore_llama, prompts

pytest.importorskip("transformers")

NEW = 12  # tokens generated per prompt


@pytest.fixture(scope="module")
def models():
    hf = hf_llama()
    model = mcore_llama(hf)
    batch = prompts()
    expected = [hf_greedy(hf, p, NEW) for p in batch]
    return model, batch, expected


def _engine(model, **config):
    context = DynamicInferenceContext(model.config, InferenceConfig(**config))
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None)
    return DynamicInferenceEngine(controller, context)


def _greedy(engine, batch):
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    records = engine.generate(batch, params)
    return [r.merge().generated_tokens for r in records]


def test_batched_greedy_matches_hf(models):
    model, batch, expected = models
    engine = _engine(model, block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=128)
    assert _greedy(engine, batch) == expected
    assert engine.context.block_allocator.get_total_used() == 0


def test_greedy_with_eviction_matches_hf(models):
    model, batch, expected = models
    # 2 layers * 2 groups * 16 dims * 4 bytes * 2 (k, v) = 512 bytes per token; 8-token blocks: 4 KiB each.
    blocks = 6  # the longest request alone needs 6 blocks; the first three together need 10
    engine = _engine(model, block_size_tokens=8, buffer_size_gb=blocks * 4096 / 1024**3, max_sequence_length=64)
    assert engine.context.total_block_count == blocks
    assert _greedy(engine, batch) == expected
    assert engine.evicted_request_count > 0
    assert engine.context.block_allocator.get_total_used() == 0


def test_greedy_with_chunked_prefill_matches_hf(models):
    model, batch, expected = models
    engine = _engine(
        model, block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=128, max_tokens=7,
        max_requests=3, enable_chunked_prefill=True,
    )
    assert _greedy(engine, batch) == expected


def test_padded_decode_layout_matches_hf(models):
    """The CUDA-graph layout (decode batches padded to fixed sizes, scratch block) run eagerly on CPU."""
    model, batch, expected = models
    engine = _engine(model, block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, num_cuda_graphs=4,
                     max_requests=3)
    engine.context.pad_decode_steps_on_cpu = True
    assert _greedy(engine, batch) == expected
    assert set(engine.context.graph_inputs) <= {1, 2, 3} and engine.context.graph_inputs


def test_compiled_padded_decode_matches_hf(models):
    """The forward that decode graphs capture, torch.compile'd, on the CUDA-graph layout (CPU, no graphs)."""
    model, batch, expected = models
    engine = _engine(model, block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, num_cuda_graphs=4,
                     max_requests=3, compile_decode_graphs=True)
    engine.context.pad_decode_steps_on_cpu = True
    assert engine.controller.inference_wrapped_model.compile_decode_graphs
    assert _greedy(engine, batch) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-graphs", "compiled-graphs"])
def test_cuda_graph_decode_matches_hf(models, compiled):
    """CUDA-graph decode steps (capturing the eager or the torch.compile'd forward) give HF's tokens."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, batch, expected = models
    model = model.cuda()
    try:
        engine = _engine(model, block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, num_cuda_graphs=4,
                         compile_decode_graphs=compiled)
        assert _greedy(engine, batch) == expected
        assert engine.controller.inference_wrapped_model.decode_graphs.graphs
        if not compiled:
            eager = _engine(model, block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64)
            assert _greedy(eager, batch) == expected
    finally:
        model.cpu()
