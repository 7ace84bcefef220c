"""``megatron_core.ssm.ops`` (Megatron-Core 0.19's Mamba op entry points) on CPU against independent references.

The references (tests/ssm/ssm_ops_reference.py) are the Mamba-2 recurrence token by token in float64 and
``F.conv1d`` in float64. Packed (varlen) ops must equal running each sequence alone from its own initial state;
the decode ops' in-place state updates must equal steps of the recurrence, on the named slots only. fp32 within
1e-5 (relative norm). Triton-interpreter, compile and GPU variants: tests/ssm/test_ssm_ops_triton.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_core.ssm.ops import causal_conv1d_varlen_fn, determinism, mamba_chunk_scan_combined_varlen
from megatron_core.ssm.ops.causal_conv1d_triton import causal_conv1d_update
from megatron_core.ssm.ops.intermediate_extraction import scatter_intermediate_conv, scatter_intermediate_ssm
from megatron_core.ssm.ops.mamba_ssm import selective_state_update
from megatron_core.ssm.ops.ssd_chunk_state import _chunk_cumsum_fwd, chunk_state_varlen
from megatron_core.ssm.ops.ssd_combined import is_int_pow_2
from tests.ssm.ssm_ops_reference import conv_reference, pack, recurrence, rel

TOL = 1e-5
LENGTHS, OFFSETS = [5, 19, 1, 12], [0, 3, 7, 2]


def _scan_inputs(seed, heads=4, head_dim=6, groups=2, n=5, per_channel_D=True):
    gen = torch.Generator().manual_seed(seed)
    total, batch = sum(LENGTHS), len(LENGTHS)
    return dict(
        x=torch.randn(total, heads, head_dim, generator=gen), dt=torch.randn(total, heads, generator=gen) * 0.5,
        A=-torch.rand(heads, generator=gen) - 0.1, B=torch.randn(total, groups, n, generator=gen),
        C=torch.randn(total, groups, n, generator=gen),
        D=torch.randn(heads, head_dim, generator=gen) if per_channel_D else torch.randn(heads, generator=gen),
        z=torch.randn(total, heads, head_dim, generator=gen), dt_bias=torch.randn(heads, generator=gen) * 0.3,
        init=torch.randn(batch, heads, head_dim, n, generator=gen))


def _expected(inp, cu, use_init, use_z, use_D, dt_limit=(0.0, float("inf"))):
    step = F.softplus(inp["dt"].double() + inp["dt_bias"].double()).clamp(*dt_limit)
    ys, states = [], []
    for s in range(len(LENGTHS)):
        seg = slice(int(cu[s]), int(cu[s + 1]))
        y, st = recurrence(inp["x"][seg], step[seg], inp["A"], inp["B"][seg], inp["C"][seg],
                           inp["D"] if use_D else None, inp["z"][seg] if use_z else None,
                           inp["init"][s] if use_init else None)
        ys.append(y)
        states.append(st)
    return torch.cat(ys), states


@pytest.mark.parametrize("use_init,use_z,use_D,per_channel_D", [
    (True, True, True, True), (False, False, False, True), (True, False, True, False), (False, True, True, False)])
def test_combined_varlen_equals_each_sequence_alone(use_init, use_z, use_D, per_channel_D):
    inp = _scan_inputs(0, per_channel_D=per_channel_D)
    cu, cu_chunks, seq_idx, last = pack(LENGTHS, 8, OFFSETS)
    out = torch.full_like(inp["x"], float("nan"))
    final, raw = mamba_chunk_scan_combined_varlen(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, cu_chunks, last, seq_idx, out,
        D=inp["D"] if use_D else None, z=inp["z"] if use_z else None, dt_bias=inp["dt_bias"],
        initial_states=inp["init"] if use_init else None, dt_softplus=True, return_raw_states=True)
    want_y, want_states = _expected(inp, cu, use_init, use_z, use_D)
    assert rel(out, want_y) < TOL
    assert final.shape == inp["init"].shape and final.dtype == torch.float32
    assert rel(final, torch.stack([st[-1] for st in want_states])) < TOL
    # Raw states: the state after every chunk, that is after the chunk's last token in its sequence.
    want_raw = torch.stack([want_states[int(seq_idx[c])][int(cu_chunks[c + 1]) - int(cu[int(seq_idx[c])]) - 1]
                            for c in range(len(seq_idx))])
    assert raw.shape == (len(seq_idx), *inp["init"].shape[1:]) and rel(raw, want_raw) < TOL


def test_combined_varlen_chunking_dt_limit_and_state_dtype():
    inp = _scan_inputs(1)
    cu = pack(LENGTHS, 8)[0]
    want_y, want_states = _expected(inp, cu, True, True, True, dt_limit=(0.2, 0.9))
    for chunk_size, offsets in ((4, [0, 0, 0, 0]), (16, OFFSETS), (32, [31, 0, 5, 30])):
        _, cu_chunks, seq_idx, last = pack(LENGTHS, chunk_size, offsets)
        out = torch.empty_like(inp["x"])
        final = mamba_chunk_scan_combined_varlen(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, cu_chunks, last, seq_idx, out,
            D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], initial_states=inp["init"], dt_softplus=True,
            dt_limit=(0.2, 0.9), state_dtype=torch.float64)
        assert final.dtype == torch.float64
        assert rel(out, want_y) < TOL and rel(final, torch.stack([st[-1] for st in want_states])) < TOL


def test_combined_varlen_bf16_output_and_errors():
    inp = _scan_inputs(2)
    cu, cu_chunks, seq_idx, last = pack(LENGTHS, 8, OFFSETS)
    out = torch.empty(inp["x"].shape, dtype=torch.bfloat16)
    final = mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"].bfloat16(),
                                             inp["C"].bfloat16(), 8, cu_chunks, last, seq_idx, out,
                                             dt_bias=inp["dt_bias"], dt_softplus=True)
    assert final.dtype == torch.bfloat16  # C's dtype by default
    want_y, _ = _expected({**inp, "B": inp["B"].bfloat16().float(), "C": inp["C"].bfloat16().float()}, cu,
                          False, False, False)
    assert rel(out, want_y) < 1e-2
    with pytest.raises(ValueError, match="power of 2"):
        mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 12, cu_chunks, last,
                                         seq_idx, torch.empty_like(inp["x"]))
    with pytest.raises(ValueError, match="initial_states"):
        mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, cu_chunks, last,
                                         seq_idx, torch.empty_like(inp["x"]), initial_states=inp["init"][:2])
    assert is_int_pow_2(64) and not is_int_pow_2(48) and not is_int_pow_2(0) and not is_int_pow_2(4.0)


@pytest.mark.parametrize("with_init", [True, False])
def test_chunk_state_varlen_fixed_chunks_shared_between_sequences(with_init):
    inp = _scan_inputs(3)
    cu = pack(LENGTHS, 8)[0]
    total, chunk_size = sum(LENGTHS), 8
    cu_fixed = torch.tensor(list(range(0, total, chunk_size)) + [total], dtype=torch.int32)
    dA_cumsum, dt_chunks = _chunk_cumsum_fwd(inp["dt"], inp["A"], chunk_size, cu_fixed, dt_bias=inp["dt_bias"],
                                             dt_softplus=True)
    _, want_states = _expected(inp, cu, with_init, False, False)
    # The state entering each fixed chunk: that of the sequence running at the chunk's first token.
    entering = []
    for c in range(len(cu_fixed) - 1):
        t = int(cu_fixed[c])
        s = int(torch.searchsorted(cu[1:], torch.tensor(t), right=True))
        k = t - int(cu[s])
        entering.append(want_states[s][k - 1] if k > 0 else torch.zeros_like(want_states[s][0]))
    got = chunk_state_varlen(inp["B"], inp["x"], dt_chunks, dA_cumsum, cu, torch.stack(entering).float(),
                             initial_states=inp["init"] if with_init else None)
    assert got.dtype == torch.float32 and rel(got, torch.stack([st[-1] for st in want_states])) < TOL


def test_chunk_state_varlen_with_last_chunk_indices():
    inp = _scan_inputs(4)
    cu, cu_chunks, seq_idx, last = pack(LENGTHS, 8, OFFSETS)
    dA_cumsum, dt_chunks = _chunk_cumsum_fwd(inp["dt"], inp["A"], 8, cu_chunks, dt_bias=inp["dt_bias"],
                                             dt_softplus=True)
    _, want_states = _expected(inp, cu, True, False, False)
    entering = []
    for c in range(len(seq_idx)):
        s, k = int(seq_idx[c]), int(cu_chunks[c]) - int(cu[int(seq_idx[c])])
        entering.append(want_states[s][k - 1] if k > 0 else inp["init"][s].double())
    got = chunk_state_varlen(inp["B"], inp["x"], dt_chunks, dA_cumsum, cu, torch.stack(entering).float(),
                             initial_states=inp["init"], last_chunk_indices=last, cu_chunk_seqlens=cu_chunks)
    assert rel(got, torch.stack([st[-1] for st in want_states])) < TOL


@pytest.mark.parametrize("with_init,width", [(True, 4), (False, 4), (True, 2), (True, 1)])
def test_causal_conv1d_varlen_equals_conv1d_per_sequence(with_init, width):
    gen = torch.Generator().manual_seed(5)
    dim, total = 7, sum(LENGTHS)
    cu = pack(LENGTHS, 8)[0]
    x, weight, bias = torch.randn(total, dim, generator=gen), torch.randn(dim, width, generator=gen), \
        torch.randn(dim, generator=gen)
    init = torch.randn(len(LENGTHS), dim, width - 1, generator=gen) if with_init else None
    got = causal_conv1d_varlen_fn(x, weight, bias, cu, init)
    want = torch.cat([conv_reference(x[cu[s]:cu[s + 1]], weight, bias,
                                     init[s] if with_init else torch.zeros(dim, width - 1))
                      for s in range(len(LENGTHS))])
    assert got.dtype == x.dtype and rel(got, want) < TOL
    sequence = torch.repeat_interleave(torch.arange(len(LENGTHS), dtype=torch.int32), (cu[1:] - cu[:-1]).long())
    start = torch.repeat_interleave(cu[:-1], (cu[1:] - cu[:-1]).long())
    same = causal_conv1d_varlen_fn(x, weight, bias, cu, init, precomputed_seq_idx=sequence,
                                   precomputed_seq_start=start)
    assert torch.equal(same, got)
    with pytest.raises(ValueError, match="silu"):
        causal_conv1d_varlen_fn(x, weight, bias, cu, init, activation="relu")


def _conv_window_reference(old_state, tokens, weight, bias, silu):
    """Outputs and new states of one slot: ``tokens`` ``[s, d]`` appended to ``old_state`` ``[d, L]``."""
    full = torch.cat([old_state.double(), tokens.double().t()], dim=1)
    width, length = weight.shape[1], old_state.shape[1]
    outs, states = [], []
    for s in range(tokens.shape[0]):
        window = full[:, s + length + 1 - width:s + length + 1]
        acc = (window * weight.double()).sum(1) + bias.double()
        outs.append(F.silu(acc) if silu else acc)
        states.append(full[:, s + 1:s + 1 + length])
    return torch.stack(outs), torch.stack(states)


@pytest.mark.parametrize("seq_len,state_len,silu", [(1, 4, "silu"), (3, 4, True), (2, 5, None), (1, 3, "silu")])
def test_causal_conv1d_update_in_place_on_named_slots(seq_len, state_len, silu):
    gen = torch.Generator().manual_seed(6)
    dim, width, slots = 9, 4, 5
    states = torch.randn(slots, dim, state_len, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    x = torch.randn(3, seq_len, dim, generator=gen)
    indices = torch.tensor([3, -1, 0])
    inter = torch.zeros(slots, seq_len, dim, state_len)
    before = states.clone()
    out = causal_conv1d_update(x if seq_len > 1 else x[:, 0], states, weight, bias, silu, indices,
                               intermediate_conv_states=inter)
    out = out if seq_len > 1 else out[:, None]
    for row, slot in ((0, 3), (2, 0)):
        want_out, want_states = _conv_window_reference(before[slot], x[row], weight, bias, silu is not None)
        assert rel(out[row], want_out) < TOL and rel(states[slot], want_states[-1]) < TOL
        assert rel(inter[slot], want_states) < TOL
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
    for untouched in (1, 2, 4):
        assert torch.equal(states[untouched], before[untouched])


def _ssm_inputs(seed, batch, seq_len, heads, dim, groups, n, slots):
    gen = torch.Generator().manual_seed(seed)
    return dict(state=torch.randn(slots, heads, dim, n, generator=gen),
                x=torch.randn(batch, seq_len, heads, dim, generator=gen),
                dt=torch.randn(batch, seq_len, heads, generator=gen)[..., None].expand(batch, seq_len, heads, dim),
                A=(-torch.rand(heads, generator=gen) - 0.1)[:, None, None].expand(heads, dim, n),
                B=torch.randn(batch, seq_len, groups, n, generator=gen),
                C=torch.randn(batch, seq_len, groups, n, generator=gen),
                D=torch.randn(heads, dim, generator=gen), z=torch.randn(batch, seq_len, heads, dim, generator=gen),
                dt_bias=torch.randn(heads, generator=gen)[:, None].expand(heads, dim))


@pytest.mark.parametrize("seq_len", [1, 3])
def test_selective_state_update_equals_recurrence_steps(seq_len):
    inp = _ssm_inputs(7, 3, seq_len, 4, 6, 2, 5, slots=5)
    indices = torch.tensor([2, -1, 4])
    state, before = inp["state"], inp["state"].clone()
    inter = torch.zeros(5, seq_len, 4, 6, 5)
    args = {k: (v[:, 0] if seq_len == 1 and k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    y = selective_state_update(state, args["x"], args["dt"], inp["A"], args["B"], args["C"], D=inp["D"],
                               z=args["z"], dt_bias=inp["dt_bias"], dt_softplus=True, state_batch_indices=indices,
                               intermediate_ssm_states=inter)
    assert y.shape == args["x"].shape and y.dtype == torch.float32
    y = y if seq_len > 1 else y[:, None]
    for row, slot in ((0, 2), (2, 4)):
        step = F.softplus(inp["dt"][row, :, :, 0].double() + inp["dt_bias"][:, 0].double())
        want_y, want_states = recurrence(inp["x"][row], step, inp["A"][:, 0, 0], inp["B"][row], inp["C"][row],
                                         inp["D"], inp["z"][row], before[slot])
        assert rel(y[row], want_y) < TOL and rel(state[slot], want_states[-1]) < TOL
        assert rel(inter[slot], want_states) < TOL
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    for untouched in (0, 1, 3):
        assert torch.equal(state[untouched], before[untouched])


def test_selective_state_update_without_heads():
    gen = torch.Generator().manual_seed(8)
    batch, dim, n = 3, 6, 4
    state = torch.randn(batch, dim, n, generator=gen)
    x, dt = torch.randn(batch, dim, generator=gen), torch.rand(batch, dim, generator=gen)
    A = -torch.rand(dim, n, generator=gen)
    B, C, D = torch.randn(batch, n, generator=gen), torch.randn(batch, n, generator=gen), torch.randn(dim)
    before = state.clone()
    y = selective_state_update(state, x, dt, A, B, C, D=D)
    want_state = torch.exp(dt.double()[..., None] * A.double()) * before.double() + \
        (dt.double() * x.double())[..., None] * B.double()[:, None, :]
    want_y = (want_state * C.double()[:, None, :]).sum(-1) + D.double() * x.double()
    assert y.shape == x.shape and rel(y, want_y) < TOL and rel(state, want_state) < TOL
    with pytest.raises(ValueError, match="selective_state_update"):
        selective_state_update(state, x, dt, A[:, :2], B, C)


def test_scatter_intermediate_states_copy_live_slots_only():
    gen = torch.Generator().manual_seed(9)
    states = torch.randn(6, 2, 3, 4, generator=gen)
    out = torch.randn(5, 2, 3, 4, generator=gen)
    before = out.clone()
    scatter_intermediate_ssm(states, torch.tensor([4, 1, 99, 7]), torch.tensor([2], dtype=torch.int32), out)
    assert torch.equal(out[0], states[4]) and torch.equal(out[1], states[1]) and torch.equal(out[2:], before[2:])
    src = torch.randn(1, 10, 3, generator=gen)
    conv = torch.randn(4, 3, 4, generator=gen)
    before = conv.clone()
    scatter_intermediate_conv(src, torch.tensor([4, 10, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                              conv, 4)
    assert torch.equal(conv[0], src[0, 0:4].t()) and torch.equal(conv[1], src[0, 6:10].t())
    assert torch.equal(conv[2], src[0, [0, 0, 0, 1]].t())  # positions before the sequence clamped to its start
    assert torch.equal(conv[3], before[3])
    with pytest.raises(ValueError, match="int32"):
        scatter_intermediate_conv(src, torch.tensor([4]), torch.tensor([1], dtype=torch.int32), conv, 4)


def test_deterministic_mode_switches(monkeypatch):
    monkeypatch.delenv("MAMBA_DETERMINISTIC", raising=False)
    monkeypatch.setattr(determinism, "_override", None)
    monkeypatch.setattr(determinism, "_warned", True)
    assert determinism.use_deterministic_mode() == torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    assert determinism.use_deterministic_mode()
    configs = [types.SimpleNamespace(kwargs={"BLOCK_T": 8, "BLOCK_C": 256}, num_warps=4, num_stages=2),
               types.SimpleNamespace(kwargs={"BLOCK_T": 128, "BLOCK_C": 128}, num_warps=4, num_stages=1),
               types.SimpleNamespace(kwargs={"BLOCK_T": 16, "BLOCK_C": 64}, num_warps=8, num_stages=1)]
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    assert determinism.autotune_configs(configs) == [configs[2]]  # the cheapest: 16 * 64 * 1
    monkeypatch.setenv("TRITON_AUTOTUNE_BLOCK_T", "128")
    assert determinism.autotune_configs(configs) == [configs[1]]
    determinism.set_deterministic_mode(False)
    assert not determinism.use_deterministic_mode() and determinism.autotune_configs(configs) == configs
    workspace, stride = determinism.alloc_tile_workspace((2, 3), 4, torch.float32, "cpu", True)
    assert workspace.shape == (2, 3, 4) and stride == 1 and torch.equal(workspace, torch.zeros(2, 3, 4))
    workspace[..., 1] = 2.0
    assert torch.equal(determinism.finalize_tile_workspace(workspace, True), torch.full((2, 3), 2.0))
    plain, stride = determinism.alloc_tile_workspace((2, 3), 4, torch.float32, "cpu", False)
    assert plain.shape == (2, 3) and stride == 0 and determinism.finalize_tile_workspace(plain, False) is plain
    assert determinism.alloc_tile_workspace(None, 4, torch.float32, "cpu", True) == (None, 0)


def test_import_without_triton_and_kernel_only_names():
    script = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
              "import megatron_core.ssm.ops as ops, megatron_core.ssm.ops.mamba_ssm as m\n"
              "import megatron_core.ssm.ops.causal_conv1d_triton as c\n"
              "assert not hasattr(m, 'fast_exp') and not hasattr(c, 'causal_conv1d_update_kernel')\n"
              "import torch\n"
              "st = torch.zeros(1, 3, 4)\n"
              "c.causal_conv1d_update(torch.ones(1, 3), st, torch.ones(3, 4), None, 'silu', None)\n"
              "assert torch.equal(st[0, :, -1], torch.ones(3)) and callable(ops.mamba_chunk_scan_combined_varlen)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if importlib.util.find_spec("triton") is not None:
        import megatron_core.ssm.ops.causal_conv1d_triton as conv_module
        import megatron_core.ssm.ops.mamba_ssm as ssm_module

        assert type(ssm_module.fast_exp).__name__ == "JITFunction"
        assert type(conv_module.causal_conv1d_update_kernel).__name__ == "JITFunction"
