"""The hybrid model's inference kernels on the CPU, in Triton's interpreter, against the PyTorch references.

* The Triton SSD scan forward from an initial state, returning the final state (inference prefill), against
  ``ssd_chunk_scan`` in float64: fp32 within 1e-5 (relative norm), fp16 operands within 2e-3.
* The fused decode step (``mamba_decode_triton``: convolution window update, softplus, one-token recurrence, read
  and written in place in the slot tensors by slot index) against ``conv_step`` + ``ssm_step``: fp32 within 1e-5,
  bf16 activations (bf16 or fp32 states) within 3e-2; groups < heads, ``D`` ``[h]`` and ``[h, p]``, slots in
  arbitrary order, the other slots untouched.
* The gated group RMSNorm kernel against ``ExtendedRMSNorm`` (gate before and after the norm, groups not a power
  of two, ``y``/``z`` as column slices): fp32 within 1e-5, bf16 within 3e-2.
* The fused decode step and the gated RMSNorm compiled by ``torch.compile(fullgraph=True)`` (custom ops, the
  first mutating the slot tensors) equal the eager step, outputs and states.
* ``mixer_inference`` of a real ``MambaMixer`` (decode rows and prefill chunks in one step) through the kernels
  equals its PyTorch path (fp32, 1e-5): with the prefill chunks as one padded batch and one at a time.

The interpreter rounds fp32 -> bf16 by truncation (Triton 3.9; the GPU rounds to nearest) and its ``tl.dot`` on
bf16 operands is wrong, hence the wider bf16 bound and fp16 for the scan; tests/ssm/test_mamba_inference_gpu.py
checks bf16 on CUDA.
"""

from __future__ import annotations

from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

_SCAN = """
import torch
from megatron_core.ssm.ssd_scan import ssd_chunk_scan
from megatron_core.ssm.ssd_scan_triton import ssd_chunk_scan_triton

def check(b, length, h, p, g, n, per_channel, dtype, tol, seed, from_zeros=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, h, p, generator=gen).to(dtype)
    dt = torch.rand(b, length, h, generator=gen) * 0.5 + 0.01
    A = -torch.rand(h, generator=gen) * 4 - 0.1
    fused = torch.randn(b, length, 2 * g * n, generator=gen).to(dtype)
    B, C = (t.view(b, length, g, n) for t in torch.split(fused, [g * n, g * n], -1))  # strided slices
    D = torch.randn(h, p, generator=gen) if per_channel else torch.randn(h, generator=gen)
    init = torch.randn(b, h, p, n, generator=gen).to(dtype)
    y, final = ssd_chunk_scan_triton(x, dt, A, B, C, D, initial_state=init, return_final_state=True)
    want_y, want_final = ssd_chunk_scan(*(t.double() for t in (x, dt, A, B, C)), 32, D=D.double(),
                                        initial_state=init.double(), return_final_state=True)
    assert y.dtype == dtype and final.dtype == torch.float32 and final.shape == (b, h, p, n)
    for name, got, want in (("y", y, want_y), ("final", final, want_final)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tol, f"{name}: {err:.2e} {(b, length, h, p, g, n, dtype)}"
    if from_zeros:  # no initial state, the final state returned
        no_state = ssd_chunk_scan_triton(x, dt, A, B, C, D, return_final_state=True)[1]
        want = ssd_chunk_scan(*(t.double() for t in (x, dt, A, B, C)), 32, return_final_state=True)[1]
        assert ((no_state.double() - want).norm() / want.norm()).item() < tol

check(1, 80, 4, 16, 2, 16, False, torch.float32, 1e-5, 0, True)  # two kernel chunks, the last partial; 2 heads/group
check(2, 70, 4, 40, 1, 40, True, torch.float32, 1e-5, 1)   # batch 2, dims not powers of two, per-channel D
check(1, 5, 4, 16, 4, 16, False, torch.float32, 1e-5, 2)   # shorter than a chunk
check(1, 80, 4, 16, 2, 16, True, torch.float16, 2e-3, 3)   # half-precision operands, fp32 states
"""

_DECODE = """
import torch
import torch.nn.functional as F
from megatron_core.ssm.mamba_decode_triton import mamba_decode_step
from megatron_core.ssm.mamba_inference import conv_step, ssm_step

def check(h, p, g, n, K, per_channel, dtype, state_dtype, tol, seed):
    gen = torch.Generator().manual_seed(seed)
    d_inner, ch = h * p, h * p + 2 * g * n
    proj = torch.randn(3, d_inner + ch + h, generator=gen).to(dtype)  # z | x B C | dt, as in_proj lays them out
    conv_states = torch.randn(6, ch, K, generator=gen).to(state_dtype)
    ssm_states = torch.randn(6, h, p, n, generator=gen).to(state_dtype)
    weight, bias = torch.randn(ch, 1, K, generator=gen), torch.randn(ch, generator=gen)
    dt_bias, A_log = torch.randn(h, generator=gen), torch.rand(h, generator=gen)
    D = torch.randn(h, p, generator=gen) if per_channel else torch.randn(h, generator=gen)
    slots = torch.tensor([4, 0, 2])
    want_conv_states, want_ssm_states = conv_states.clone(), ssm_states.clone()
    y = mamba_decode_step(proj[:, d_inner:], proj[:, d_inner + ch:], slots, conv_states, ssm_states, weight, bias,
                          dt_bias, A_log, D, g)
    out, conv = conv_step(want_conv_states[slots], proj[:, d_inner:d_inner + ch], weight, bias)
    x, B, C = torch.split(out, [d_inner, g * n, g * n], -1)
    dt = F.softplus(proj[:, d_inner + ch:].float() + dt_bias)
    want_y, ssm = ssm_step(want_ssm_states[slots], x.reshape(3, h, p), dt, -torch.exp(A_log), B.reshape(3, g, n),
                           C.reshape(3, g, n), D)
    want_conv_states[slots] = conv.to(state_dtype)
    want_ssm_states[slots] = ssm.to(state_dtype)
    assert y.dtype == dtype and y.shape == (3, h, p)
    for name, got, want in (("y", y, want_y), ("conv", conv_states, want_conv_states),
                            ("ssm", ssm_states, want_ssm_states)):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol, f"{name}: {err:.2e} {(h, p, g, n, K, dtype, state_dtype)}"
    for s in (1, 3, 5):  # slots no row names are untouched
        assert torch.equal(conv_states[s], want_conv_states[s]) and torch.equal(ssm_states[s], want_ssm_states[s])

check(4, 8, 2, 16, 4, False, torch.float32, torch.float32, 1e-5, 0)    # 2 heads per group, D [h]
check(6, 20, 3, 24, 3, True, torch.float32, torch.float32, 1e-5, 1)    # dims not powers of two, D [h, p]
check(4, 8, 2, 16, 4, True, torch.bfloat16, torch.bfloat16, 3e-2, 2)   # bf16 activations and states
check(4, 8, 1, 16, 4, False, torch.bfloat16, torch.float32, 3e-2, 3)   # bf16 activations, fp32 states, one group
"""

_NORM = """
import torch
from megatron_core.ssm.gated_rmsnorm_triton import gated_rmsnorm
from megatron_core.ssm.mamba_mixer import ExtendedRMSNorm

def check(rows, width, group, before, dtype, tol, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = ExtendedRMSNorm(width, eps=1e-5, group_size=group, norm_before_gate=before)
    norm.weight.data = torch.randn(width, generator=gen)
    yz = torch.randn(rows, 2 * width + 3, generator=gen).to(dtype)
    y, z = yz[:, :width], yz[:, width + 3:]  # column slices of one tensor, as in_proj's output gives them
    got = gated_rmsnorm(y, z, norm.weight, norm.eps, group, before)
    with torch.no_grad():
        want = norm(y, z)
    assert got.dtype == dtype and got.shape == want.shape
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < tol, f"{{err:.2e}} {{(rows, width, group, before, dtype)}}"

check(3, 64, 16, False, torch.float32, 1e-5, 0)   # 4 groups, gate before the norm (the mixer's default)
check(2, 120, 40, True, torch.float32, 1e-5, 1)   # groups of 40 (not a power of two), gate after the norm
check(3, 64, 32, False, torch.bfloat16, 3e-2, 2)  # bf16
"""

_COMPILED = """
import torch
from megatron_core.ssm.gated_rmsnorm_triton import gated_rmsnorm
from megatron_core.ssm.mamba_decode_triton import mamba_decode_step

gen = torch.Generator().manual_seed(0)
h, p, g, n, K = 4, 8, 2, 16, 4
d_inner, ch = h * p, h * p + 2 * g * n
proj = torch.randn(3, d_inner + ch + h, generator=gen)
conv_states, ssm_states = torch.randn(6, ch, K, generator=gen), torch.randn(6, h, p, n, generator=gen)
params = (torch.randn(ch, 1, K, generator=gen), torch.randn(ch, generator=gen), torch.randn(h, generator=gen),
          torch.rand(h, generator=gen), torch.randn(h, generator=gen))

norm_weight = torch.randn(d_inner, generator=gen)

def step(proj, conv_states, ssm_states, slots):
    y = mamba_decode_step(proj[:, d_inner:], proj[:, d_inner + ch:], slots, conv_states, ssm_states, *params, g)
    return gated_rmsnorm(y.reshape(3, d_inner), proj[:, :d_inner], norm_weight, 1e-5, d_inner // g) * 2

slots = torch.tensor([4, 0, 2])
eager = [conv_states.clone(), ssm_states.clone()]
want = step(proj, *eager, slots)
compiled = [conv_states.clone(), ssm_states.clone()]
got = torch.compile(step, fullgraph=True)(proj, *compiled, slots)
assert torch.equal(got, want)
assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])  # the slots updated in place
assert not torch.equal(compiled[1], ssm_states)
"""

_MIXER = """
import torch
from megatron_core.ssm import mamba_inference, ssd_scan_triton
from tests.inference.hybrid_fixture import build_hybrid

# 3 decode rows, then prefill chunks: 7, 20 (two kernel chunks of 16 rows) and 15 rows, one padded batch; then 1, 1
# and 20 rows, too much padding for one batch: one scan per chunk.
LAYOUTS = ([(3, 7, 1), (10, 20, 4), (30, 15, 6)], [(3, 1, 1), (4, 1, 4), (5, 20, 6)])
ssd_scan_triton.SCAN_BLOCKS["chunk"] = 16

class Context:
    def __init__(self, conv, ssm, prefill):
        self.conv, self.ssm, self.prefill = conv, ssm, prefill
    def mamba_states_cache(self, layer):
        return self.conv, self.ssm
    def mamba_step_layout(self):
        return torch.tensor([3, 0, 5]), self.prefill

def run(mixer, proj, conv, ssm, prefill, kernels):
    saved = (mamba_inference.mamba_decode_supported, mamba_inference.ssd_scan_triton_supported,
             mamba_inference.gated_rmsnorm_supported)
    if kernels:  # the CUDA checks, passed on the CPU tensors the interpreter runs on
        mamba_inference.mamba_decode_supported = lambda *a: True
        mamba_inference.ssd_scan_triton_supported = lambda *a: True
        mamba_inference.gated_rmsnorm_supported = lambda *a: True
    try:
        with torch.no_grad():
            context = Context(conv, ssm, prefill)
            out = mamba_inference.mixer_inference(mixer, proj, context)
            batched = getattr(context, "_mamba_prefill_batch_plan", None) is not None
            assert batched == (kernels and prefill is LAYOUTS[0]), batched
            return out
    finally:
        (mamba_inference.mamba_decode_supported, mamba_inference.ssd_scan_triton_supported,
         mamba_inference.gated_rmsnorm_supported) = saved

for d_has_hdim, prefill in ((False, LAYOUTS[0]), (True, LAYOUTS[0]), (False, LAYOUTS[1])):
    mixer = build_hybrid("M", chunk_size=16, mamba_num_heads=6, mamba_state_dim=16).decoder.layers[0].mixer
    if d_has_hdim:
        mixer.D = torch.nn.Parameter(torch.randn(mixer.d_inner_local_tp))
        mixer.D_has_hdim = True
    gen = torch.Generator().manual_seed(0)
    h, p, n, g = mixer.nheads_local_tp, mixer.headdim, mixer.d_state, mixer.ngroups_local_tp
    assert g < h
    proj = torch.randn(45, 1, 2 * h * p + 2 * g * n + h, generator=gen)
    conv = torch.randn(8, mixer.conv1d_weight.shape[0], mixer.d_conv, generator=gen)
    ssm = torch.randn(8, h, p, n, generator=gen)
    results = []
    for kernels in (True, False):
        c, s = conv.clone(), ssm.clone()
        results.append((run(mixer, proj[:prefill[-1][0] + prefill[-1][1]], c, s, prefill, kernels), c, s))
    for name, got, want in zip(("out", "conv", "ssm"), *results):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-5, f"{name}: {err:.2e} (D_has_hdim={d_has_hdim})"
    assert not torch.equal(results[0][2], ssm)  # the states moved
"""


@needs_triton
def test_triton_scan_from_a_state_in_the_interpreter() -> None:
    run_in_triton_interpreter(_SCAN)


@needs_triton
def test_fused_decode_step_in_the_interpreter() -> None:
    run_in_triton_interpreter(_DECODE)


@needs_triton
def test_gated_rmsnorm_in_the_interpreter() -> None:
    run_in_triton_interpreter(_NORM.format())


@needs_triton
def test_fused_decode_step_under_torch_compile_in_the_interpreter() -> None:
    """What ``compile_decode_graphs`` relies on: traced whole (``fullgraph``) as a custom op that mutates the slot
    tensors, the compiled step gives the eager step's output and states."""
    run_in_triton_interpreter(_COMPILED)


@needs_triton
def test_mixer_inference_through_the_kernels_in_the_interpreter() -> None:
    run_in_triton_interpreter(_MIXER)
