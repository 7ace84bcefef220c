"""The Triton SSD scan's kernels on the CPU, in Triton's interpreter, against the PyTorch reference scan (fp32).

Outputs and all six gradients within 1e-4 (relative norm of the difference), with a partial last chunk, B and C
as strided slices of one projection, per-head and per-channel D; once with the default block shapes and once with
16-wide blocks, a chunk of 32 rows and ``C B^T`` from the per-group scratch, so that every loop over ``head_dim``/``state_dim`` blocks runs several
steps and ``dt``'s gradient is added by several programs; then with the one-program-per-group backward
(``bwd_fused``).
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

_SCRIPT = """
import torch
from megatron_core.ssm import ssd_scan_triton
from megatron_core.ssm.ssd_scan import ssd_chunk_scan

def check(b, length, h, p, g, n, per_channel, seed):
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
    for fn in (ssd_scan_triton.ssd_chunk_scan_triton, lambda *a: ssd_chunk_scan(*a[:5], 32, D=a[5])):
        leaves = [t.detach().clone().requires_grad_() for t in (x, dt, A, B, C, D)]
        y = fn(*leaves)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("y", "x", "dt", "A", "B", "C", "D"), *results):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-4, f"{{name}}: {{err:.2e}} ({{(b, length, h, p, g, n)}}, blocks {{ssd_scan_triton.SCAN_BLOCKS}})"

check(1, 80, 4, 16, 2, 16, False, 0)  # two chunks, the last partial
check(1, 70, 2, 40, 1, 40, True, 1)   # head_dim and state_dim not powers of two
ssd_scan_triton.SCAN_BLOCKS.update({{key: 16 for key in ssd_scan_triton.SCAN_BLOCKS if key[-2:] in ('_p', '_n', '_k')}})
ssd_scan_triton.SCAN_BLOCKS.update(chunk=32, cb_scratch=1)  # and C B^T computed once per group
check(1, 80, 4, 40, 2, 40, True, 2)   # 3 head_dim / state_dim blocks per loop, dt's gradient by atomics; 3 chunks
ssd_scan_triton.SCAN_BLOCKS["bwd_fused"] = 1
check(1, 80, 4, 40, 2, 40, False, 3)  # the one-program-per-group backward, 3 head_dim blocks per head
"""


@pytest.mark.slow  # about 20-45 s on 2 cores
@needs_triton
def test_triton_scan_in_the_interpreter_matches_reference() -> None:
    run_in_triton_interpreter(_SCRIPT.format())
