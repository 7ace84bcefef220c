"""The hybrid model's inference kernels on CUDA against the PyTorch references (GPU only).

* The Triton SSD scan forward from an initial state with the final state returned (prefill) against
  ``ssd_chunk_scan`` in float64 on the CPU: fp32 within 1e-4, bf16 operands within 2e-2 (relative norm).
* The fused decode step against ``conv_step`` + ``ssm_step`` on the same device: fp32 within 1e-5, bf16
  activations and states within 1e-2; groups < heads, ``D`` ``[h]`` and ``[h, p]``, slots in arbitrary order,
  the other slots untouched; then replayed from a captured CUDA graph with new inputs and slots.
* The gated group RMSNorm kernel against ``ExtendedRMSNorm`` (Nemotron-H's 8 groups of 512): fp32 1e-5, bf16 1e-2.
* ``mixer_inference`` of a ``MambaMixer`` on CUDA (kernels; prefill chunks as one padded batch and one at a time)
  against its PyTorch path on the same device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.ssm import mamba_inference
from megatron_core.ssm.mamba_decode_triton import mamba_decode_step, mamba_decode_supported
from megatron_core.ssm.mamba_inference import conv_step, ssm_step
from megatron_core.ssm.ssd_scan import ssd_chunk_scan
from megatron_core.ssm.ssd_scan_triton import ssd_chunk_scan_triton, ssd_scan_triton_supported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 300, 8, 64, 2, 128, False), (2, 70, 6, 40, 3, 24, True)])
def test_triton_scan_from_a_state_matches_reference(dtype: torch.dtype, tol: float, shape: tuple) -> None:
    b, length, h, p, g, n, per_channel = shape
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(b, length, h, p, generator=gen)
    dt = torch.rand(b, length, h, generator=gen) * 0.5 + 0.01
    A = -torch.rand(h, generator=gen) * 4 - 0.1
    B = torch.randn(b, length, g, n, generator=gen) / n ** 0.5
    C = torch.randn(b, length, g, n, generator=gen)
    D = torch.randn(h, p, generator=gen) if per_channel else torch.randn(h, generator=gen)
    init = torch.randn(b, h, p, n, generator=gen)
    x, B, C, init = (t.to(dtype) for t in (x, B, C, init))
    want_y, want_final = ssd_chunk_scan(*(t.double() for t in (x, dt, A, B, C)), 32, D=D.double(),
                                        initial_state=init.double(), return_final_state=True)
    cuda = [t.cuda() for t in (x, dt, A, B, C, D)]
    assert ssd_scan_triton_supported(cuda[0], init, True)
    y, final = ssd_chunk_scan_triton(*cuda, initial_state=init.cuda(), return_final_state=True)
    assert y.dtype == dtype and final.dtype == torch.float32
    assert _rel(y, want_y) < tol and _rel(final, want_final) < tol


def _decode_inputs(h: int, p: int, g: int, n: int, K: int, per_channel: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    d_inner, ch = h * p, h * p + 2 * g * n
    proj = torch.randn(5, d_inner + ch + h, generator=gen).to(dtype)  # z | x B C | dt
    conv_states = torch.randn(9, ch, K, generator=gen).to(dtype)
    ssm_states = torch.randn(9, h, p, n, generator=gen).to(dtype)
    params = (torch.randn(ch, 1, K, generator=gen), torch.randn(ch, generator=gen), torch.randn(h, generator=gen),
              torch.rand(h, generator=gen), torch.randn(h, p, generator=gen) if per_channel else torch.randn(h, generator=gen))
    return [t.cuda() for t in (proj, conv_states, ssm_states, *params)]


def _reference(proj, conv_states, ssm_states, slots, weight, bias, dt_bias, A_log, D, g):
    rows, (h, p, n), ch = slots.shape[0], ssm_states.shape[1:], conv_states.shape[1]
    d_inner = h * p
    out, conv = conv_step(conv_states[slots], proj[:, d_inner:d_inner + ch], weight, bias)
    x, B, C = torch.split(out, [d_inner, g * n, g * n], -1)
    dt = F.softplus(proj[:, d_inner + ch:].float() + dt_bias)
    y, ssm = ssm_step(ssm_states[slots], x.reshape(rows, h, p), dt, -torch.exp(A_log), B.reshape(rows, g, n),
                      C.reshape(rows, g, n), D)
    conv_states[slots] = conv.to(conv_states.dtype)
    ssm_states[slots] = ssm.to(ssm_states.dtype)
    return y


def _kernel(proj, conv_states, ssm_states, slots, weight, bias, dt_bias, A_log, D, g):
    d_inner, ch = ssm_states.shape[1] * ssm_states.shape[2], conv_states.shape[1]
    return mamba_decode_step(proj[:, d_inner:], proj[:, d_inner + ch:], slots, conv_states, ssm_states, weight, bias,
                             dt_bias, A_log, D, g)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(8, 64, 2, 128, 4, False), (6, 20, 3, 24, 3, True)])
def test_fused_decode_step_matches_reference(dtype: torch.dtype, tol: float, shape: tuple) -> None:
    h, p, g, n, K, per_channel = shape
    proj, conv_states, ssm_states, *params = _decode_inputs(h, p, g, n, K, per_channel, dtype, seed=h)
    assert mamba_decode_supported(proj, conv_states, ssm_states)
    slots = torch.tensor([7, 0, 3, 5, 1], device="cuda")
    want_conv, want_ssm = conv_states.clone(), ssm_states.clone()
    want_y = _reference(proj, want_conv, want_ssm, slots, *params, g)
    y = _kernel(proj, conv_states, ssm_states, slots, *params, g)
    assert y.dtype == dtype
    assert _rel(y, want_y) < tol and _rel(conv_states, want_conv) < tol and _rel(ssm_states, want_ssm) < tol
    untouched = torch.tensor([2, 4, 6, 8], device="cuda")
    assert torch.equal(conv_states[untouched], want_conv[untouched])
    assert torch.equal(ssm_states[untouched], want_ssm[untouched])


def test_fused_decode_step_replays_in_a_cuda_graph() -> None:
    """Captured once on static input, slot and state buffers; replayed with new values it updates the slots the
    slot buffer names at replay time and matches the reference."""
    proj, conv_states, ssm_states, *params = _decode_inputs(8, 64, 2, 128, 4, True, torch.float32, seed=1)
    slots = torch.tensor([0, 1, 2, 3, 4], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (kernel build) outside the capture
        _kernel(proj, conv_states.clone(), ssm_states.clone(), slots, *params, 2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _kernel(proj, conv_states, ssm_states, slots, *params, 2)
    new_proj, new_conv, new_ssm, *_ = _decode_inputs(8, 64, 2, 128, 4, True, torch.float32, seed=2)
    for step in range(2):
        proj.copy_(new_proj if step == 0 else proj.roll(1, 0))
        slots.copy_(torch.tensor([8, 6, 0, 2, 4] if step == 0 else [1, 3, 5, 7, 0], device="cuda"))
        if step == 0:
            conv_states.copy_(new_conv)
            ssm_states.copy_(new_ssm)
        want_conv, want_ssm = conv_states.clone(), ssm_states.clone()
        want_y = _reference(proj, want_conv, want_ssm, slots, *params, 2)
        graph.replay()
        assert _rel(y, want_y) < 1e-5
        assert _rel(conv_states, want_conv) < 1e-5 and _rel(ssm_states, want_ssm) < 1e-5


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_gated_rmsnorm_matches_extended_rmsnorm(dtype: torch.dtype, tol: float, before: bool) -> None:
    from megatron_core.ssm.gated_rmsnorm_triton import gated_rmsnorm, gated_rmsnorm_supported
    from megatron_core.ssm.mamba_mixer import ExtendedRMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = ExtendedRMSNorm(4096, eps=1e-5, group_size=512, norm_before_gate=before).cuda()
    norm.weight.data = torch.randn(4096, generator=gen).cuda()
    yz = torch.randn(64, 2 * 4096 + 8, generator=gen).to(dtype).cuda()
    y, z = yz[:, :4096], yz[:, 4096 + 8:]
    assert gated_rmsnorm_supported(y, z, 512)
    with torch.no_grad():
        want = norm(y, z)
    assert _rel(gated_rmsnorm(y, z, norm.weight, norm.eps, 512, before), want) < tol


@pytest.mark.parametrize("prefill", [[(3, 7, 1), (10, 140, 4)], [(3, 1, 1), (4, 1, 4), (5, 145, 6)]],
                         ids=["one_padded_batch", "chunk_by_chunk"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mixer_inference_kernels_match_the_pytorch_path(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                        tol: float, prefill: list) -> None:
    from tests.inference.hybrid_fixture import build_hybrid

    mixer = build_hybrid("M", chunk_size=16, mamba_num_heads=6, mamba_state_dim=16).decoder.layers[0].mixer
    mixer = mixer.cuda().to(dtype)
    h, p, n, g = mixer.nheads_local_tp, mixer.headdim, mixer.d_state, mixer.ngroups_local_tp
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(150, 1, 2 * h * p + 2 * g * n + h, generator=gen).to(dtype).cuda()
    conv = torch.randn(8, mixer.conv1d_weight.shape[0], mixer.d_conv, generator=gen).to(dtype).cuda()
    ssm = torch.randn(8, h, p, n, generator=gen).to(dtype).cuda()

    class Context:
        def __init__(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
            self.conv, self.ssm = conv, ssm

        def mamba_states_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.conv, self.ssm

        def mamba_step_layout(self) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
            return torch.tensor([3, 0, 5], device="cuda"), prefill

    results = []
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(mamba_inference, "mamba_decode_supported", lambda *a: False)
            monkeypatch.setattr(mamba_inference, "ssd_scan_triton_supported", lambda *a: False)
            monkeypatch.setattr(mamba_inference, "gated_rmsnorm_supported", lambda *a: False)
        c, s = conv.clone(), ssm.clone()
        with torch.no_grad():
            results.append((mamba_inference.mixer_inference(mixer, proj, Context(c, s)), c, s))
    for got, want in zip(*results):
        assert _rel(got, want) < tol
