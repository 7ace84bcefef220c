"""Greedy generation of a mixture-of-experts model (Mixtral) through the dynamic engine equals Hugging Face's.

Batched prompts of different lengths share flattened steps, so tokens of several requests go through the
router and the token dispatcher together, in prefill chunks and in decode steps (fp32, CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.inference.llama_fixture import hf_greedy
from tests.models.hf_moe_mapping import load_state, moe_to_mcore

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS, EXPERTS, HEADS, GROUPS, NEW = 96, 2, 4, 6, 2, 10


@pytest.fixture(scope="module")
def mixtral():
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)).eval()
    hf.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (4, 13, 7, 21)]
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    return hf, prompts, expected


def _model(hf, grouped: bool) -> GPTModel:
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=48, num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=40,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=40, moe_grouped_gemm=grouped)
    model = GPTModel(config, get_gpt_layer_local_spec(EXPERTS, moe_grouped_gemm=grouped), VOCAB, 128,
                     position_embedding_type="rope", rotary_base=5000).eval()
    load_state(model, moe_to_mcore(hf.state_dict(), LAYERS, HEADS, GROUPS, EXPERTS, grouped))
    return model


def _greedy(model, prompts, **config) -> list[list[int]]:
    context = DynamicInferenceContext(model.config, InferenceConfig(**config))
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None),
                                    context)
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    return [r.merge().generated_tokens for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_mixtral_batched_greedy_matches_hf(mixtral, grouped: bool):
    hf, prompts, expected = mixtral
    assert _greedy(_model(hf, grouped), prompts, block_size_tokens=8, buffer_size_gb=0.01,
                   max_sequence_length=64) == expected


def test_mixtral_greedy_with_chunked_prefill_matches_hf(mixtral):
    hf, prompts, expected = mixtral
    got = _greedy(_model(hf, grouped=True), prompts, block_size_tokens=4, buffer_size_gb=0.01,
                  max_sequence_length=64, max_tokens=9, max_requests=3, enable_chunked_prefill=True)
    assert got == expected


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixtral_padded_decode_layout_matches_hf(mixtral, compiled: bool):
    """The CUDA-graph layout (decode batches padded to fixed sizes) on CPU, with the eager or the compiled
    forward: padding rows go through the router and the experts too, and must not change the real
    requests' tokens. Compiled, three requests run in the graph size of four (one padding row), so that one
    graph size is compiled (each size compiles the MoE forward anew, in many graphs: the router's counts
    break it)."""
    hf, prompts, expected = mixtral
    if compiled:
        prompts, expected = prompts[:3], expected[:3]
    model = _model(hf, grouped=True)
    context = DynamicInferenceContext(model.config, InferenceConfig(
        block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64, num_cuda_graphs=4,
        max_requests=4 if compiled else 3, compile_decode_graphs=compiled))
    context.pad_decode_steps_on_cpu = True
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None),
                                    context)
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    assert [r.merge().generated_tokens for r in engine.generate(prompts, params)] == expected
    assert context.graph_inputs  # padded decode steps ran
    if compiled:
        assert set(context.graph_inputs) == {4}
