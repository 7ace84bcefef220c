"""``megatron_core.fp8.cublaslt_rowwise``: row-wise scaled FP8 GEMMs through cuBLASLt with plans kept per shape class.

On a Hopper GPU each product equals ``torch._scaled_mm``'s on the same codes and scales (the same library's kernels;
the algorithm may differ, so to bf16 rounding), for row counts and contraction lengths that change between calls of
one plan, and for operands that are column slices of wider matrices (the weight gradient's). Elsewhere nothing is
served and the callers use ``torch._scaled_mm``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8 import cublaslt_rowwise


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_nothing_is_served_on_cpu():
    assert not cublaslt_rowwise.serves_device(torch.device("cpu"))
    a = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    out = torch.empty(32, 16, dtype=torch.bfloat16)
    assert not cublaslt_rowwise.rowwise_scaled_mm_(out, a, torch.ones(32), torch.zeros(16, 64).to(a.dtype),
                                                   torch.ones(16))


def _codes(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, cols, device="cuda", generator=gen)
    scale = x.abs().amax(dim=1).clamp(min=1e-6) / 448.0
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale


def _reference(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, b_t.t(), a_scale[:, None].contiguous(), b_scale[None, :].contiguous(),
                            out_dtype=torch.bfloat16, use_fast_accum=True)


@pytest.mark.gpu
def test_gpu_products_equal_scaled_mm_as_the_rows_change():
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    b_t, b_scale = _codes(512, 1024, gen)
    served = 0
    for rows in (16, 48, 1040, 2000, 1024, 16):  # one plan for 1040 and 2000 (bucket 2048), rows changing
        a, a_scale = _codes(rows, 1024, gen)
        out = torch.empty(rows, 512, dtype=torch.bfloat16, device="cuda")
        if cublaslt_rowwise.rowwise_scaled_mm_(out, a, a_scale, b_t, b_scale):
            served += 1
            want = _reference(a, a_scale, b_t, b_scale).float()
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert served == 6


@pytest.mark.gpu
def test_gpu_column_slices_are_read_in_place_as_the_contraction_changes():
    """The weight gradient's operands: ``[P, m]`` and ``[Q, m]`` column slices of ``[P, M]`` and ``[Q, M]`` codes."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(1)
    a_t, _ = _codes(256, 4096, gen)
    b_t, _ = _codes(384, 4096, gen)
    starts, ends = [0, 1024, 1040, 2560], [1024, 1040, 2560, 4096]
    for start, end in zip(starts, ends):
        a_scale = torch.rand(256, device="cuda", generator=gen) + 0.5
        b_scale = torch.rand(384, device="cuda", generator=gen) + 0.5
        a_e, b_e = a_t[:, start:end], b_t[:, start:end]
        out = torch.empty(256, 384, dtype=torch.bfloat16, device="cuda")
        assert cublaslt_rowwise.rowwise_scaled_mm_(out, a_e, a_scale, b_e, b_scale)
        want = _reference(a_e, a_scale, b_e.contiguous(), b_scale).float()
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
def test_gpu_calls_it_does_not_take_are_refused_without_a_launch():
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(2)
    a, a_scale = _codes(64, 256, gen)
    b_t, b_scale = _codes(128, 256, gen)
    out = torch.full((64, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    assert not cublaslt_rowwise.rowwise_scaled_mm_(out, a.to(torch.float8_e5m2), a_scale, b_t, b_scale)
    assert not cublaslt_rowwise.rowwise_scaled_mm_(out[:, :120], a, a_scale, b_t[:120], b_scale[:120])
    assert not cublaslt_rowwise.rowwise_scaled_mm_(out, a, a_scale.double(), b_t, b_scale)
    assert torch.all(out == 7.0)
