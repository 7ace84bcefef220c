"""The Triton SSD scan's kernels on the CPU, in Triton's interpreter, against the PyTorch reference scan (fp32).

Outputs and all six gradients within 1e-4 (relative norm of the difference), with a partial last chunk, B and C
as strided slices of one projection, per-head and per-channel D; once with the default block shapes and once with
16-wide blocks, a chunk of 32 rows and ``C B^T`` from the per-group scratch, so that every loop over ``head_dim``/``state_dim`` blocks runs several
steps and ``dt``'s gradient is added by several programs; then with the one-program-per-group backward
(``bwd_fused``). Then fp16 operands (the interpreter's ``tl.dot`` on bf16 is wrong; the GPU tests check bf16)
with the per-chunk states kept in fp16 (``states_lowp``) and in fp32 (the default), both against float64 within
1e-3 (measured: 2e-4 to 4e-4, the same for both), for both backward layouts.
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

_SCRIPT = """
import torch
from megatron_core.ssm import ssd_scan_triton
from megatron_core.ssm.ssd_scan import ssd_chunk_scan

def check(b, length, h, p, g, n, per_channel, seed, dtype=torch.float32, tol=1e-4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, h, p, generator=gen)
    dt = torch.rand(b, length, h, generator=gen) * 0.5 + 0.01
    A = -torch.rand(h, generator=gen) * 4 - 0.1
    fused = torch.randn(b, length, 2 * g * n, generator=gen)
    B, C = (t.view(b, length, g, n) for t in torch.split(fused, [g * n, g * n], -1))  # strided slices
    B = B / n ** 0.5
    D = torch.randn(h, p, generator=gen) if per_channel else torch.randn(h, generator=gen)
    dy = torch.randn(b, length, h, p, generator=gen)
    results = []
    # x, B, C, dy in the operand dtype (dt, A, D fp32, as in the mixer); the reference in float64 on the same values.
    ours = [t.to(dtype) if i in (0, 3, 4) else t for i, t in enumerate((x, dt, A, B, C, D))]
    runs = ((ssd_scan_triton.ssd_chunk_scan_triton, ours, dy.to(dtype)),
            (lambda *a: ssd_chunk_scan(*a[:5], 32, D=a[5]), [t.double() for t in ours], dy.to(dtype).double()))
    for fn, inputs, grad_out in runs:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(grad_out)
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("y", "x", "dt", "A", "B", "C", "D"), *results):
        assert got.shape == want.shape and torch.isfinite(got).all(), name
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tol, f"{{name}}: {{err:.2e}} ({{(b, length, h, p, g, n)}}, {{dtype}}, blocks {{ssd_scan_triton.SCAN_BLOCKS}})"

check(1, 80, 4, 16, 2, 16, False, 0)  # two chunks, the last partial
check(1, 70, 2, 40, 1, 40, True, 1)   # head_dim and state_dim not powers of two
ssd_scan_triton.SCAN_BLOCKS.update({{key: 16 for key in ssd_scan_triton.SCAN_BLOCKS if key[-2:] in ('_p', '_n', '_k')}})
ssd_scan_triton.SCAN_BLOCKS.update(chunk=32, cb_scratch=1)  # and C B^T computed once per group
check(1, 80, 4, 40, 2, 40, True, 2)   # 3 head_dim / state_dim blocks per loop, dt's gradient by atomics; 3 chunks
ssd_scan_triton.SCAN_BLOCKS["bwd_fused"] = 1
check(1, 80, 4, 40, 2, 40, False, 3)  # the one-program-per-group backward, 3 head_dim blocks per head
for fused in (1, 0):
    ssd_scan_triton.SCAN_BLOCKS["bwd_fused"] = fused
    for lowp in (1, 0):
        ssd_scan_triton.SCAN_BLOCKS["states_lowp"] = lowp
        check(1, 80, 4, 40, 2, 40, False, 4, torch.float16, 1e-3)  # states kept in fp16, then in fp32
"""


@pytest.mark.slow  # about 20-45 s on 2 cores
@needs_triton
def test_triton_scan_in_the_interpreter_matches_reference() -> None:
    run_in_triton_interpreter(_SCRIPT.format())
