"""FP8 experts' fc1 and weighted SwiGLU as one function (``megatron_core.fp8.grouped_swiglu``), and its kernel.

The kernel (``weighted_swiglu_grad_cast``: the activation's gradient and fc1's row-wise data-gradient cast in one
pass) equals the two kernels it replaces bit for bit, in Triton's interpreter on the CPU and on a GPU. The function
equals fc1's ``ScaledGroupedMm`` followed by ``WeightedSwiGLUFunction`` bit for bit on a Hopper GPU (output and
every gradient, eager and compiled, grouped and per-expert GEMMs), and an FP8 MoE layer takes it there.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8.weighted_swiglu_grad_cast import (
    weighted_swiglu_grad_rowwise_cast,
    weighted_swiglu_grad_rowwise_cast_serves,
)
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bits = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def test_not_served_on_cpu_and_the_formulas_run_there():
    gen = torch.Generator().manual_seed(0)
    rows, ffn = 32, 40
    y, g = torch.randn(rows, 2 * ffn, generator=gen), torch.randn(rows, ffn, generator=gen)
    w, factors = torch.rand(rows, 1, generator=gen), torch.rand(2, 2 * ffn, generator=gen) + 0.5
    groups = torch.arange(rows) // 16
    assert not weighted_swiglu_grad_rowwise_cast_serves(y)
    dy, dw, codes, inverse = weighted_swiglu_grad_rowwise_cast(g, y, w, factors, groups)
    from megatron_core.fusions.fused_bias_swiglu import weighted_swiglu_back

    want_dy, want_dw = weighted_swiglu_back(g, y, w)
    assert _same(dy, want_dy) and _same(dw, want_dw)
    scaled = dy * factors[groups]
    # e4m3: 3 mantissa bits; below its smallest normal a step of 2**-9 in code units (times the row's scale)
    error = (codes.float() * inverse[:, None] - scaled).abs()
    assert torch.all(error <= 2 ** -4 * scaled.abs() + 2 ** -10 * inverse[:, None])
    assert torch.all(inverse.log2() == inverse.log2().round())  # power-of-two scales


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"got \(2, 3\), \(2, 8\), \(2, 1\), \(1, 8\) and \(2,\)"):
        weighted_swiglu_grad_rowwise_cast(torch.zeros(2, 3), torch.zeros(2, 8), torch.zeros(2, 1), torch.ones(1, 8),
                                          torch.zeros(2, dtype=torch.int32))


_INTERPRETED = """
import torch
from megatron_core.fp8 import cast_kernels as ck
from megatron_core.fp8 import weighted_swiglu_grad_cast as fused
from megatron_core.fusions import weighted_swiglu_triton as unfused

def same(a, b):
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))

gen = torch.Generator().manual_seed(0)
for rows, ffn, groups in ((6, 1024, 2), (5, 700, 3), (3, 40, 1)):
    for dtype in (torch.float32, torch.bfloat16):
        y = (torch.randn(rows, 2 * ffn, generator=gen) * 3).to(dtype)
        g = (torch.randn(rows, ffn, generator=gen) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
        w = torch.rand(rows, 1, generator=gen)
        factors = torch.rand(groups, 2 * ffn, generator=gen) + 0.25
        row_groups = (torch.arange(rows) * groups // rows).to(torch.int32)
        got = fused._grad_cast(g, y, w, factors, row_groups)
        dy, dw = unfused._backward(g, y, w)
        codes = torch.empty(rows, 2 * ffn, dtype=torch.float8_e4m3fn)
        inverse = torch.empty(rows)
        ck._launch_rowwise(dy, factors, row_groups, True, codes, inverse)
        for a, b in zip(got, (dy, dw, codes, inverse)):
            assert same(a, b), (rows, ffn, dtype)
"""


@needs_triton
def test_interpreted_kernel_equals_the_two_kernels_bit_for_bit():
    run_in_triton_interpreter(_INTERPRETED)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _two_functions(x, weight, ends, probs, codes):
    from megatron_core.fp8.scaled_grouped_mm import ScaledGroupedMm
    from megatron_core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    return weighted_bias_swiglu_impl(ScaledGroupedMm.apply(x, weight, ends, True, *codes), None, probs)


def _one_function(x, weight, ends, probs, codes):
    from megatron_core.fp8.grouped_swiglu import fp8_grouped_gemm_weighted_swiglu

    return fp8_grouped_gemm_weighted_swiglu(x, weight, ends, probs, True, codes)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", ["grouped", "per_expert"])
def test_gpu_one_function_equals_the_two_bit_for_bit(compiled, mode):
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from megatron_core.fp8.expert_gemm_mode import set_fp8_expert_gemm
    from megatron_core.fp8.grouped_swiglu import fused_weighted_swiglu_serves
    from megatron_core.fp8.scaled_grouped_mm import quantize_weight_rowwise, transposed_weight_codes

    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, ffn = 4, 256, 384
    ends = torch.tensor([64, 64, 256, 320], device="cuda", dtype=torch.int32)  # an expert without rows
    rows = int(ends[-1])
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    probs = torch.rand(rows, 1, device="cuda", generator=gen)
    grad = torch.randn(rows, ffn, device="cuda", generator=gen).to(torch.bfloat16)
    assert fused_weighted_swiglu_serves(x, weight)
    w_codes, w_scale = quantize_weight_rowwise(weight)
    results = []
    set_fp8_expert_gemm(mode)
    try:
        for fn, codes in ((_two_functions, (None, None, None)), (_one_function, None),
                          (_two_functions, (w_codes, w_scale, transposed_weight_codes(w_codes))),
                          (_one_function, (w_codes, w_scale, transposed_weight_codes(w_codes)))):
            torch._dynamo.reset()
            run = torch.compile(fn, fullgraph=mode == "grouped") if compiled else fn
            leaves = [t.clone().requires_grad_(True) for t in (x, weight, probs)]
            out = run(leaves[0], leaves[1], ends, leaves[2], codes)
            out.backward(grad)
            results.append([out.detach(), *(t.grad for t in leaves)])
    finally:
        set_fp8_expert_gemm("grouped")
    for pair in ((results[0], results[1]), (results[2], results[3])):
        for got, want in zip(*pair):
            assert _same(got, want)


def _experts_step(experts: torch.nn.Module, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                  probs: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.clone().requires_grad_(True), probs.clone().requires_grad_(True)]
    experts.zero_grad(set_to_none=True)
    out, _ = experts(leaves[0], tokens_per_expert, leaves[1])
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves), *(p.grad for p in experts.parameters())]


def gpu_fp8_experts_and_batch() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Hopper FP8 ``TEGroupedMLP`` (a small Mixtral's first layer, bf16) and ``(tokens_per_expert, x, probs, grad)``
    for it (an expert without rows among them); skips where there is no Hopper GPU or torchao."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    pytest.importorskip("torchao.float8")
    from megatron_core.fp8 import convert_to_float8
    from tests.transformer.moe.moe_parallel_utils import build

    torch.manual_seed(0)
    model = build("mixtral", moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="tensorwise").cuda().bfloat16()
    convert_to_float8(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens_per_expert = torch.tensor([16, 0, 40, 8], device="cuda")
    rows = int(tokens_per_expert.sum())
    x = torch.randn(rows, 16, device="cuda", generator=gen).to(torch.bfloat16)
    probs = torch.rand(rows, device="cuda", generator=gen)
    grad = torch.randn(rows, 16, device="cuda", generator=gen).to(torch.bfloat16)
    return model.decoder.layers[0].mlp.experts, tokens_per_expert, x, probs, grad


@pytest.mark.gpu
def test_gpu_fp8_moe_experts_take_the_one_function():
    from megatron_core.fp8 import grouped_swiglu

    experts, tokens_per_expert, x, probs, grad = gpu_fp8_experts_and_batch()
    calls = []
    original = grouped_swiglu.ScaledGroupedMmWeightedSwiGLU.apply

    def counting(*args):
        calls.append(tuple(args[0].shape))
        return original(*args)

    grouped_swiglu.ScaledGroupedMmWeightedSwiGLU.apply = counting
    try:
        fused = _experts_step(experts, x, tokens_per_expert, probs, grad)
        grouped_swiglu.FUSED_WEIGHTED_SWIGLU = False
        plain = _experts_step(experts, x, tokens_per_expert, probs, grad)
    finally:
        grouped_swiglu.ScaledGroupedMmWeightedSwiGLU.apply = original
        grouped_swiglu.FUSED_WEIGHTED_SWIGLU = True
    assert len(calls) == 1  # the fused run only
    assert len(fused) == len(plain) == 5
    for got, want in zip(fused, plain):
        assert _same(got, want)


def _cpu_fp8_experts():
    from megatron_core.fp8 import convert_to_float8
    from tests.transformer.moe.moe_parallel_utils import build

    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = build("mixtral", moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="tensorwise")
    convert_to_float8(model, emulate=True)
    return model.decoder.layers[0].mlp.experts


def _aligned_rows():
    from megatron_core.transformer.moe.grouped_linear import align_expert_rows

    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 9, 2])
    layout = align_expert_rows(counts, int(counts.sum()))
    x = torch.zeros(layout.total_rows, 16).index_copy(0, layout.index, torch.randn(int(counts.sum()), 16,
                                                                                   generator=gen))
    probs = torch.zeros(layout.total_rows).index_copy(0, layout.index, torch.rand(int(counts.sum()), generator=gen))
    return x, layout, probs


def test_fc1_refuses_the_fused_activation_where_it_cannot_fuse():
    experts = _cpu_fp8_experts()
    x, layout, probs = _aligned_rows()
    assert not experts.linear_fc1.fuses_weighted_swiglu(x, layout)  # emulated on CPU
    with pytest.raises(ValueError, match="cannot fuse the weighted SwiGLU here"):
        experts.linear_fc1(x, layout, weighted_swiglu_probs=probs[:, None])


def test_experts_call_fc1_through_the_module_with_the_fused_activation(monkeypatch):
    """The wiring, on CPU: where fc1 says it fuses, the experts call ``linear_fc1(x, counts,
    weighted_swiglu_probs=p)`` through the module (its forward pre-hooks run) and feed fc2 with what it returns.
    The Hopper function is stood in for by its statement (the emulated FP8 GEMM, then the weighted SwiGLU); the
    function itself is checked against the two functions bit for bit on the GPU (above)."""
    from megatron_core.fp8 import grouped_layers
    from megatron_core.fp8.grouped_gemm import fp8_grouped_gemm
    from megatron_core.fusions.fused_bias_swiglu import weighted_swiglu

    experts = _cpu_fp8_experts()
    x, layout, probs = _aligned_rows()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))

    def step() -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_(True), probs.clone().requires_grad_(True)]
        experts.zero_grad(set_to_none=True)
        out, _ = experts(leaves[0], layout, leaves[1])
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves), *(p.grad for p in experts.parameters())]

    # Both paths take the weighted SwiGLU on CPU (its fused kernels are for accelerators).
    monkeypatch.setattr(type(experts), "_fused_weighted_swiglu", lambda self, t: True)
    plain = step()
    seen = []
    experts.linear_fc1.register_forward_pre_hook(lambda module, args, kwargs: seen.append(sorted(kwargs)),
                                                 with_kwargs=True)
    monkeypatch.setattr(type(experts.linear_fc1), "fuses_weighted_swiglu", lambda self, t, counts: True)
    monkeypatch.setattr(grouped_layers, "fp8_grouped_gemm_weighted_swiglu",
                        lambda x, weight, ends, probs, fp8_wgrad, weight_codes, host_ends: weighted_swiglu(
                            fp8_grouped_gemm(x, weight, ends=ends, emulate=True, fp8_wgrad=fp8_wgrad), probs))
    fused = step()
    assert seen == [["weighted_swiglu_probs"]]
    assert len(fused) == len(plain) == 5
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
