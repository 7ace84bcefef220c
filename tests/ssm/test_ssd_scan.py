"""The chunked SSD scan against a naive per-timestep recurrence: outputs, final state and gradients (fp32)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.ssm.ssd_scan import ssd_chunk_scan


def naive_scan(x, dt, A, B, C, D):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T; y_t = h_t C_t + D x_t, one step at a time."""
    b, length, h, p = x.shape
    per_group = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(per_group, 2), C.repeat_interleave(per_group, 2)
    state = x.new_zeros(b, h, p, B.shape[3])
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = state * decay + dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, 1), state


def _inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, h, p, g, n = 2, 4, 3, 2, 5
    x = torch.randn(b, length, h, p, generator=gen)
    dt = torch.rand(b, length, h, generator=gen) * 0.5 + 0.05
    A = -torch.rand(h, generator=gen) * 3 - 0.1
    B = torch.randn(b, length, g, n, generator=gen)
    C = torch.randn(b, length, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


@pytest.mark.parametrize("length,chunk", [(13, 1), (13, 4), (13, 5), (17, 8), (7, 16), (16, 4)])
def test_chunked_scan_matches_recurrence(length, chunk):
    inputs = _inputs(length)
    ref_y, ref_state = naive_scan(*inputs)
    grad_y = torch.randn_like(ref_y)
    ref_grads = torch.autograd.grad((ref_y * grad_y).sum() + ref_state.sum(), inputs)
    x, dt, A, B, C, D = inputs
    y, state = ssd_chunk_scan(x, dt, A, B, C, chunk, D=D, return_final_state=True)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((y * grad_y).sum() + state.sum(), inputs)
    for name, got, want in zip("x dt A B C D".split(), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


def test_bad_chunk_size_and_groups_raise():
    x, dt, A, B, C, D = (t.detach() for t in _inputs(4))
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunk_scan(x, dt, A, B, C, 0)
    with pytest.raises(ValueError, match=r"heads \(4\).*groups \(3\)"):
        ssd_chunk_scan(x, dt, A, B[:, :, :1].expand(-1, -1, 3, -1), C[:, :, :1].expand(-1, -1, 3, -1), 4)
