"""The fused rotary embedding (``rope_utils``): values and gradients equal the plain formula; cos/sin reuse."""

from __future__ import annotations

import pytest
import torch

from megatron_core.transformer import rope_utils
from megatron_core.transformer.rope_utils import apply_rotary_pos_emb


def _freqs(seq: int, rot_dim: int, interleaved: bool) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.repeat_interleave(angles, 2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return emb[:, None, None, :]


def _reference(t, freqs, interleaved, mscale):
    rot_dim = freqs.shape[-1]
    cos, sin = (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype)
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    if interleaved:
        rotated = torch.stack((-t_rot[..., 1::2], t_rot[..., ::2]), dim=-1).flatten(-2)
    else:
        half = rot_dim // 2
        rotated = torch.cat((-t_rot[..., half:], t_rot[..., :half]), dim=-1)
    return torch.cat((t_rot * cos + rotated * sin, t_pass), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("mscale", [1.0, 0.7])
def test_fused_rotation_matches_the_formula_with_gradients(interleaved, rot_dim, mscale):
    gen = torch.Generator().manual_seed(0)
    seq, dim = 12, 16
    freqs = _freqs(seq + 3, rot_dim, interleaved)  # longer than the sequence, as RotaryEmbedding's table
    t = torch.randn(seq, 2, 3, dim, generator=gen, requires_grad=True)
    ref_t = t.detach().clone().requires_grad_(True)
    grad = torch.randn(seq, 2, 3, dim, generator=gen)
    out = apply_rotary_pos_emb(t, freqs, rotary_interleaved=interleaved, mscale=mscale)
    want = _reference(ref_t, freqs[:seq], interleaved, mscale)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(t.grad, ref_t.grad, rtol=1e-6, atol=1e-6)


def test_cos_and_sin_are_computed_once_per_angle_tensor():
    freqs = _freqs(8, 16, False)
    t = torch.randn(8, 1, 2, 16)
    apply_rotary_pos_emb(t, freqs)
    first = rope_utils._COS_SIN_CACHE[0][2]
    apply_rotary_pos_emb(t, freqs)  # the next layer: the same table
    assert rope_utils._COS_SIN_CACHE[0][2] is first
    freqs.mul_(2.0)  # changed in place: computed again
    out = apply_rotary_pos_emb(t, freqs)
    assert rope_utils._COS_SIN_CACHE[0][2] is not first
    torch.testing.assert_close(out, _reference(t, freqs, False, 1.0))


@pytest.mark.gpu
def test_compiled_fused_rotation_on_cuda_matches_the_formula():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    freqs = _freqs(2048, 64, False).cuda()
    t = torch.randn(2048, 2, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref_t = t.detach().float().requires_grad_(True)
    grad = torch.randn_like(t)
    out = apply_rotary_pos_emb(t, freqs)
    out.backward(grad)
    want = _reference(ref_t, freqs, False, 1.0)
    want.backward(grad.float())
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(t.grad.float(), ref_t.grad, rtol=2e-2, atol=2e-2)
