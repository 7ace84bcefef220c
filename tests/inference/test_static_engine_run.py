"""StaticInferenceEngine's request-by-request surface (Megatron-Core 0.19's ``add_request`` / ``run_engine`` /
``run_engine_async`` / ``get_stream_generator``) on a tiny GPT, legacy static-batch loop and dynamic engine alike:
batches of at most ``max_batch_size`` give every request the tokens of a plain greedy loop over the model
(full forward on the growing sequence, fp32, CPU); streams yield growing partial results that end with the final
one, equal to the non-streaming result; failing batches retire their requests and raise."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_core.inference.contexts import StaticInferenceContext
from megatron_core.inference.engines import StaticInferenceEngine
from megatron_core.inference.inference_request import Status
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from tests.inference.llama_fixture import MAX_POS, VOCAB, CharTokenizer, mcore_config, prompts

MAX_SEQ, NEW, WAIT_S = 64, 5, 120
LENGTHS = (4, 9, 6, 5, 7)  # five requests, max_batch_size 2: batches of 2, 2, 1


@pytest.fixture(scope="module")
def model() -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(mcore_config(), get_gpt_layer_local_spec(), VOCAB, MAX_POS, position_embedding_type="rope",
                    rotary_base=10000).eval()


@torch.no_grad()
def plain_greedy(model: GPTModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by re-running the whole sequence through the model (no KV cache)."""
    device = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None], None)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def greedy(**extra) -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1, **extra)


def make_engine(model: GPTModel, legacy: bool, batch: int = 2, tokenizer=None) -> StaticInferenceEngine:
    wrapper = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=batch, max_sequence_length=MAX_SEQ))
    return StaticInferenceEngine(TextGenerationController(wrapper, tokenizer=tokenizer), max_batch_size=batch,
                                 legacy=legacy, buffer_size_gb=0.01)


def spy_batches(engine: StaticInferenceEngine) -> list[list]:
    """Record the request ids of every batch the engine runs."""
    batches: list[list] = []
    run_batch = engine._run_batch

    def recording(active, streams):
        batches.append(list(active))
        return run_batch(active, streams)

    engine._run_batch = recording
    return batches


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy", "dynamic"])
def test_run_engine_batches_match_plain_greedy(model, legacy):
    engine = make_engine(model, legacy)
    batch = prompts(LENGTHS)
    ids = [engine.add_request(prompt=p, sampling_params=greedy()) for p in batch]
    assert ids == [0, 1, 2, 3, 4]
    assert list(engine.scheduler.active_request_pool) == [0, 1]
    assert list(engine.scheduler.waiting_request_pool) == [2, 3, 4]
    batches = spy_batches(engine)
    engine.run_engine()
    assert batches == [[0, 1], [2, 3], [4]]
    assert not engine.scheduler.have_requests_pending()
    results = [engine.scheduler.completed_request_pool[i] for i in ids]
    assert all(r.status == Status.COMPLETED for r in results)
    assert [list(r.generated_tokens) for r in results] == [plain_greedy(model, p, NEW) for p in batch]
    assert [r.prompt_tokens for r in results] == batch


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy", "dynamic"])
def test_streams_grow_to_the_final_result(model, legacy):
    tok = CharTokenizer()
    texts = ["hello there", "a", "streams of tokens"]
    params = greedy(return_log_probs=True)

    async def main(engine: StaticInferenceEngine):
        ids = [engine.add_request(prompt=t, sampling_params=params, streaming=True) for t in texts]
        plain = engine.add_request(prompt="no stream", sampling_params=params)
        assert engine.get_stream_generator(plain) is None

        async def collect(request_id):
            return [item async for item in engine.get_stream_generator(request_id)]

        tasks = [asyncio.create_task(collect(i)) for i in ids]
        await asyncio.wait_for(engine.run_engine_async(), WAIT_S)
        return ids, await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)

    engine = make_engine(model, legacy, tokenizer=tok)
    ids, streamed = asyncio.run(main(engine))
    expected = make_engine(model, legacy, tokenizer=tok).generate(prompts=texts, sampling_params=greedy(
        return_log_probs=True))
    for request_id, text, items, reference in zip(ids, texts, streamed, expected):
        final = engine.scheduler.completed_request_pool[request_id]
        assert list(final.generated_tokens) == list(reference.generated_tokens)
        assert list(final.generated_tokens) == plain_greedy(model, tok.tokenize(text), NEW)
        assert final.generated_text == reference.generated_text
        assert [len(item.generated_tokens) for item in items] == list(range(1, NEW + 1))
        for shorter, longer in zip(items, items[1:]):
            assert list(longer.generated_tokens[: len(shorter.generated_tokens)]) == list(shorter.generated_tokens)
        last = items[-1]
        assert all(item.request_id == request_id and item.prompt == text for item in items)
        assert list(last.generated_tokens) == list(final.generated_tokens)
        assert last.generated_text == final.generated_text == tok.detokenize(final.generated_tokens)
        assert last.generated_length == NEW
        torch.testing.assert_close(torch.tensor(last.generated_log_probs), torch.tensor(final.generated_log_probs),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(final.generated_log_probs),
                                   torch.tensor(reference.generated_log_probs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy", "dynamic"])
def test_stream_stops_at_the_termination_token(model, legacy):
    """A row that meets its termination id early: its stream is shorter and ends with the final result."""
    tok = CharTokenizer()
    prompt = prompts((6,), seed=11)[0]
    free = plain_greedy(model, prompt, NEW)
    stop = free[2]  # greedy reaches this token at step 3
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=stop)

    async def main(engine):
        request_id = engine.add_request(prompt=prompt, sampling_params=params, streaming=True)
        reader = asyncio.create_task(_collect(engine, request_id))
        await asyncio.wait_for(engine.run_engine_async(), WAIT_S)
        return request_id, await asyncio.wait_for(reader, WAIT_S)

    engine = make_engine(model, legacy, tokenizer=tok)
    request_id, items = asyncio.run(main(engine))
    final = engine.scheduler.completed_request_pool[request_id]
    assert free.index(stop) == 2
    assert list(items[-1].generated_tokens) == list(final.generated_tokens)
    assert items[-1].generated_text == final.generated_text == tok.detokenize(free[:2])
    assert len(items) == len(final.generated_tokens)


async def _collect(engine, request_id):
    return [item async for item in engine.get_stream_generator(request_id)]


def test_failed_batch_retires_its_requests_and_later_ones_still_run(model):
    """max_batch_size 1: the bad first request raises and fails; the next run serves the good one."""

    async def main(engine):
        bad = engine.add_request(prompt=prompts((4,))[0], sampling_params=greedy(top_n_logprobs=2), streaming=True)
        good = engine.add_request(prompt=prompts((5,))[0], sampling_params=greedy())
        reader = asyncio.create_task(_collect(engine, bad))
        with pytest.raises(ValueError, match=r"top_n_logprobs \(2\)"):
            await asyncio.wait_for(engine.run_engine_async(), WAIT_S)
        with pytest.raises(ValueError, match=r"top_n_logprobs \(2\)"):
            await asyncio.wait_for(reader, WAIT_S)
        return bad, good

    engine = make_engine(model, legacy=True, batch=1)
    bad, good = asyncio.run(main(engine))
    assert engine.scheduler.completed_request_pool[bad].status == Status.FAILED
    assert list(engine.scheduler.active_request_pool) == [good]
    engine.run_engine()
    result = engine.scheduler.completed_request_pool[good]
    assert list(result.generated_tokens) == plain_greedy(model, prompts((5,))[0], NEW)


def test_failed_generate_leaves_nothing_pending(model):
    engine = make_engine(model, legacy=True, batch=1)
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        engine.generate(prompts=[prompts((3,))[0], [], prompts((4,))[0]], sampling_params=greedy())
    assert not engine.scheduler.have_requests_pending()
    assert [r.status for r in engine.scheduler.completed_request_pool.values()] == [Status.COMPLETED] + \
        [Status.FAILED] * 2
    again = engine.generate(prompts=[prompts((4,))[0]], sampling_params=greedy())
    assert list(again[0].generated_tokens) == plain_greedy(model, prompts((4,))[0], NEW)


def test_dynamic_batch_with_a_refused_request_raises_and_cleans_up(model):
    engine = make_engine(model, legacy=False)
    engine.add_request(prompt=prompts((4,))[0], sampling_params=greedy())
    engine.add_request(prompt=prompts((MAX_SEQ + 4,))[0], sampling_params=greedy())
    with pytest.raises(ValueError, match="max_sequence_length"):
        engine.run_engine()
    assert not engine.dynamic_engine.has_unfinished_requests()
    assert [r.status for r in engine.scheduler.completed_request_pool.values()] == [Status.FAILED] * 2
    request_id = engine.add_request(prompt=prompts((6,))[0], sampling_params=greedy())
    engine.run_engine()
    assert list(engine.scheduler.completed_request_pool[request_id].generated_tokens) == \
        plain_greedy(model, prompts((6,))[0], NEW)


def test_bad_input(model):
    engine = make_engine(model, legacy=True)
    with pytest.raises(ValueError, match="unknown request_id 42"):
        engine.get_stream_generator(42)
    with pytest.raises(ValueError, match="needs a prompt or an inference_request"):
        engine.add_request()
    with pytest.raises(ValueError, match="an encoder_prompt needs an EncoderDecoderTextGenerationController"):
        engine.add_request(prompt=[1, 2], encoder_prompt="x")
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        engine.add_request(prompt="text without a tokenizer")
    assert not engine.scheduler.requests


def test_streaming_after_its_loop_closed_raises_clearly(model):
    """A streaming request added inside one ``asyncio.run`` whose loop is gone when the engine runs."""
    engine = make_engine(model, legacy=True)

    async def add():
        return engine.add_request(prompt=prompts((4,))[0], sampling_params=greedy(), streaming=True)

    request_id = asyncio.run(add())
    with pytest.raises(RuntimeError, match=f"cannot stream request {request_id}: its event loop was closed"):
        engine.run_engine()
    assert engine.scheduler.completed_request_pool[request_id].status == Status.FAILED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("legacy", [True, False], ids=["legacy", "dynamic"])
def test_run_engine_async_on_cuda(model, legacy):
    """The executor thread runs on the wrapper's CUDA device; the streamed tokens match the plain loop there."""
    cuda_model = GPTModel(mcore_config(), get_gpt_layer_local_spec(), VOCAB, MAX_POS, position_embedding_type="rope",
                          rotary_base=10000).eval()
    cuda_model.load_state_dict(model.state_dict())
    cuda_model = cuda_model.cuda()
    batch = prompts(LENGTHS)

    async def main(engine):
        ids = [engine.add_request(prompt=p, sampling_params=greedy(), streaming=True) for p in batch]
        readers = [asyncio.create_task(_collect(engine, i)) for i in ids]
        await asyncio.wait_for(engine.run_engine_async(), WAIT_S)
        return ids, await asyncio.wait_for(asyncio.gather(*readers), WAIT_S)

    engine = make_engine(cuda_model, legacy)
    ids, streamed = asyncio.run(main(engine))
    for request_id, prompt, items in zip(ids, batch, streamed):
        expected = plain_greedy(cuda_model, prompt, NEW)
        assert list(engine.scheduler.completed_request_pool[request_id].generated_tokens) == expected
        assert list(items[-1].generated_tokens) == expected
