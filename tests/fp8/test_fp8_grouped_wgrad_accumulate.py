"""The experts' FP8 weight-gradient grouped GEMM that accumulates into ``main_grad`` (``fp8.grouped_wgrad_accumulate``).

* CPU, Triton's interpreter (exact on e4m3 operands): ``main_grad[e] += dy_e.T @ x_e`` times the two dequantizing
  scales against float64, for experts of different sizes (one with no tokens, whose ``main_grad`` stays bit for
  bit), sizes that are not multiples of the tiles, fp32 and bf16 ``main_grad``, small tiles so that every loop runs
  several steps.
* CPU: wrong shapes and a non-contiguous operand are refused before any launch, naming the tensor.
* CPU, compiled for sm_90 (no GPU): the kernel at the default tiles fits an SM and uses Hopper's FP8 tensor-core
  instructions.
* GPU: against ``torch._scaled_grouped_mm``'s ``dW`` added to ``main_grad``, and the FP8-parameter grouped GEMM's
  backward with ``ACCUMULATE_WGRAD_IN_GEMM`` against the same backward without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

_CHECK = """
import torch
from megatron_core.fp8 import grouped_wgrad_accumulate as gw

def check(out_features, in_features, counts, dtype, blocks):
    gw.WGRAD_BLOCKS.update(blocks)
    gen = torch.Generator().manual_seed(sum(counts) + out_features)
    tokens, experts = sum(counts), len(counts)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    dyt = (torch.randn(out_features, tokens, generator=gen) * 4).to(torch.float8_e4m3fn)
    xt = (torch.randn(in_features, tokens, generator=gen) * 4).to(torch.float8_e4m3fn)
    dyt_scale = torch.exp2(torch.randint(-8, 2, (experts * out_features,), generator=gen).float())
    xt_scale = torch.exp2(torch.randint(-8, 2, (experts * in_features,), generator=gen).float())
    main_grad = torch.randn(experts, out_features, in_features, generator=gen).to(dtype)
    want = main_grad.double().clone()
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        product = dyt[:, rows].double() @ xt[:, rows].double().T
        want[e] += product * dyt_scale.view(experts, -1)[e, :, None].double() * xt_scale.view(experts, -1)[e].double()
        start += count
    got = main_grad.clone()
    gw.grouped_wgrad_accumulate_(got, dyt, xt, dyt_scale, xt_scale, ends)
    assert got.dtype == dtype and got.shape == main_grad.shape
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.equal(got[e], main_grad[e]), e  # an expert without tokens adds nothing
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < (1e-7 if dtype == torch.float32 else 4e-3), (out_features, in_features, counts, dtype, err)

small = dict(BM=32, BN=32, BK=32, warps=4, stages=1)
check(40, 70, [48, 0, 16, 80], torch.float32, small)   # partial tiles, a partial token step, an empty expert
check(64, 32, [16, 96], torch.bfloat16, small)          # bf16 main_grad
check(48, 80, [32, 32, 0], torch.float32, dict(BM=16, BN=64, BK=16, warps=4, stages=1))
"""


@needs_triton
def test_grouped_wgrad_accumulate_in_the_interpreter() -> None:
    run_in_triton_interpreter(_CHECK)


@needs_triton
def test_grouped_wgrad_accumulate_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from triton_resources import compile_launch, record_launches

    from megatron_core.fp8 import grouped_wgrad_accumulate as gw

    meta = torch.device("meta")
    out_features, in_features, tokens, experts = 11264, 2048, 8192, 8  # Mixtral-shaped fc1 at 8192 routed rows
    with record_launches() as launches:
        gw._accumulate(torch.empty(experts, out_features, in_features, device=meta),
                       torch.empty(out_features, tokens, device=meta, dtype=torch.float8_e4m3fn),
                       torch.empty(in_features, tokens, device=meta, dtype=torch.float8_e4m3fn),
                       torch.empty(experts * out_features, device=meta), torch.empty(experts * in_features, device=meta),
                       torch.empty(experts, device=meta, dtype=torch.int32))
    (compiled,) = [compile_launch(*launch) for launch in launches]
    assert compiled.resident_warps >= compiled.warps and compiled.spill_stores == 0, compiled
    assert compiled.wgmma > 0, "the kernel's product is not on Hopper's tensor cores"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_wgrad_accumulate_matches_scaled_grouped_mm_plus_add() -> None:
    from megatron_core.fp8 import scaled_grouped_mm as sgm
    from megatron_core.fp8.grouped_wgrad_accumulate import (
        grouped_wgrad_accumulate_,
        grouped_wgrad_accumulate_supported,
    )

    if not sgm.scaled_grouped_mm_supported(torch.empty(16, 16, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("needs torch._scaled_grouped_mm (Hopper)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [256, 0, 512, 1024, 128, 64, 16, 48]
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    grad = torch.randn(sum(counts), 1408, device="cuda", generator=gen).bfloat16()
    x = torch.randn(sum(counts), 512, device="cuda", generator=gen).bfloat16()
    main_grad = torch.randn(len(counts), 1408, 512, device="cuda", generator=gen)
    assert grouped_wgrad_accumulate_supported(main_grad, grad)
    want = main_grad + sgm.wgrad_gemm(grad, x, ends).float()
    got = main_grad.clone()
    grouped_wgrad_accumulate_(got, *sgm.wgrad_operands(grad, x, ends), ends)
    # The reference's dW is rounded to bf16 before its addition; ours is added in fp32.
    assert ((got - want).norm() / (want - main_grad).norm()).item() < 1e-2
    assert torch.equal(got[1], main_grad[1])


def test_wrong_shapes_and_layouts_are_refused_naming_the_tensor():
    """Checked before any launch: a ``main_grad`` or scale of the wrong shape, or a non-contiguous operand."""
    from megatron_core.fp8 import grouped_wgrad_accumulate as gw

    codes = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)  # out 8, 32 tokens
    ends = torch.tensor([16, 32], dtype=torch.int32)
    args = dict(main_grad=torch.zeros(2, 8, 4), dyt_codes=codes, xt_codes=torch.zeros(4, 32, dtype=codes.dtype),
                dyt_scale=torch.ones(16), xt_scale=torch.ones(8), ends=ends)
    for name, bad, message in (("main_grad", torch.zeros(3, 8, 4), r"main_grad \(3, 8, 4\) must be \(2, 8, 4\)"),
                               ("xt_scale", torch.ones(4), r"xt_scale \(4,\) must be \(8,\)"),
                               ("xt_codes", torch.zeros(32, 4, dtype=codes.dtype).t(), "xt_codes must be contiguous")):
        with pytest.raises(ValueError, match=message):
            gw._accumulate(**{**args, name: bad})
