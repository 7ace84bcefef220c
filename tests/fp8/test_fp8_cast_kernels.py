"""The Triton e4m3 casts of the FP8 grouped GEMM against the PyTorch formulas they replace.

On CPU the kernels run in Triton's interpreter. Its float-to-e4m3 conversion is not the hardware's (a rounding
that carries into the exponent is lost), so the interpreted check uses inputs that scale to e4m3 values exactly:
scales, layouts, groups and the transposition are then checked bit for bit, and rounding is left to the GPU
test, which compares random inputs bit for bit with PyTorch's own conversion.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

_CHECK = """
import torch
from megatron_core.fp8 import cast_kernels as ck
from megatron_core.fp8 import scaled_grouped_mm as sgm

def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype ==
        torch.float8_e4m3fn else a, b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)

def check(x, factors, ends, rowwise, columnwise):
    rows = x.shape[0]
    groups = sgm.group_of_rows(ends, rows, 1).to(torch.int32)
    assert all(same(a, b) for a, b in zip(rowwise(x, None, None), sgm._rowwise(x)))
    want = sgm._rowwise(x.float() * factors[groups.long()])
    assert all(same(a, b) for a, b in zip(rowwise(x, factors, groups), want))
    plain = (torch.arange(rows, dtype=torch.int32), groups)
    want_t, want_scale = sgm._group_columnwise_transposed(x, ends)
    assert all(same(a, b) for a, b in zip(columnwise(x, ends, *plain), (want_t, want_scale)))
    source, column_groups, _ = sgm.aligned_contraction_layout(ends, rows, 32)  # groups padded with zero columns
    got_t, got_scale = columnwise(x, ends, source.to(torch.int32), column_groups.to(torch.int32))
    assert same(got_t, sgm._placed(want_t, source)) and same(got_scale, want_scale)

{body}
"""

_REPRESENTABLE = """
gen = torch.Generator().manual_seed(0)
def representable(rows, cols):
    mantissa = torch.randint(-15, 16, (rows, cols), generator=gen).float() / 8  # e4m3: 3 mantissa bits
    return mantissa * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=gen).float())

def rowwise(x, factors, groups):
    if factors is None:
        return ck._rowwise(x, x, torch.zeros(1, dtype=torch.int32), False)
    return ck._rowwise(x, factors, groups, True)

x = representable(96, 80).to(torch.bfloat16)
x[:, 3] = 0.0
factors = torch.exp2(torch.randint(-3, 4, (4, 80), generator=gen).float())
check(x, factors, torch.tensor([32, 32, 80, 96], dtype=torch.int32), rowwise, ck._group_columnwise)
codes = torch.randint(0, 256, (3, 70, 150), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
assert same(ck._transpose_bytes(codes.view(torch.uint8)).view(codes.dtype), codes.transpose(1, 2).contiguous())
check(x[:48].contiguous(), factors[:1], torch.tensor([48], dtype=torch.int32), rowwise, ck._group_columnwise)
codes_into, inverse_into = torch.empty(96, 80, dtype=torch.float8_e4m3fn), torch.empty(96)
ck.rowwise_cast_into(x, codes_into, inverse_into)  # the eager forms the weight cache's refresh calls
assert same(codes_into, sgm._rowwise(x)[0]) and same(inverse_into, sgm._rowwise(x)[1])
transposed_into = torch.empty(3, 150, 70, dtype=torch.float8_e4m3fn)
ck.transpose_codes_into(codes, transposed_into)
assert same(transposed_into, codes.transpose(1, 2).contiguous())
ck.WHOLE_ROW_MAX = 64  # rows of 80 now take the two-pass kernel
check(x, factors, torch.tensor([32, 32, 80, 96], dtype=torch.int32), rowwise, ck._group_columnwise)
ck._AMAX_ROWS, ck._AMAX_SPLIT = 16, 3  # each group's column maxima from three row ranges, joined atomically
check(x, factors, torch.tensor([32, 32, 80, 96], dtype=torch.int32), rowwise, ck._group_columnwise)
"""


@needs_triton
def test_interpreted_casts_equal_the_pytorch_formulas():
    run_in_triton_interpreter(_CHECK.format(body=_REPRESENTABLE))


def test_the_eager_forms_launch_without_the_wrappers_op_dispatch(monkeypatch):
    """``rowwise_cast_into`` and ``transpose_codes_into`` (run eagerly inside the weight cache's opaque op) launch
    their kernels with ``wrap_triton``'s higher-order-op dispatch off, which costs hundreds of microseconds of host
    time per launch; the traced forms keep it."""
    from torch._library import triton as library_triton

    from megatron_core.fp8 import cast_kernels as ck

    dispatching = []

    def record(*args: object) -> None:
        dispatching.append(library_triton.is_wrap_triton_enabled())

    monkeypatch.setattr(ck, "_launch_rowwise", record)
    monkeypatch.setattr(ck, "_launch_transpose", record)
    t = torch.zeros(4, 8)
    ck.rowwise_cast_into(t, t, t[:, 0])
    ck.transpose_codes_into(t[None], t[None])
    assert dispatching == [False, False] and library_triton.is_wrap_triton_enabled()


@pytest.mark.gpu
def test_gpu_casts_equal_pytorch_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_core.fp8 import cast_kernels as ck
    from megatron_core.fp8 import scaled_grouped_mm as sgm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1040, 720, device="cuda", generator=gen) * torch.logspace(-4, 4, 720, device="cuda"))
    x = x.to(torch.bfloat16)
    ends = torch.tensor([256, 256, 800, 1040], device="cuda", dtype=torch.int32)
    groups = sgm.group_of_rows(ends, x.shape[0], 1)
    factors = torch.rand(4, 720, device="cuda", generator=gen) + 0.25
    layout = sgm.aligned_contraction_layout(ends, x.shape[0], sgm.WGRAD_K_ALIGN)
    plain_t, plain_scale = sgm._group_columnwise_transposed(x, ends)
    for got, want in ((ck.rowwise_cast(x), sgm._rowwise(x)),
                      (ck.rowwise_cast(x, factors, groups), sgm._rowwise(x.float() * factors[groups])),
                      (ck.group_columnwise_cast_transposed(x, ends, groups), sgm._group_columnwise_transposed(x, ends)),
                      (ck.group_columnwise_cast_transposed(x, ends, groups, layout[:2]),
                       (sgm._placed(plain_t, layout[0]), plain_scale))):
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1])
    # whole rows in one pass (short and long rows) and, past WHOLE_ROW_MAX, the two-pass kernel
    for rows, cols in ((4100, 4096), (48, 14336), (32, 28672), (16, ck.WHOLE_ROW_MAX + 48)):
        y = (torch.randn(rows, cols, device="cuda", generator=gen) * torch.logspace(-3, 3, rows, device="cuda")[:, None])
        y = y.to(torch.bfloat16)
        row_groups = torch.arange(rows, device="cuda") % 4
        y_factors = torch.rand(4, cols, device="cuda", generator=gen) + 0.25
        for got, want in ((ck.rowwise_cast(y), sgm._rowwise(y)),
                          (ck.rowwise_cast(y, y_factors, row_groups), sgm._rowwise(y.float() * y_factors[row_groups]))):
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), (rows, cols)
            assert torch.equal(got[1], want[1]), (rows, cols)
    codes = torch.randint(0, 256, (3, 700, 1500), device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(ck.transpose_codes(codes).view(torch.uint8), codes.view(torch.uint8).transpose(1, 2).contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_cast_transpose_equals_quantize_and_padded_transpose_bit_for_bit(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_core.distributed.fp8_params import quantize
    from megatron_core.fp8 import cast_kernels as ck
    from megatron_core.fp8.fp8_param_linear import _transposed

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols in ((1000, 720), (4096, 3072), (37, 130)):  # rows not a multiple of 16 are padded with zeros
        x = torch.randn(rows, cols, device="cuda", generator=gen) * torch.logspace(-3, 3, cols, device="cuda")
        x = x.to(torch.bfloat16)
        x[0, 0] = 1e6  # saturates
        scale = torch.tensor(448.0 / 3e3, device="cuda")
        assert ck.cast_transpose_serves(x)
        codes, transposed = ck.cast_transpose(x, scale, dtype)
        want = quantize(x, scale, dtype)
        assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))
        assert transposed.shape == (cols, rows + (-rows % 16))
        assert torch.equal(transposed.view(torch.uint8), _transposed(want).view(torch.uint8))
