"""Prefix caching in the dynamic engine: shared prompt blocks give the same tokens as computing them (CPU, fp32).

Requests whose prompts share a long prefix reuse its KV blocks (reference-counted) instead of
prefilling it again, under both eviction policies; greedy outputs equal Hugging Face's and the run
without caching, with fewer prefill tokens computed. ``REF_ZERO`` frees a block when its last holder
leaves; ``LRU`` keeps it for later requests until an allocation needs the room.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.inference_request import compute_block_hashes_batched
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from tests.inference.llama_fixture import hf_greedy, hf_llama, mcore_llama, prompts

pytest.importorskip("transformers")

NEW = 6


@pytest.fixture(scope="module")
def models():
    hf = hf_llama()
    return hf, mcore_llama(hf)


def _shared_prefix_prompts() -> list[list[int]]:
    system = prompts([21], seed=11)[0]  # 2 full 8-token blocks + 5 tokens
    tails = prompts([3, 9, 1, 12], seed=12)
    return [system + tail for tail in tails]


def _engine(model, caching: bool, policy: str = "ref_zero", **config) -> DynamicInferenceEngine:
    settings = dict(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, max_requests=8)
    settings.update(config)
    context = DynamicInferenceContext(model.config, InferenceConfig(
        enable_prefix_caching=caching, prefix_caching_eviction_policy=policy, **settings))
    return DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)


def _greedy(engine, batch, stagger: bool = False) -> list[list[int]]:
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    if not stagger:
        return [r.merge().generated_tokens for r in engine.generate(batch, params)]
    futures = []
    for i, prompt in enumerate(batch):  # one new request per step: later ones find the earlier ones' blocks
        futures.append(engine.add_request(i, prompt, params))
        engine.step_modern()
    while not all(f.done() for f in futures):
        engine.step_modern()
    return [f.result(timeout=60).generated_tokens for f in futures]


@pytest.mark.parametrize("policy", ["ref_zero", "lru"])
def test_shared_prefix_matches_hf_and_skips_its_prefill(models, policy):
    hf, model = models
    batch = _shared_prefix_prompts()
    expected = [hf_greedy(hf, p, NEW) for p in batch]
    engine = _engine(model, True, policy)
    assert _greedy(engine, batch, stagger=True) == expected
    ctx = engine.context
    assert ctx.prefix_cache_hits == 3 and ctx.prefix_cache_prefill_skipped_tokens == 3 * 16
    assert ctx.block_allocator.get_total_used() == 0
    cached = ctx.block_allocator.get_cached_count()
    assert cached == (0 if policy == "ref_zero" else len(ctx.block_allocator.kv_hash_to_block_id)) and (
        policy == "ref_zero" or cached >= 2)
    assert _greedy(_engine(model, False), batch, stagger=True) == expected


def test_lru_keeps_released_prefixes_for_later_requests_and_ref_zero_does_not(models):
    _, model = models
    first, second = _shared_prefix_prompts()[:2]
    for policy, hits in (("ref_zero", 0), ("lru", 1)):
        engine = _engine(model, True, policy)
        a = _greedy(engine, [first])
        b = _greedy(engine, [second])  # after the first has finished and released its blocks
        assert engine.context.prefix_cache_hits == hits, policy
        assert a + b == _greedy(_engine(model, False), [first, second])


def test_whole_cached_prompt_still_computes_its_last_token(models):
    hf, model = models
    prompt = prompts([16], seed=5)[0]  # exactly two blocks
    engine = _engine(model, True, "lru")
    assert _greedy(engine, [prompt]) == [hf_greedy(hf, prompt, NEW)]
    assert _greedy(engine, [prompt]) == [hf_greedy(hf, prompt, NEW)]
    # The second request shares only the first block: the block holding the last prompt token is computed.
    assert engine.context.prefix_cache_prefill_skipped_tokens == 8


def test_lru_evicts_cached_blocks_when_memory_is_short(models):
    _, model = models
    # 2 layers * 2 groups * 16 dims * 4 bytes * 2 (k, v) = 512 bytes per token; 8-token blocks: 4 KiB each.
    batch = prompts([20, 18, 23, 17, 22], seed=21)  # distinct prefixes, 3-4 blocks each with the output
    engine = _engine(model, True, "lru", buffer_size_gb=5 * 4096 / 1024**3)
    got = [_greedy(engine, [p])[0] for p in batch]
    alloc = engine.context.block_allocator
    assert alloc.get_total_used() == 0 and 0 < alloc.get_cached_count() <= alloc.total_count
    assert alloc.match_prefix(compute_block_hashes_batched(batch[0], 8)) == []  # evicted to make room
    assert got == _greedy(_engine(model, False), batch)


def test_prefix_caching_with_chunked_prefill_and_overlapped_padded_decode(models):
    hf, model = models
    batch = _shared_prefix_prompts()
    engine = _engine(model, True, "lru", enable_chunked_prefill=True, max_tokens=7, num_cuda_graphs=4,
                     async_sched_mode="async")
    engine.context.pad_decode_steps_on_cpu = True  # the CUDA-graph decode layout, overlapped
    assert _greedy(engine, batch, stagger=True) == [hf_greedy(hf, p, NEW) for p in batch]
    assert engine.context.prefix_cache_hits > 0 and engine.overlapped_step_count > 0


def test_allocator_reference_counts_and_policies():
    alloc = KVBlockAllocator(4, enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
    a = alloc.allocate_memory_blocks(2)
    alloc.register_kv_block_hashes(a, [11, 22])
    assert alloc.match_prefix([11, 22, 33]) == a and alloc.match_prefix([22]) == [a[1]] and alloc.match_prefix([9]) == []
    alloc.pin(a[:1])  # a second holder of the first block
    alloc.release_memory_blocks(a)
    assert alloc.ref_count(a[0]) == 1 and alloc.get_cached_count() == 1 and alloc.get_active_avail() == 3
    alloc.release_memory_blocks(a[:1])
    assert alloc.get_total_used() == 0 and alloc.get_cached_count() == 2
    assert alloc.allocate_memory_blocks(3) is not None  # evicts the least recently released cached block
    assert alloc.get_cached_count() == 1 and alloc.match_prefix([11]) == [a[0]] and alloc.match_prefix([22]) == []
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release_memory_blocks([a[0]])
    with pytest.raises(ValueError, match="prefix_caching_eviction_policy"):
        KVBlockAllocator(4, enable_prefix_caching=True, prefix_caching_eviction_policy="fifo")
    ref_zero = KVBlockAllocator(2, enable_prefix_caching=True)
    b = ref_zero.allocate_memory_blocks(1)
    ref_zero.register_kv_block_hashes(b, [5])
    ref_zero.release_memory_blocks(b)
    assert ref_zero.match_prefix([5]) == [] and ref_zero.get_active_avail() == 2


def test_block_hashes_cover_the_whole_prefix():
    a = compute_block_hashes_batched(list(range(10)), 4)
    assert len(a) == 2 and all(1 <= h < 2**63 for h in a)
    assert compute_block_hashes_batched(list(range(8)) + [7, 7], 4) == a
    changed_first = compute_block_hashes_batched([99] + list(range(1, 10)), 4)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # the second block's hash covers the first
    assert compute_block_hashes_batched(torch.arange(3), 4) == []


@pytest.mark.gpu
def test_prefix_caching_with_cuda_graph_decode_matches_hf(models):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf, model = models
    batch = _shared_prefix_prompts()
    model = model.cuda()
    try:
        engine = _engine(model, True, "lru", num_cuda_graphs=4, async_sched_mode="async")
        assert _greedy(engine, batch, stagger=True) == [hf_greedy(hf, p, NEW) for p in batch]
        assert engine.context.prefix_cache_hits == 3 and engine.overlapped_step_count > 0
    finally:
        model.cpu()
