"""The Triton SSD scan and the compiled causal convolution on CUDA against the PyTorch references (GPU only).

The reference is :func:`megatron_core.ssm.ssd_scan.ssd_chunk_scan` in float64 on the CPU; errors are
``||got - ref|| / ||ref||`` over outputs and every input's gradient: fp32 kernels (full-precision products)
within 1e-4, bf16 (bf16 operands, fp32 accumulation and running states, per-chunk states kept in bf16 or fp32)
within 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.ssm.causal_conv1d import causal_conv1d_silu
from megatron_core.ssm.ssd_scan import ssd_chunk_scan
from megatron_core.ssm.ssd_scan_triton import ssd_chunk_scan_triton, ssd_scan_triton_supported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NAMES = ("x", "dt", "A", "B", "C", "D")


def _inputs(b: int, length: int, h: int, p: int, g: int, n: int, d_per_channel: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, h, p, generator=gen)
    dt = torch.rand(b, length, h, generator=gen) * 0.5 + 0.01
    A = -torch.rand(h, generator=gen) * 4 - 0.1
    B = torch.randn(b, length, g, n, generator=gen) / n ** 0.5
    C = torch.randn(b, length, g, n, generator=gen)
    D = torch.randn(h, p, generator=gen) if d_per_channel else torch.randn(h, generator=gen)
    return [x, dt, A, B, C, D]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).norm() / want.norm().clamp(min=1e-30)).item()


def _value_and_grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [
    (2, 300, 8, 64, 2, 128, False),  # Nemotron-H-like head and state sizes, a partial last chunk
    (1, 64, 4, 24, 4, 16, True),     # one chunk, per-channel D, one head per group
    (2, 129, 6, 80, 3, 40, False),   # head_dim over one backward block: atomics on dt
])
def test_triton_scan_matches_reference(dtype: torch.dtype, tol: float, shape: tuple) -> None:
    *dims, d_per_channel = shape
    inputs = _inputs(*dims, d_per_channel, seed=sum(dims))
    dy = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(7))
    want_y, want_grads = _value_and_grads(
        lambda x, dt, A, B, C, D: ssd_chunk_scan(x, dt, A, B, C, 32, D=D), [t.double() for t in inputs], dy.double())
    cuda = [t.cuda() for t in inputs]
    for i in (0, 3, 4):  # x, B, C in the activation dtype; dt, A, D stay fp32 as in the mixer
        cuda[i] = cuda[i].to(dtype)
    assert ssd_scan_triton_supported(cuda[0])
    got_y, got_grads = _value_and_grads(ssd_chunk_scan_triton, cuda, dy.cuda().to(dtype))
    assert got_y.dtype == dtype and torch.isfinite(got_y).all()
    assert _rel(got_y, want_y) < tol, _rel(got_y, want_y)
    for name, got, want in zip(NAMES, got_grads, want_grads):
        assert got.shape == want.shape, name
        assert _rel(got, want) < tol, f"grad {name}: {_rel(got, want):.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("blocks", [
    {"chunk": 128},                                       # the longest chunk the kernels take
    {"chunk": 32, "fwd_k": 32, "dx_k": 32, "dbc_n": 32},  # short chunks, several state_dim blocks per loop
    {"dx_p": 32, "dbc_p": 32, "state_p": 16, "state_n": 128, "fwd_p": 32},  # dt's gradient by atomics
    {"cb_scratch": 1},                                    # C B^T once per group, read by its heads
    {"bwd_fused": 1},                                     # one backward program per (chunk, group)
    {"bwd_fused": 1, "fused_p": 32, "chunk": 32},
    {"states_lowp": 0},                                   # per-chunk states kept in fp32
    {"states_lowp": 0, "bwd_fused": 1},
    {"state_p": 32},                                      # two head_dim blocks per walk program
], ids=["chunk128", "chunk32-k32", "p32", "cb-scratch", "bwd-fused", "bwd-fused-p32", "fp32-states",
        "fp32-states-fused", "state-p32"])
def test_triton_scan_block_variants_match_reference(dtype: torch.dtype, tol: float, blocks: dict,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Other ``SCAN_BLOCKS`` (what ``--scan-variants`` times) give the same function, outputs and gradients."""
    from megatron_core.ssm import ssd_scan_triton

    for key, value in blocks.items():
        monkeypatch.setitem(ssd_scan_triton.SCAN_BLOCKS, key, value)
    inputs = _inputs(2, 300, 8, 64, 2, 128, False, seed=5)
    dy = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(8))
    want_y, want_grads = _value_and_grads(
        lambda x, dt, A, B, C, D: ssd_chunk_scan(x, dt, A, B, C, 32, D=D), [t.double() for t in inputs], dy.double())
    cuda = [t.cuda() for t in inputs]
    for i in (0, 3, 4):
        cuda[i] = cuda[i].to(dtype)
    got_y, got_grads = _value_and_grads(ssd_chunk_scan_triton, cuda, dy.cuda().to(dtype))
    assert _rel(got_y, want_y) < tol, _rel(got_y, want_y)
    for name, got, want in zip(NAMES, got_grads, want_grads):
        assert got.shape == want.shape, name
        assert _rel(got, want) < tol, f"grad {name}: {_rel(got, want):.2e}"


def test_triton_scan_reads_strided_slices_and_compiles() -> None:
    """B and C as slices of one projection (the mixer's layout) and the scan inside ``torch.compile``."""
    b, length, h, p, g, n = 2, 200, 4, 32, 2, 64
    x, dt, A, B, C, D = (t.cuda() for t in _inputs(b, length, h, p, g, n, False, seed=3))
    fused = torch.cat([x.flatten(2), B.flatten(2), C.flatten(2)], -1).bfloat16()
    xs, Bs, Cs = torch.split(fused, [h * p, g * n, g * n], -1)
    args = (xs.view(b, length, h, p), dt, A, Bs.view(b, length, g, n), Cs.view(b, length, g, n), D)
    eager = ssd_chunk_scan_triton(*args)
    compiled = torch.compile(ssd_chunk_scan_triton, fullgraph=True)(*args)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    want = ssd_chunk_scan(*(t.double().cpu() for t in args[:5]), 64, D=D.double().cpu())
    assert _rel(eager, want) < 2e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_compiled_conv_matches_cpu_conv(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 333, 96, generator=gen)
    weight, bias = torch.randn(96, 1, 4, generator=gen) * 0.5, torch.randn(96, generator=gen)
    dy = torch.randn(2, 333, 96, generator=gen)
    want, want_grads = _value_and_grads(causal_conv1d_silu, [x.double(), weight.double(), bias.double()], dy.double())
    got, got_grads = _value_and_grads(causal_conv1d_silu, [x.cuda().to(dtype), weight.cuda(), bias.cuda()],
                                      dy.cuda().to(dtype))
    assert _rel(got, want) < tol
    for name, g, w in zip(("x", "weight", "bias"), got_grads, want_grads):
        assert _rel(g, w) < tol, name
