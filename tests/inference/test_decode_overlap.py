"""Decode steps that overlap host and device work give the tokens of stepping one at a time (CPU, padded layout)."""

from __future__ import annotations

import pytest

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.inference_request import Status
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from tests.inference.llama_fixture import hf_greedy, hf_llama, mcore_llama, prompts

pytest.importorskip("transformers")

LENGTHS = (5, 17, 9, 30, 3, 12)
NEW = (3, 11, 6, 9, 14, 1)


@pytest.fixture(scope="module")
def models():
    hf = hf_llama()
    return hf, mcore_llama(hf)


def _engine(model, overlap: bool, **config) -> DynamicInferenceEngine:
    settings = dict(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, num_cuda_graphs=4, max_requests=4)
    settings.update(config)
    context = DynamicInferenceContext(model.config, InferenceConfig(**settings))
    context.pad_decode_steps_on_cpu = True  # the CUDA-graph layout, run eagerly
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)
    engine.overlap_decode_steps = overlap
    return engine


def _run(engine, batch, params, cancel: tuple[int, int] | None = None):
    futures = [engine.add_request(i, p, sp) for i, (p, sp) in enumerate(zip(batch, params))]
    steps = 0
    while not all(f.done() for f in futures):
        engine.step_modern()
        steps += 1
        if cancel is not None and steps == cancel[1]:
            engine.cancel_request(cancel[0])
    results = [f.result(timeout=60) for f in futures]
    assert engine.context.block_allocator.get_total_used() == 0
    assert engine._inflight is None
    return [(r.generated_tokens, r.finish_reason, r.status) for r in results]


def _greedy(new: tuple[int, ...], termination_id: int = -1) -> list[SamplingParams]:
    return [SamplingParams(top_k=1, num_tokens_to_generate=n, termination_id=termination_id) for n in new]


def test_overlapped_greedy_matches_hf_and_one_step_at_a_time(models):
    hf, model = models
    batch = prompts(LENGTHS)
    engine = _engine(model, overlap=True)
    got = _run(engine, batch, _greedy(NEW))
    assert engine.overlapped_step_count > 10  # most decode steps ran overlapped
    assert [tokens for tokens, _, _ in got] == [hf_greedy(hf, p, n) for p, n in zip(batch, NEW)]
    assert got == _run(_engine(model, overlap=False), batch, _greedy(NEW))
    assert all(reason == "length" for _, reason, _ in got)


def test_termination_token_mid_overlap_drops_the_extra_row(models):
    _, model = models
    batch = prompts(LENGTHS)
    long = (12,) * len(batch)
    free_run = _run(_engine(model, overlap=False), batch, _greedy(long))
    stop = free_run[1][0][4]  # request 1's fifth token ends every request that produces it
    expected = _run(_engine(model, overlap=False), batch, _greedy(long, stop))
    engine = _engine(model, overlap=True)
    got = _run(engine, batch, _greedy(long, stop))
    assert got == expected
    assert engine.overlapped_step_count > 0 and engine.dropped_row_count > 0
    stopped = [tokens for tokens, reason, _ in got if reason == "stop"]
    assert stopped and all(tokens[-1] == stop and stop not in tokens[:-1] for tokens in stopped)


def test_cancel_during_overlapped_decoding(models):
    _, model = models
    batch = prompts(LENGTHS[:4])
    params = _greedy((20, 20, 20, 20))
    expected = _run(_engine(model, overlap=False), batch, params)
    engine = _engine(model, overlap=True)
    got = _run(engine, batch, params, cancel=(2, 6))
    assert got[2][2] == Status.FAILED
    assert [g for i, g in enumerate(got) if i != 2] == [e for i, e in enumerate(expected) if i != 2]
    assert engine.cancelled_request_count == 1 and engine.dropped_row_count == 1


def test_overlap_with_evictions(models):
    _, model = models
    batch = prompts(LENGTHS[:4])
    # 2 layers * 2 groups * 16 dims * 4 bytes * 2 (k, v) = 512 bytes per token; 8-token blocks: 4 KiB each.
    config = dict(buffer_size_gb=6 * 4096 / 1024**3)
    params = _greedy((12, 12, 12, 12))
    engine = _engine(model, overlap=True, **config)
    got = _run(engine, batch, params)
    assert engine.evicted_request_count > 0 and engine.overlapped_step_count > 0
    assert got == _run(_engine(model, overlap=False, max_requests=4, **config), batch, params)


def test_overlapped_sampling_reproduces(models):
    _, model = models
    batch = prompts(LENGTHS)
    params = [SamplingParams(top_k=8, temperature=1.3, num_tokens_to_generate=n, termination_id=-1) for n in NEW]
    first = _run(_engine(model, overlap=True), batch, params)
    assert first == _run(_engine(model, overlap=True), batch, params)


def test_log_prob_requests_are_not_overlapped(models):
    _, model = models
    batch = prompts(LENGTHS[:3])
    params = [SamplingParams(top_k=1, num_tokens_to_generate=5, termination_id=-1, return_log_probs=True)] * 3
    engine = _engine(model, overlap=True)
    futures = [engine.add_request(i, p, sp) for i, (p, sp) in enumerate(zip(batch, params))]
    while not all(f.done() for f in futures):
        engine.step_modern()
    assert engine.overlapped_step_count == 0
    assert all(len(f.result(timeout=60).generated_log_probs) == 5 for f in futures)


@pytest.mark.gpu
def test_overlapped_cuda_graph_decode_matches_hf_and_drops_rows_after_a_stop(models):
    """On a GPU the next step really is queued before the previous step's tokens are read (pinned copies, events)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf, model = models
    batch = prompts(LENGTHS)
    model = model.cuda()
    try:
        def run(overlap: bool, new: tuple[int, ...], termination_id: int = -1):
            context = DynamicInferenceContext(model.config, InferenceConfig(
                block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, num_cuda_graphs=4, max_requests=4))
            engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None),
                                            context)
            engine.overlap_decode_steps = overlap
            return engine, _run(engine, batch, _greedy(new, termination_id))

        engine, got = run(True, NEW)
        assert engine.overlapped_step_count > 10 and engine.controller.inference_wrapped_model.decode_graphs.graphs
        assert [tokens for tokens, _, _ in got] == [hf_greedy(hf, p, n) for p, n in zip(batch, NEW)]
        long = (12,) * len(batch)
        stop = run(False, long)[1][1][0][4]
        engine, stopped = run(True, long, stop)
        assert stopped == run(False, long, stop)[1] and engine.dropped_row_count > 0
    finally:
        model.cpu()


def test_reset_with_a_step_in_flight_forgets_it(models):
    _, model = models
    engine = _engine(model, overlap=True)
    params = _greedy((20, 20))
    for i, prompt in enumerate(prompts(LENGTHS[:2])):
        engine.add_request(i, prompt, params[i])
    for _ in range(4):
        engine.step_modern()
    assert engine._inflight is not None
    engine.reset()
    assert engine._inflight is None and engine.context.block_allocator.get_total_used() == 0
    assert _run(engine, prompts(LENGTHS[:2]), params) == _run(_engine(model, overlap=False), prompts(LENGTHS[:2]), params)
