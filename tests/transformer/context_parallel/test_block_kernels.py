"""Ring attention's block kernels: blocks merged by log-sum-exp equal full attention, and the block
backward with the merged statistics gives autograd's gradients (row tiling included; CPU and GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.transformer import attention_kernels as ak
from megatron_core.transformer.context_parallel import _merge

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", [None, 64])
def test_merged_blocks_equal_full_attention(device: str, tile: int | None, monkeypatch):
    if tile is not None:
        monkeypatch.setattr(ak, "_TILE_ELEMENTS", tile)  # a few rows per tile
    gen = torch.Generator().manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 12, 8
    q = torch.randn(b, h, s, d, generator=gen).to(device).requires_grad_()
    k = torch.randn(b, hk, s, d, generator=gen).to(device).requires_grad_()
    v = torch.randn(b, hk, s, d, generator=gen).to(device).requires_grad_()
    dout = torch.randn(b, h, s, d, generator=gen).to(device)
    scale = d ** -0.5
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    ref.backward(dout)

    half = s // 2
    q_pos = torch.arange(s, device=device)
    blocks = [  # (key columns, keep mask [s, cols])
        (slice(0, half), ak.window_keep(s, half, None, True, q.device, q_pos, torch.arange(half, device=device))),
        (slice(half, s), ak.window_keep(s, s - half, None, True, q.device, q_pos, torch.arange(half, s, device=device))),
    ]
    out = torch.zeros(b, h, s, d, device=device)
    lse = torch.full((b, h, s), float("-inf"), device=device)
    with torch.no_grad():
        for cols, keep in blocks:
            o, l_ = ak.block_forward(q, k[:, :, cols], v[:, :, cols], scale, keep)
            _merge(out, lse, o, l_, slice(0, s))
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)

    delta = (dout * out).sum(-1)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for cols, keep in blocks:
        gq, gk, gv = ak.block_backward(dout, q, k[:, :, cols], v[:, :, cols], lse, delta, scale, keep)
        dq += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_causal_mask_fast_path_on_gpu():
    """bf16 on CUDA: the model's output with the plain causal mask tensor equals the output without it."""
    from tests.models.gpt_test_utils import VOCAB, build, llama_like

    torch.manual_seed(0)
    model = build(llama_like(), params_dtype=torch.bfloat16, bf16=True).cuda().bfloat16()
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    pos = torch.arange(16, device="cuda")[None]
    mask = torch.ones(16, 16, dtype=torch.bool, device="cuda").triu(1)[None, None]
    with torch.no_grad():
        assert torch.equal(model(ids, pos, None), model(ids, pos, mask))
