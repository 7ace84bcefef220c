"""MegatronLLM / MegatronAsyncLLM / StaticInferenceEngine on the tiny Llama: prompt forms, log-probs, streaming, cancel."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_core.inference.apis import MegatronAsyncLLM, MegatronLLM
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import StaticInferenceContext
from megatron_core.inference.engines import StaticInferenceEngine
from megatron_core.inference.inference_request import Status
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from tests.inference.llama_fixture import CharTokenizer, hf_llama, mcore_llama, prompts

pytest.importorskip("transformers")

CONFIG = dict(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=96)
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=6, termination_id=-1)


@pytest.fixture(scope="module")
def pair():
    hf = hf_llama()
    return hf, mcore_llama(hf)


def test_prompt_forms_and_text(pair):
    _, model = pair
    tok = CharTokenizer()
    llm = MegatronLLM(model=model, tokenizer=tok, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    single = llm.generate("hello", GREEDY)
    assert len(single) == 1 and single[0].status == Status.COMPLETED
    assert single[0].generated_text == tok.detokenize(single[0].generated_tokens)
    by_ids = llm.generate(tok.tokenize("hello"), GREEDY)
    assert by_ids[0].generated_tokens == single[0].generated_tokens
    batch = llm.generate(["hello", "a longer prompt here"], GREEDY)
    assert batch[0].generated_tokens == single[0].generated_tokens
    alone = llm.generate("a longer prompt here", GREEDY)[0]
    assert batch[1].generated_tokens == alone.generated_tokens
    assert llm.generate([], GREEDY) == []
    with pytest.raises(ValueError, match="max_sequence_length"):
        llm.generate("x" * 95, GREEDY)
    assert llm.context.block_allocator.get_total_used() == 0


def test_log_probs_match_hf_forward(pair):
    hf, model = pair
    llm = MegatronLLM(model=model, tokenizer=None, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    params = SamplingParams(top_k=1, num_tokens_to_generate=5, termination_id=-1, return_log_probs=True, top_n_logprobs=2)
    prompt = prompts((11,))[0]
    request = llm.generate(prompt, params)[0]
    full = prompt + request.generated_tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], dim=-1)
    expected = [float(ref[i, full[i + 1]]) for i in range(len(full) - 1)]
    assert len(request.prompt_log_probs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(request.prompt_log_probs + request.generated_log_probs),
                               torch.tensor(expected), atol=1e-4, rtol=0)
    assert len(request.generated_top_n_logprobs) == 5 and all(len(d) <= 2 for d in request.generated_top_n_logprobs)


def test_static_engine_matches_dynamic(pair):
    _, model = pair
    wrapper = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=2, max_sequence_length=64))
    engine = StaticInferenceEngine(TextGenerationController(wrapper, tokenizer=None), max_batch_size=2)
    batch = prompts((4, 9, 6))
    results = engine.generate(inference_requests=None, prompts=batch, sampling_params=GREEDY)
    llm = MegatronLLM(model=model, tokenizer=None, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    assert [r.generated_tokens for r in results] == [r.generated_tokens for r in llm.generate(batch, GREEDY)]


def test_static_context_forward_matches_full_forward(pair):
    _, model = pair
    ids = torch.tensor(prompts((7, 7)))
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        full = model(ids, pos, None)
        context = StaticInferenceContext(max_batch_size=2, max_sequence_length=16)
        first = model(ids[:, :5], pos[:, :5], None, inference_context=context)
        context.sequence_len_offset = 5
        rest = model(ids[:, 5:], pos[:, 5:], None, inference_context=context)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)


def test_async_generate_stream_and_cancel(pair):
    _, model = pair
    llm = MegatronAsyncLLM(model=model, tokenizer=None, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    batch = prompts((5, 8, 3))

    async def main():
        results = await llm.generate(batch, GREEDY)
        one = await llm.generate(batch[0], GREEDY)
        streamed = [t async for t, _ in llm.stream(batch[1], GREEDY) if t is not None]
        long = SamplingParams(top_k=1, num_tokens_to_generate=80, termination_id=-1)
        agen = llm.stream(batch[2], long)
        await agen.__anext__()
        used_while_running = llm.context.block_allocator.get_total_used()
        await agen.aclose()  # the consumer goes away: the request is cancelled
        for _ in range(200):
            if llm.context.block_allocator.get_total_used() == 0 and not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        freed = llm.context.block_allocator.get_total_used()
        await llm.shutdown()
        return results, one, streamed, used_while_running, freed

    results, one, streamed, used_while_running, freed = asyncio.run(main())
    assert one.generated_tokens == results[0].generated_tokens
    assert streamed == results[1].generated_tokens
    assert used_while_running > 0 and freed == 0
    assert llm.engine.cancelled_request_count == 1
