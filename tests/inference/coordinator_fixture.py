"""A tiny GPT and dynamic engine for the coordinator tests (same weights in every process)."""

from __future__ import annotations

import torch

from megatron_core.inference.apis import MegatronLLM
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from tests.inference.llama_fixture import MAX_POS, VOCAB, CharTokenizer, mcore_config, prompts

CONFIG = dict(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64)
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=6, termination_id=-1)
PROMPTS = prompts((5, 9, 13, 7, 11, 4, 16, 6))


def tiny_gpt() -> GPTModel:
    """A 2-layer GPT whose every weight comes from one seeded generator."""
    model = GPTModel(mcore_config(), get_gpt_layer_local_spec(), VOCAB, MAX_POS, position_embedding_type="rope",
                     rotary_base=10000).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if param.dim() == 1 else 0.3 * noise)
    return model


def engine(model: GPTModel | None = None):
    """A fresh dynamic engine over ``model`` (default: :func:`tiny_gpt`)."""
    llm = MegatronLLM(model=model if model is not None else tiny_gpt(), tokenizer=CharTokenizer(),
                      use_coordinator=False, inference_config=InferenceConfig(**CONFIG))
    return llm.engine


def reference(prompt_list: list, model: GPTModel | None = None) -> list[list[int]]:
    """Greedy tokens of ``engine.generate`` in this process (no coordinator)."""
    return [r.merge().generated_tokens for r in engine(model).generate(prompt_list, GREEDY)]
