"""StaticInferenceEngine(legacy=True): the static-batch loop with a StaticInferenceContext KV cache on the tiny Llama
equals Hugging Face greedy ``generate`` for a batch of prompts of different lengths (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.contexts import StaticInferenceContext
from megatron_core.inference.engines import StaticInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from tests.inference.llama_fixture import hf_greedy, hf_llama, mcore_llama, prompts

pytest.importorskip("transformers")

NEW = 6


def test_legacy_static_batch_matches_hf_greedy():
    hf = hf_llama()
    model = mcore_llama(hf)
    wrapper = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=3, max_sequence_length=64))
    engine = StaticInferenceEngine(TextGenerationController(wrapper, tokenizer=None), max_batch_size=3, legacy=True)
    assert not hasattr(engine, "dynamic_engine")
    batch = prompts((4, 9, 6, 5))  # two static batches: lengths (4, 9, 6), then (5,)
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1, return_log_probs=True)
    results = engine.generate(prompts=batch, sampling_params=params)
    assert [r.generated_tokens for r in results] == [hf_greedy(hf, p, NEW) for p in batch]
    full = batch[1] + results[1].generated_tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], dim=-1)
    expected = [float(ref[i, full[i + 1]]) for i in range(len(full) - 1)]
    torch.testing.assert_close(torch.tensor(results[1].prompt_log_probs + results[1].generated_log_probs),
                               torch.tensor(expected), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"top_n_logprobs \(2\) and stop_words \(None\) are not supported"):
        engine.generate(prompts=batch[:1], sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=2,
                                                                          top_n_logprobs=2))
