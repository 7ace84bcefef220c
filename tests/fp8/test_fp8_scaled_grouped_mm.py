"""The Hopper FP8 grouped GEMM (``ScaledGroupedMm``): its casts and scale layouts, on CPU and on a GPU.

On CPU the kernel ``torch._scaled_grouped_mm`` is replaced by a plain-PyTorch statement of what it computes
(per group: codes times their dequantizing scales, multiplied in fp32; the 2D x 2D form takes its scales
group-major), so what is checked here is our side of the call: the codes, the scales, their layouts and
strides (the kernel's stride and shape checks are PyTorch's meta checks, run on the same arguments), and that
the result equals the fp32 emulation ``EmulatedFp8GroupedGemm`` (the reference the GPU kernel is held to).
On a GPU the real kernel is checked against the emulation, eager and under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8 import scaled_grouped_mm as sgm
from megatron_core.fp8.grouped_gemm import EmulatedFp8GroupedGemm, fp8_grouped_gemm

COUNTS = [48, 0, 80, 16]


@torch.library.custom_op("mcore_tests::reference_scaled_grouped_mm", mutates_args=())
def _reference_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """What ``torch._scaled_grouped_mm`` computes, in fp32, after PyTorch's own argument checks (all but the
    output dtype: the kernel writes bf16, this reference the operands' fp32 so that it compares exactly)."""
    torch._meta_registrations._meta_grouped_mm_common(a, b, scale_a, scale_b, offs=offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    groups = len(ends)
    if a.dim() == 2 and b.dim() == 3:
        a_deq = a.float() * scale_a[:, None]
        out = torch.zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a_deq[s:e] @ (b[g].float() * scale_b[g][None, :])
        return out.to(out_dtype)
    # 2D x 2D: the groups split the contraction dimension; scales are [groups * rows] and [groups * cols].
    sa, sb = scale_a.view(groups, a.shape[0]), scale_b.view(groups, b.shape[1])
    out = torch.stack([(a[:, s:e].float() * sa[g][:, None]) @ (b[s:e].float() * sb[g][None, :])
                       for g, (s, e) in enumerate(zip(starts, ends))])
    return out.to(out_dtype)


@_reference_op.register_fake
def _(a, b, scale_a, scale_b, offs, out_dtype):
    if a.dim() == 2 and b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)


def _reference_kernel(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    return _reference_op(a, b, scale_a, scale_b, offs, out_dtype)


@pytest.fixture
def reference_kernel(monkeypatch):
    monkeypatch.setattr(sgm, "_KERNEL", _reference_kernel)


def _operands(seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(COUNTS)
    x = torch.randn(rows, 64, generator=gen)
    x[:48] *= 100.0  # one expert's rows far larger: per-expert scales must keep the others' precision
    w = torch.randn(len(COUNTS), 32, 64, generator=gen) * 0.05
    dy = torch.randn(rows, 32, generator=gen)
    return x.to(dtype), w.to(dtype), dy.to(dtype)


def test_scaled_grouped_mm_equals_the_emulation(reference_kernel):
    x, w, dy = _operands(0)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = sgm.ScaledGroupedMm.apply(x1, w1, ends)
    out.backward(dy)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = EmulatedFp8GroupedGemm.apply(x2, w2, COUNTS)
    want.backward(dy)
    for got, ref in ((out, want), (x1.grad, x2.grad), (w1.grad, w2.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert w1.grad[1].abs().max() == 0  # the empty expert


def test_group_columnwise_scales_are_per_expert_powers_of_two():
    x, _, _ = _operands(1)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    codes_t, inv_scale = sgm._group_columnwise_transposed(x, ends)
    assert codes_t.shape == (64, x.shape[0]) and codes_t.is_contiguous() and codes_t.dtype == torch.float8_e4m3fn
    inv_scale = inv_scale.view(len(COUNTS), 64)
    assert torch.equal(torch.exp2(torch.round(torch.log2(inv_scale))), inv_scale)
    start = 0
    for g, count in enumerate(COUNTS):
        rows = x[start:start + count]
        if count:
            amax = rows.abs().amax(0)
            assert ((amax / inv_scale[g]) <= sgm.E4M3_MAX).all() and ((amax / inv_scale[g]) > sgm.E4M3_MAX / 2).all()
            dequantized = codes_t[:, start:start + count].float().t() * inv_scale[g]
            # e4m3: half a step of 3 mantissa bits, or half its smallest subnormal step (2**-9) times the scale
            assert ((dequantized - rows).abs() <= rows.abs() * 2**-4 + inv_scale[g] * 2**-10).all()
        start += count


def test_aligned_contraction_layout_pads_each_group_with_zero_columns():
    """Groups of 48, 0, 80 and 16 rows padded to multiples of 32 columns: 64, 0, 96 and 32, each group's rows first,
    then its zero columns (-1), then zero columns to the static length (144 rows + 4 x 31, rounded to 16)."""
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    source, groups, length = sgm.aligned_contraction_layout(ends, sum(COUNTS), 32)
    assert length == 272 and source.shape == groups.shape == (272,)
    zeros = [-1] * 16
    want = [*range(48), *zeros, *range(48, 128), *zeros, *range(128, 144), *zeros, *[-1] * 80]
    assert source.tolist() == want
    assert groups[:64].eq(0).all() and groups[64:160].eq(2).all() and groups[160:].eq(3).all()
    x, _, _ = _operands(1)
    codes_t, _ = sgm._group_columnwise_transposed(x, ends)
    placed = sgm._placed(codes_t, source).view(torch.uint8)
    assert torch.equal(placed[:, 64:144], codes_t.view(torch.uint8)[:, 48:128]) and not placed[:, 144:160].any()


def test_emulated_path_reads_device_style_ends():
    x, w, _ = _operands(2)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    torch.testing.assert_close(fp8_grouped_gemm(x, w, ends=ends), fp8_grouped_gemm(x, w, counts=COUNTS), rtol=0,
                               atol=0)


def test_compiles_without_graph_breaks(reference_kernel):
    x, w, _ = _operands(3)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def step(x, w):
        return sgm.ScaledGroupedMm.apply(x, w, ends).square().sum()

    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(x1, w1).backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    step(x2, w2).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_hopper_kernel_matches_the_emulation(compiled: bool):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (FP8 grouped GEMMs)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [48, 0, 144, 64]
    x = torch.randn(256, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    x[:48] *= 50
    w = (torch.randn(4, 768, 512, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    grad = torch.randn(256, 768, device="cuda", generator=gen, dtype=torch.bfloat16)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)

    def run(fn, **kw):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xx, ww, **kw)
        out.backward(grad)
        return out, xx.grad, ww.grad

    gemm = torch.compile(fp8_grouped_gemm, fullgraph=True) if compiled else fp8_grouped_gemm
    got = run(gemm, ends=ends)
    want = run(fp8_grouped_gemm, counts=counts, emulate=True)
    for g, r in zip(got, want):
        error = ((g.float() - r.float()).norm() / r.float().norm()).item()
        assert error < 1e-2, error  # same quantization; bf16 output rounding and accumulation order differ
    assert got[2][1].abs().max() == 0
