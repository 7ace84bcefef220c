"""The Triton paths of ``megatron_core.ssm.ops``: on CPU in Triton's interpreter, compiled for sm_90, and on CUDA.

* Interpreter: ``causal_conv1d_update``'s and ``selective_state_update``'s kernels (padding rows, slots in any
  order, several tokens per row, intermediate states) against their PyTorch paths, and the varlen scan's padded-batch
  Triton path against the PyTorch passes; fp32 within 1e-5 (the PyTorch paths are checked against the float64
  recurrence in tests/ssm/test_ssm_ops.py).
* Both kernels compile to a cubin for ``GPUTarget("cuda", 90, 32)`` (bf16 and fp32 tensors).
* GPU (``gpu`` marker): every op on CUDA in fp32 and bf16 against the float64 references.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ssm.ssm_ops_reference import conv_reference, pack, recurrence, rel
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

_DECODE = """
import torch
import megatron_core.ssm.ops.causal_conv1d_triton as conv_mod
import megatron_core.ssm.ops.mamba_ssm as ssm_mod

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()

torch_conv, torch_ssm = conv_mod._update_torch, ssm_mod._update_torch
gen = torch.Generator().manual_seed(0)
for seq_len, state_len, with_bias in ((1, 4, True), (3, 4, False), (2, 6, True)):
    dim, width = 70, 4
    states = torch.randn(5, dim, state_len, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    x = torch.randn(4, seq_len, dim, generator=gen)
    idx = torch.tensor([3, -1, 0, 1])
    results = []
    for fn in (torch_conv, conv_mod._update_triton):
        conv_mod._update_torch = fn  # route the CPU call through the kernel (the interpreter runs it on CPU)
        st, inter = states.clone(), torch.zeros(5, seq_len, dim, state_len)
        out = conv_mod.causal_conv1d_update(x, st, weight, bias if with_bias else None, "silu", idx, inter)
        results.append((out, st, inter))
    for got, want in zip(results[1], results[0]):
        assert rel(got, want) < 1e-5, (seq_len, state_len)
    assert torch.equal(results[1][0][1], torch.zeros_like(results[1][0][1]))

for seq_len, heads, groups, n, with_z in ((1, 4, 2, 16, True), (3, 2, 1, 40, False)):
    dim, slots = 12, 5
    state = torch.randn(slots, heads, dim, n, generator=gen)
    x = torch.randn(3, seq_len, heads, dim, generator=gen)
    dt = torch.randn(3, seq_len, heads, generator=gen)[..., None].expand(3, seq_len, heads, dim)
    A = (-torch.rand(heads, generator=gen) - 0.1)[:, None, None].expand(heads, dim, n)
    B, C = torch.randn(3, seq_len, groups, n, generator=gen), torch.randn(3, seq_len, groups, n, generator=gen)
    D, z = torch.randn(heads, dim, generator=gen), torch.randn(3, seq_len, heads, dim, generator=gen)
    dt_bias = torch.randn(heads, generator=gen)[:, None].expand(heads, dim)
    idx = torch.tensor([4, -1, 0])
    results = []
    for fn in (torch_ssm, ssm_mod._update_triton):
        ssm_mod._update_torch = fn
        st, inter = state.clone(), torch.zeros(slots, seq_len, heads, dim, n)
        y = ssm_mod.selective_state_update(st, x, dt, A, B, C, D=D, z=z if with_z else None, dt_bias=dt_bias,
                                           dt_softplus=True, state_batch_indices=idx, intermediate_ssm_states=inter)
        results.append((y, st, inter))
    for got, want in zip(results[1], results[0]):
        assert rel(got, want) < 1e-5, (seq_len, heads, groups, n)
"""

_SCAN = """
import torch
from megatron_core.ssm.ops import mamba_chunk_scan_combined_varlen
from megatron_core.ssm.ops.ssd_combined_triton import combined_scan_triton
from tests.ssm.ssm_ops_reference import pack, rel

gen = torch.Generator().manual_seed(1)
lengths = [5, 70, 1, 33]
total, heads, p, g, n = sum(lengths), 4, 16, 2, 16
x, dt = torch.randn(total, heads, p, generator=gen), torch.randn(total, heads, generator=gen) * 0.5
A, dt_bias = -torch.rand(heads, generator=gen) - 0.1, torch.randn(heads, generator=gen) * 0.3
B, C = torch.randn(total, g, n, generator=gen), torch.randn(total, g, n, generator=gen)
D, z = torch.randn(heads, generator=gen), torch.randn(total, heads, p, generator=gen)
init = torch.randn(len(lengths), heads, p, n, generator=gen)
_, cu_chunks, seq_idx, last = pack(lengths, 32, [0, 7, 3, 31])
for with_init, with_z in ((True, True), (False, False)):
    want_out = torch.empty_like(x)
    want = mamba_chunk_scan_combined_varlen(x, dt, A, B, C, 32, cu_chunks, last, seq_idx, want_out, D=D,
                                            z=z if with_z else None, dt_bias=dt_bias,
                                            initial_states=init if with_init else None, dt_softplus=True)
    out = torch.empty_like(x)
    final = combined_scan_triton(x, dt, A, B, C, cu_chunks, last, out, D, z if with_z else None, dt_bias,
                                 init if with_init else None, True, (0.0, float("inf")))
    assert rel(out, want_out) < 1e-5 and rel(final, want) < 1e-5, (rel(out, want_out), rel(final, want))
"""


@needs_triton
def test_decode_kernels_in_triton_interpreter():
    run_in_triton_interpreter(_DECODE)


@needs_triton
def test_varlen_scan_triton_path_in_triton_interpreter():
    run_in_triton_interpreter(_SCAN)


@needs_triton
@pytest.mark.parametrize("act", ["bf16", "fp32"])
def test_decode_kernels_compile_for_hopper(monkeypatch: pytest.MonkeyPatch, act: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from megatron_core.ssm.ops.causal_conv1d_triton import _kernel as conv_kernel
    from megatron_core.ssm.ops.mamba_ssm import _kernel as ssm_kernel
    from tests.ssm.test_mamba_kernels_compile import _compile

    for flags in ((True, True, True, True), (False, False, False, False)):
        asm = _compile(conv_kernel(), {"x_ptr": f"*{act}", "state_ptr": f"*{act}", "int_ptr": f"*{act}",
                                       "w_ptr": f"*{act}", "bias_ptr": f"*{act}", "out_ptr": f"*{act}",
                                       "idx_ptr": "*i64"},
                       {"SP": 8, "BLOCK": 64, "HAS_BIAS": flags[0], "HAS_IDX": flags[1], "HAS_INT": flags[2],
                        "SILU": flags[3]})
        assert asm["cubin"]
        pointers = {name: f"*{act}" for name in ("state_ptr", "x_ptr", "dt_ptr", "dt_bias_ptr", "A_ptr", "B_ptr",
                                                  "C_ptr", "D_ptr", "z_ptr", "out_ptr", "int_ptr")}
        asm = _compile(ssm_kernel(), {**pointers, "A_ptr": "*fp32", "idx_ptr": "*i64"},
                       {"BM": 4, "BN": 128, "HAS_BIAS": flags[0], "SOFTPLUS": flags[0], "HAS_D": flags[1],
                        "HAS_Z": flags[2], "HAS_IDX": flags[1], "HAS_INT": flags[3]})
        assert asm["cubin"]


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_scan_and_conv_on_cuda(dtype):
    from megatron_core.ssm.ops import causal_conv1d_varlen_fn, mamba_chunk_scan_combined_varlen

    gen = torch.Generator().manual_seed(2)
    lengths = [5, 130, 1, 64]
    total, heads, p, g, n, batch = sum(lengths), 8, 64, 2, 128, len(lengths)
    cu, cu_chunks, seq_idx, last = pack(lengths, 128, [0, 100, 5, 127])
    x, dt = torch.randn(total, heads, p, generator=gen), torch.randn(total, heads, generator=gen) * 0.5
    A, dt_bias = -torch.rand(heads, generator=gen) - 0.1, torch.randn(heads, generator=gen) * 0.3
    B, C = torch.randn(total, g, n, generator=gen) / n ** 0.5, torch.randn(total, g, n, generator=gen)
    D, z = torch.randn(heads, p, generator=gen), torch.randn(total, heads, p, generator=gen)
    init = torch.randn(batch, heads, p, n, generator=gen) * 0.1
    dev = [t.cuda() for t in (x, dt, A, B, C, D, z, init, cu_chunks, seq_idx, last)]
    xd, dtd, Ad, Bd, Cd, Dd, zd, initd, cucd, seqd, lastd = dev
    step = F.softplus(dt.double() + dt_bias.double())
    rx, rB, rC, rz = (t.to(dtype).double() for t in (x, B, C, z))
    for raw in (False, True):  # the Triton path, then the PyTorch passes on CUDA (raw chunk states)
        out = torch.empty(total, heads, p, device="cuda", dtype=dtype)
        res = mamba_chunk_scan_combined_varlen(xd.to(dtype), dtd, Ad, Bd.to(dtype), Cd.to(dtype), 128, cucd, lastd,
                                               seqd, out, D=Dd, z=zd.to(dtype), dt_bias=dt_bias.cuda(),
                                               initial_states=initd, dt_softplus=True, return_raw_states=raw,
                                               state_dtype=torch.float32)
        final = res[0] if raw else res
        for s in range(batch):
            seg = slice(int(cu[s]), int(cu[s + 1]))
            want_y, want_states = recurrence(rx[seg], step[seg], A, rB[seg], rC[seg], D, rz[seg], init[s])
            assert rel(out[seg], want_y) < _BOUND[dtype] and rel(final[s], want_states[-1]) < _BOUND[dtype]
    width, dim = 4, 256
    xc, w, b = torch.randn(total, dim, generator=gen), torch.randn(dim, width, generator=gen), torch.randn(dim)
    hist = torch.randn(batch, dim, width - 1, generator=gen)
    got = causal_conv1d_varlen_fn(xc.cuda().to(dtype), w.cuda().to(dtype), b.cuda().to(dtype), cu.cuda(),
                                  hist.cuda().to(dtype))
    want = torch.cat([conv_reference(xc.to(dtype)[cu[s]:cu[s + 1]], w.to(dtype), b.to(dtype), hist.to(dtype)[s])
                      for s in range(batch)])
    assert got.dtype == dtype and rel(got, want) < _BOUND[dtype]


@pytest.mark.gpu
@_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_ops_on_cuda(dtype):
    from megatron_core.ssm.ops.causal_conv1d_triton import causal_conv1d_update
    from megatron_core.ssm.ops.mamba_ssm import selective_state_update

    gen = torch.Generator().manual_seed(3)
    dim, width, slots, seq_len = 300, 4, 6, 2
    states = torch.randn(slots, dim, width, generator=gen).to(dtype)
    w, b = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    x = torch.randn(3, seq_len, dim, generator=gen).to(dtype)
    idx = torch.tensor([5, -1, 1])
    states_d = states.cuda()
    out = causal_conv1d_update(x.cuda(), states_d, w.cuda(), b.cuda(), "silu", idx.cuda())
    for row, slot in ((0, 5), (2, 1)):
        full = torch.cat([states[slot].double(), x[row].double().t()], 1)
        for s in range(seq_len):
            want = F.silu((full[:, s + 1:s + 1 + width] * w.double()).sum(1) + b.double())
            assert rel(out[row, s], want) < _BOUND[dtype]
        assert rel(states_d[slot], full[:, seq_len:]) < _BOUND[dtype]
    assert torch.equal(states_d[0].cpu(), states[0]) and float(out[1].abs().max()) == 0.0

    heads, hd, groups, n = 8, 64, 2, 128
    state = torch.randn(slots, heads, hd, n, generator=gen)
    xs = torch.randn(3, seq_len, heads, hd, generator=gen).to(dtype)
    dt = torch.randn(3, seq_len, heads, generator=gen)
    A = -torch.rand(heads, generator=gen) - 0.1
    B, C = (torch.randn(3, seq_len, groups, n, generator=gen).to(dtype) for _ in range(2))
    D, dt_bias = torch.randn(heads, hd, generator=gen), torch.randn(heads, generator=gen)
    state_d = state.cuda()
    y = selective_state_update(state_d, xs.cuda(), dt.cuda()[..., None].expand(3, seq_len, heads, hd),
                               A.cuda()[:, None, None].expand(heads, hd, n), B.cuda(), C.cuda(), D=D.cuda(),
                               dt_bias=dt_bias.cuda()[:, None].expand(heads, hd), dt_softplus=True,
                               state_batch_indices=idx.cuda())
    assert y.dtype == dtype
    for row, slot in ((0, 5), (2, 1)):
        step = F.softplus(dt[row].double() + dt_bias.double())
        want_y, want_states = recurrence(xs[row], step, A, B[row], C[row], D, None, state[slot])
        assert rel(y[row], want_y) < _BOUND[dtype] and rel(state_d[slot], want_states[-1]) < _BOUND[dtype]
    assert torch.equal(state_d[0].cpu(), state[0]) and float(y[1].abs().max()) == 0.0
