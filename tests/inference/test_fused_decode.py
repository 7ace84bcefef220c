"""The fused single-token decode layer (transformer/fused_decode.py): same results as the layer's normal forward.

On the CPU the Triton GEMV cannot run, so these tests stand the reference chain
(:func:`fused_gemv_reference`) in for the kernel: they check the fused layer's wiring (which norm,
bias and residual goes where) in fp32; the kernel itself is checked on a GPU in
tests/tensor_parallel/test_fused_gemv_cuda.py, which also runs the whole layer in bf16.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.tensor_parallel.fused_gemv import fused_gemv_reference
from megatron_core.transformer import fused_decode
from tests.inference.llama_fixture import (
    MAX_POS,
    VOCAB,
    hf_greedy,
    hf_llama,
    mcore_config,
    mcore_llama,
    prompts,
)

NEW = 8


class SingleTokenContext(BaseInferenceContext):
    """A stand-in inference context for one token: its attention is a fixed function of q, k and v."""

    def is_static_batching(self):
        return False

    def is_decode_only(self):
        return True

    def attention(self, attention, query, key, value, rotary_pos_emb):
        groups = key.shape[2]
        repeat = query.shape[2] // groups
        mixed = query * 0.5 + (key * value).repeat_interleave(repeat, dim=2)
        return mixed.reshape(query.shape[0], 1, -1)


def _layer(**overrides):
    torch.manual_seed(1)
    model = GPTModel(mcore_config(**overrides), get_gpt_layer_local_spec(), VOCAB, MAX_POS,
                     position_embedding_type="rope").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.decoder.layers[0]


@pytest.fixture
def reference_gemv(monkeypatch):
    """Run the fused path on the CPU with the unfused chain standing in for the kernel; count its calls."""
    calls = []

    def gemv(*args, **kwargs):
        calls.append(kwargs)
        return fused_gemv_reference(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "fused_gemv_supported", lambda x, weight: True)
    monkeypatch.setattr(fused_decode, "fused_gemv", gemv)
    return calls


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fused_layer_equals_normal_forward(reference_gemv, monkeypatch, bias):
    layer = _layer(add_bias_linear=bias)
    hidden = torch.randn(1, 1, layer.config.hidden_size)
    context = SingleTokenContext()
    with torch.no_grad():
        fused, _ = layer(hidden, inference_context=context)
        assert len(reference_gemv) == 4
        monkeypatch.setattr(fused_decode, "enabled", False)
        normal, _ = layer(hidden, inference_context=context)
    assert len(reference_gemv) == 4
    torch.testing.assert_close(fused, normal, rtol=1e-5, atol=1e-5)
    assert [bool(c.get("gated_silu")) for c in reference_gemv] == [False, False, True, False]
    assert [c.get("norm_weight") is not None for c in reference_gemv] == [True, False, True, False]


def test_fused_path_only_for_one_token_in_eval(reference_gemv):
    layer = _layer()
    hidden = torch.randn(2, 1, layer.config.hidden_size)
    assert not fused_decode.fused_decode_applies(layer, hidden)
    assert fused_decode.fused_decode_applies(layer, hidden[:1])
    layer.train()
    assert not fused_decode.fused_decode_applies(layer, hidden[:1])
    assert not fused_decode.fused_decode_applies(_layer(gated_linear_unit=False, activation_func=torch.nn.functional.gelu).eval(),
                                                 hidden[:1])
    assert not fused_decode.fused_decode_applies(_layer(normalization="LayerNorm"), hidden[:1])


def test_fused_decode_greedy_matches_hf(reference_gemv):
    """One request at a time (so every decode step has one token): the fused layers give HF's tokens."""
    pytest.importorskip("transformers")
    from tests.inference.test_greedy_hf import _engine, _greedy

    hf = hf_llama()
    model = mcore_llama(hf)
    engine = _engine(model, block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64)
    for prompt in prompts()[:2]:
        assert _greedy(engine, [prompt])[0][:NEW] == hf_greedy(hf, prompt, NEW)
    assert reference_gemv


@pytest.mark.gpu
def test_fused_decode_bf16_engine_matches_unfused(monkeypatch):
    """bf16 on CUDA, CUDA-graph decode steps of the compiled forward: the fused layers (GEMVs, one rotate-and-cache
    kernel) give the unfused engine's tokens."""
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.inference.test_greedy_hf import _engine, _greedy

    model = mcore_llama(hf_llama()).cuda().to(torch.bfloat16)
    calls = []
    real = fused_decode.fused_decode_forward

    def counted(*args):
        # Count eager calls only: an append traced by torch.compile guards the compiled forward on len(calls), so
        # every call would compile again, the graph capture included (which then fails on the GPU).
        if not torch.compiler.is_compiling():
            calls.append(1)
        return real(*args)

    monkeypatch.setattr(fused_decode, "fused_decode_forward", counted)
    batch = prompts()[:2]
    options = dict(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=64)
    fused = [_greedy(_engine(model, **options), [p])[0][:6] for p in batch]
    eager_calls = len(calls)
    graphed = [_greedy(_engine(model, num_cuda_graphs=2, compile_decode_graphs=True, **options), [p])[0][:6]
               for p in batch]
    monkeypatch.setattr(fused_decode, "enabled", False)
    unfused = [_greedy(_engine(model, **options), [p])[0][:6] for p in batch]
    assert eager_calls > 0
    assert fused == unfused == graphed
