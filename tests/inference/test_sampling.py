"""Sampling: top-k / top-p distributions against their definitions, and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.apis import MegatronLLM
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.sampling import filter_logits, sample_from_logits
from megatron_core.inference.sampling_params import SamplingParams
from tests.inference.llama_fixture import mcore_llama, prompts

LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
DRAWS = 40000


def _reference(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The textbook distribution: softmax(logits / T) restricted to the top-k set or the nucleus, renormalised."""
    probs = torch.softmax(LOGITS / temperature, dim=0)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if top_k:
        keep[order[:top_k]] = True
    elif top_p:
        total = 0.0
        for index in order.tolist():  # smallest prefix whose mass reaches p
            keep[index] = True
            total += float(probs[index])
            if total >= top_p:
                break
    else:
        keep[:] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.0), (0.7, 3, 0.0), (1.3, 5, 0.0), (1.0, 0, 0.6), (0.8, 0, 0.9)])
def test_empirical_distribution_matches_definition(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = LOGITS.expand(DRAWS, -1)
    samples = sample_from_logits(logits, temperature, top_k, top_p, gen)
    freq = torch.bincount(samples, minlength=LOGITS.numel()).float() / DRAWS
    expected = _reference(temperature, top_k, top_p)
    assert torch.all(freq[expected == 0] == 0), (freq, expected)
    # 5 standard errors of a Bernoulli frequency at 40k draws is at most ~0.0125.
    torch.testing.assert_close(freq, expected, atol=0.0125, rtol=0)


def test_filter_keeps_the_crossing_token_and_ties():
    out = filter_logits(torch.tensor([[1.0, 1.0, 0.0, -1.0]]), 1.0, 2, 0.0)
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    probs = torch.softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), 0)  # 0.64, 0.24, 0.09, 0.03
    out = filter_logits(probs.log()[None], 1.0, 0, 0.7)
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    assert sample_from_logits(torch.tensor([[0.0, 5.0, 1.0]]), 1.0, 1, 0.0).item() == 1


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="top_k .* top_p"):
        SamplingParams(top_k=3, top_p=0.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="num_tokens_to_generate"):
        SamplingParams(num_tokens_to_generate=-1)


def test_compile_decode_graphs_without_graphs_is_refused():
    with pytest.raises(ValueError, match="compile_decode_graphs.*num_cuda_graphs"):
        InferenceConfig(compile_decode_graphs=True)
    assert InferenceConfig(compile_decode_graphs=True, num_cuda_graphs=4).compile_decode_graphs


def test_scheduling_and_prefix_caching_settings_are_checked():
    from megatron_core.inference.config import AsyncScheduleMode, PrefixCachingEvictionPolicy

    config = InferenceConfig(async_sched_mode="async", prefix_caching_eviction_policy="lru")
    assert config.async_sched_mode is AsyncScheduleMode.ASYNC
    assert config.prefix_caching_eviction_policy is PrefixCachingEvictionPolicy.LRU
    assert InferenceConfig().async_sched_mode is AsyncScheduleMode.LEGACY  # Megatron-Core's default
    with pytest.raises(ValueError, match=r"async_sched_mode \('fast'\) must be one of 'legacy', 'async'"):
        InferenceConfig(async_sched_mode="fast")
    with pytest.raises(ValueError, match="prefix_caching_eviction_policy"):
        InferenceConfig(prefix_caching_eviction_policy="fifo")
    with pytest.raises(ValueError, match=r"prefix_caching_routing_alpha \(1.5\) must be in \[0, 1\]"):
        InferenceConfig(prefix_caching_routing_alpha=1.5)


def _sampled_run(seed: int) -> list[list[int]]:
    model = mcore_llama()
    model.config.inference_sampling_seed = seed
    llm = MegatronLLM(
        model=model, tokenizer=None, use_coordinator=False,
        inference_config=InferenceConfig(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64),
    )
    params = SamplingParams(temperature=1.5, top_p=0.95, num_tokens_to_generate=10, termination_id=-1)
    return [r.generated_tokens for r in llm.generate(prompts(), params)]


def test_seeded_sampling_reproduces():
    first, second, other = _sampled_run(5), _sampled_run(5), _sampled_run(6)
    assert first == second
    assert first != other
