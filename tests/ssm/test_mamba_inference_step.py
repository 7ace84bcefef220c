"""The Mamba state recurrences of ``ssm.mamba_inference`` against the training path's full-sequence kernels (fp32, CPU).

Token-by-token ``conv_step`` / ``ssm_step`` from zero states give the outputs of ``causal_conv1d_silu`` and
``ssd_chunk_scan`` at every position and the scan's final state; prefill split at any point (the state handed
from the first part to the second) gives the same outputs and states as one prefill.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.ssm.causal_conv1d import causal_conv1d_silu
from megatron_core.ssm.mamba_inference import conv_prefill, conv_step, ssm_prefill, ssm_step
from megatron_core.ssm.ssd_scan import ssd_chunk_scan

L, H, P, G, N, CH, K = 13, 4, 3, 2, 5, 7, 4


def _scan_inputs(seed: int, d_has_hdim: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, L, H, P, generator=gen)
    dt = F.softplus(torch.randn(1, L, H, generator=gen))
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    B = torch.randn(1, L, G, N, generator=gen)
    C = torch.randn(1, L, G, N, generator=gen)
    D = torch.randn(H, P, generator=gen) if d_has_hdim else torch.randn(H, generator=gen)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("d_has_hdim", [False, True])
def test_ssm_step_walks_the_chunked_scan(d_has_hdim):
    x, dt, A, B, C, D = _scan_inputs(0, d_has_hdim)
    y_full, final = ssd_chunk_scan(x, dt, A, B, C, 4, D=D, return_final_state=True)
    state = torch.zeros(1, H, P, N)
    for t in range(L):
        y, state = ssm_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        torch.testing.assert_close(y, y_full[:, t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [1, 4, 9])
def test_ssm_prefill_split_hands_its_state_on(split):
    x, dt, A, B, C, D = _scan_inputs(1, False)
    y_full, final = ssd_chunk_scan(x, dt, A, B, C, 4, D=D, return_final_state=True)
    first, mid = ssm_prefill(torch.zeros(H, P, N), x[:, :split], dt[:, :split], A, B[:, :split], C[:, :split], D, 4)
    second, end = ssm_prefill(mid, x[:, split:], dt[:, split:], A, B[:, split:], C[:, split:], D, 4)
    torch.testing.assert_close(torch.cat([first, second], dim=1), y_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final[0], atol=1e-5, rtol=1e-5)


def test_conv_step_and_split_prefill_equal_the_causal_conv():
    gen = torch.Generator().manual_seed(2)
    xBC = torch.randn(1, L, CH, generator=gen)
    weight, bias = torch.randn(CH, 1, K, generator=gen), torch.randn(CH, generator=gen)
    full = causal_conv1d_silu(xBC, weight, bias)
    state = torch.zeros(1, CH, K)
    for t in range(L):
        out, state = conv_step(state, xBC[:, t], weight, bias)
        torch.testing.assert_close(out, full[:, t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], xBC[0, -K:].t())  # the last K inputs, oldest first
    first, mid = conv_prefill(torch.zeros(CH, K), xBC[:, :2], weight, bias)  # shorter than the kernel
    second, end = conv_prefill(mid, xBC[:, 2:], weight, bias)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, state[0])
