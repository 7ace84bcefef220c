"""Tiny GPT models with MTP layers for the speculative-decoding tests (random, or trained to count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.multi_token_prediction import MTPLossLoggingHelper

VOCAB, MAX_POS = 64, 128
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
              normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)


def mtp_gpt(depths: int = 3, seed: int = 0, **overrides) -> GPTModel:
    """A random tiny GPT with ``depths`` MTP layers (eval mode)."""
    torch.manual_seed(seed)
    config = TransformerConfig(**{**CONFIG, "mtp_num_layers": depths, **overrides})
    block = get_gpt_decoder_block_spec(config, False)
    return GPTModel(config, block, VOCAB, MAX_POS, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(config, block, False)).eval()


def counting_gpt(depths: int = 3, steps: int = 40, seed: int = 0) -> GPTModel:
    """:func:`mtp_gpt` trained a few steps on sequences that count up by one (mod VOCAB) with random jumps:
    the main model and its MTP layers mostly continue the count, so drafts are often, but not always, right."""
    model = mtp_gpt(depths, seed).train()
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    seq = 24
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (8, 1), generator=gen)
        jumps = (torch.rand(8, seq, generator=gen) < 0.1).long() * torch.randint(0, VOCAB, (8, seq), generator=gen)
        ids = (start + torch.arange(seq) + jumps.cumsum(1)) % VOCAB
        labels = torch.roll(ids, -1, 1)
        loss = model(ids[:, :-1], torch.arange(seq - 1).expand(8, -1), None, labels=labels[:, :-1],
                     loss_mask=torch.ones(8, seq - 1))
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
    MTPLossLoggingHelper.tracker.clear()
    return model.eval()


def engine(model: GPTModel, **config) -> DynamicInferenceEngine:
    """A dynamic engine over ``model`` (tiny paged cache unless overridden)."""
    config = {"block_size_tokens": 8, "buffer_size_gb": 0.01, "max_sequence_length": 96, **config}
    context = DynamicInferenceContext(model.config, InferenceConfig(**config))
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None)
    return DynamicInferenceEngine(controller, context)


def prompts(lengths=(5, 17, 9, 30, 2), seed: int = 3) -> list[list[int]]:
    """Random prompts of the given lengths (ids >= 1)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]
