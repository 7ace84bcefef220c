"""Gated-output attention (``attention_output_gate``) through the dynamic engine's KV cache: greedy tokens equal a
plain loop that runs the whole sequence through the model at every step (fp32, CPU)."""

from __future__ import annotations

import torch

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from tests.models.gpt_test_utils import VOCAB, build, llama_like

NEW = 8


def _full_forward_greedy(model, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(len(tokens)).unsqueeze(0), attention_mask=None)
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_gated_attention_engine_greedy_equals_full_forward_loop():
    torch.manual_seed(0)
    model = build(llama_like(), attention_output_gate=True).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    expected = [_full_forward_greedy(model, p) for p in prompts]
    context = DynamicInferenceContext(model.config, InferenceConfig(block_size_tokens=8, buffer_size_gb=0.01,
                                                                    max_sequence_length=64))
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None)
    engine = DynamicInferenceEngine(controller, context)
    records = engine.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1))
    assert [r.merge().generated_tokens for r in records] == expected
    # the projection holds the gates: queries 32 + gates 32 + keys 16 + values 16 channels (8 heads of 4, 4 groups)
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0] == 96
