"""Experts padded to one capacity run as one batched matmul: values and gradients of the per-expert GEMMs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe import grouped_linear
from megatron_core.transformer.moe.grouped_linear import equal_groups, grouped_gemm
from tests.transformer.moe.moe_parallel_utils import sequential_to_grouped_state


def test_equal_groups_rule():
    assert equal_groups([4, 4, 4])
    assert not equal_groups([4, 4, 5])
    assert not equal_groups([0, 0])
    assert not equal_groups([])


def test_equal_groups_gemm_matches_per_expert_matmuls_in_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    experts, rows, n_in, n_out = 3, 5, 8, 6
    x = torch.randn(experts * rows, n_in, generator=gen, requires_grad=True)
    w = torch.randn(experts, n_out, n_in, generator=gen, requires_grad=True)
    dy = torch.randn(experts * rows, n_out, generator=gen)
    out = grouped_gemm(x, w, [rows] * experts)
    out.backward(dy)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([F.linear(piece, w_ref[e]) for e, piece in enumerate(x_ref.split(rows))])
    ref.backward(dy)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    assert w.grad.is_contiguous()  # in the parameter's own layout: nothing to copy when accumulating


@pytest.mark.parametrize("capacity_factor", [1.0, 2.0])
def test_grouped_experts_padded_to_capacity_equal_sequential_experts(capacity_factor, monkeypatch):
    calls = []
    batched = grouped_linear._BatchedExpertLinear.apply
    monkeypatch.setattr(grouped_linear._BatchedExpertLinear, "apply", lambda *a: calls.append(1) or batched(*a))
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=F.silu, moe_expert_capacity_factor=capacity_factor,
        moe_pad_expert_input_to_capacity=True, moe_token_dispatcher_type="alltoall",
    )
    seq = GPTModel(cfg, get_gpt_layer_local_spec(4), 32, 16)
    grouped = GPTModel(cfg, get_gpt_layer_local_spec(4, moe_grouped_gemm=True), 32, 16)
    grouped.load_state_dict(sequential_to_grouped_state(seq.state_dict()), strict=False)
    ids = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    labels = torch.randint(0, 32, (2, 8))
    seq(ids, pos, None, labels=labels).mean().backward()
    grouped(ids, pos, None, labels=labels).mean().backward()
    assert len(calls) == 2  # fc1 and fc2 ran as batched matmuls
    experts = grouped.decoder.layers[0].mlp.experts
    for e, local in enumerate(seq.decoder.layers[0].mlp.experts.local_experts):
        for fc in ("linear_fc1", "linear_fc2"):
            torch.testing.assert_close(getattr(experts, fc).weight.grad[e], getattr(local, fc).weight.grad,
                                       rtol=1e-5, atol=1e-6, msg=f"expert {e} {fc}")
    torch.testing.assert_close(grouped.embedding.word_embeddings.weight.grad,
                               seq.embedding.word_embeddings.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_equal_groups_gemm_in_bf16_on_cuda_matches_fp32():
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, rows, n_in, n_out = 4, 128, 256, 512
    x = torch.randn(experts * rows, n_in, device="cuda", generator=gen)
    w = torch.randn(experts, n_out, n_in, device="cuda", generator=gen) / n_in**0.5
    dy = torch.randn(experts * rows, n_out, device="cuda", generator=gen)
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    grouped_gemm(xb, wb, [rows] * experts).backward(dy.bfloat16())
    x32, w32 = x.requires_grad_(), w.requires_grad_()
    torch.cat([F.linear(p, w32[e]) for e, p in enumerate(x32.split(rows))]).backward(dy)
    torch.testing.assert_close(xb.grad.float(), x32.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(wb.grad.float(), w32.grad, rtol=3e-2, atol=3e-1)
