"""The fused MLA RoPE (``fusions.fused_mla_yarn_rope_apply``) against the unfused rotation MLA runs without it.

The reference is ``transformer.mla_rope.rotate_mla`` (de-interleave, then the half-split rotation of
``rope_utils``), the code ``MLASelfAttention`` runs without ``apply_rope_fusion``, on the same values: query and key/
value outputs and the gradients of ``q``, ``kv`` and ``k_pos_emb``, in the sbhd and packed (thd) layouts, under
context parallelism (both ranks' positions), with head counts and widths that are not powers of two. The PyTorch
path runs on CPU; the Triton kernels in Triton's interpreter (a subprocess) and on CUDA (GPU tests). An MLA layer and
a CP=2 model with ``apply_rope_fusion`` equal the unfused ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_core.fusions import fused_mla_yarn_rope_apply as fused_rope
from megatron_core.fusions.fused_mla_yarn_rope_apply import (
    fused_apply_mla_rope_for_kv,
    fused_apply_mla_rope_for_q,
)
from megatron_core.transformer.mla_rope import rotate_mla
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

# (seq, batch, heads, qk_head_dim, v_dim, emb_dim): DeepSeek-like proportions, then odd head counts and widths
SHAPES = [(6, 2, 4, 16, 16, 8), (5, 3, 3, 6, 10, 12), (7, 1, 5, 0, 3, 6)]
# packed documents: (cu_seqlens, cp_size); lengths divisible by 2 * cp_size under CP, one empty document
PACKED = [([0, 3, 7, 12], 1), ([0, 4, 4, 12], 2)]


class _CPGroup:
    """A stand-in context-parallel group: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _tables(rows: int, emb_dim: int, mscale: float = 1.3, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    gen = torch.Generator().manual_seed(5)
    angles = torch.rand(rows, 1, 1, emb_dim // 2, generator=gen) * 6
    angles = torch.cat((angles, angles), dim=-1).to(device)  # the half-split layout RotaryEmbedding gives
    return angles, (angles.cos() * mscale).to(dtype), (angles.sin() * mscale).to(dtype), mscale


def _unfused_q(q, angles, mscale, qk_dim, cu=None, cp=None):
    rows = q if cu is None else q.unsqueeze(1)
    pe = rotate_mla(rows[..., qk_dim:], angles, mscale, SimpleNamespace(rotary_interleaved=False), cu, cp)
    out = torch.cat((rows[..., :qk_dim], pe), dim=-1)
    return out if cu is None else out.squeeze(1)


def _unfused_kv(kv, emb, angles, mscale, k_dim, cu=None, cp=None):
    rows, emb = (kv, emb) if cu is None else (kv.unsqueeze(1), emb.unsqueeze(1))
    pe = rotate_mla(emb, angles, mscale, SimpleNamespace(rotary_interleaved=False), cu, cp)
    key = torch.cat((rows[..., :k_dim], pe.expand(*rows.shape[:-1], pe.shape[-1])), dim=-1)
    value = rows[..., k_dim:]
    return (key, value) if cu is None else (key.squeeze(1), value.squeeze(1))


def _inputs(shape, packed: tuple | None, device: str, dtype: torch.dtype):
    s, b, heads, qk_dim, v_dim, emb_dim = shape
    gen = torch.Generator().manual_seed(sum(shape))
    lead = (s, b) if packed is None else (packed[0][-1] // packed[1],)
    q = torch.randn(*lead, heads, qk_dim + emb_dim, generator=gen).to(device, dtype)
    kv = torch.randn(*lead, heads, qk_dim + v_dim, generator=gen).to(device, dtype)
    emb = torch.randn(*lead, 1, emb_dim, generator=gen).to(device, dtype)
    grads = [torch.randn(*lead, heads, n, generator=gen).to(device, dtype)
             for n in (qk_dim + emb_dim, qk_dim + emb_dim, v_dim)]
    return q, kv, emb, grads


def _compare(device: str, dtype: torch.dtype, shape: tuple, packed: tuple | None = None, cp_rank: int = 0) -> None:
    """Fused q and kv against the unfused rotation: outputs and every input gradient."""
    s, b, heads, qk_dim, v_dim, emb_dim = shape
    cu, cp_size = (None, 1) if packed is None else (torch.tensor(packed[0], dtype=torch.int32, device=device),
                                                    packed[1])
    cp = _CPGroup(cp_size, cp_rank)
    table_rows = s + 3 if packed is None else max(b - a for a, b in zip(packed[0], packed[0][1:])) + 2
    angles, cos, sin, mscale = _tables(table_rows, emb_dim, dtype=dtype, device=device)
    q, kv, emb, (g_q, g_k, g_v) = _inputs(shape, packed, device, dtype)

    ref_q, ref_kv, ref_emb = (t.clone().float().requires_grad_(True) for t in (q, kv, emb))
    want_q = _unfused_q(ref_q, angles, mscale, qk_dim, cu, cp)
    want_k, want_v = _unfused_kv(ref_kv, ref_emb, angles, mscale, qk_dim, cu, cp)
    torch.autograd.backward((want_q, want_k, want_v), (g_q.float(), g_k.float(), g_v.float()))

    x_q, x_kv, x_emb = (t.clone().requires_grad_(True) for t in (q, kv, emb))
    work = x_q.clone()  # rotated in place: the returned tensor is this one
    got_q = fused_apply_mla_rope_for_q(work, cos, sin, qk_dim, emb_dim, cu, cp_rank, cp_size)
    assert got_q.data_ptr() == work.data_ptr()
    got_k, got_v = fused_apply_mla_rope_for_kv(x_kv, x_emb, cos, sin, emb_dim, qk_dim, v_dim, cu, cp_rank, cp_size)
    assert got_k.is_contiguous() and got_v.is_contiguous()
    g_q_before = g_q.clone()
    torch.autograd.backward((got_q, got_k, got_v), (g_q, g_k, g_v))
    assert torch.equal(g_q, g_q_before)  # the incoming gradient is left alone

    pairs = (("query", got_q, want_q), ("key", got_k, want_k), ("value", got_v, want_v),
             ("grad q", x_q.grad, ref_q.grad), ("grad kv", x_kv.grad, ref_kv.grad),
             ("grad k_pos_emb", x_emb.grad, ref_emb.grad))
    for name, got, want in pairs:
        assert got.shape == want.shape and got.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            # bf16 inputs and cos/sin tables against the fp32 reference: k_pos_emb's gradient sums every head's
            # rounded products, so the error is measured against the tensor's size, not element by element.
            error = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
            assert error < 1.5e-2, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("shape", SHAPES, ids=["deepseek_like", "odd_widths", "no_nope_channels"])
def test_torch_path_matches_unfused_sbhd(shape):
    _compare("cpu", torch.float32, shape)


@pytest.mark.parametrize("packed,cp_rank", [(PACKED[0], 0), (PACKED[1], 0), (PACKED[1], 1)],
                         ids=["thd", "thd_cp2_rank0", "thd_cp2_rank1"])
def test_torch_path_matches_unfused_packed(packed, cp_rank):
    _compare("cpu", torch.float32, (0, 1, 3, 6, 10, 12), packed, cp_rank)


def test_bf16_torch_path_matches_unfused():
    _compare("cpu", torch.bfloat16, SHAPES[0])


def test_rows_past_the_last_document_keep_their_values():
    cos, sin = torch.ones(8, 1, 1, 4), torch.zeros(8, 1, 1, 4)
    q = torch.arange(6 * 2 * 6, dtype=torch.float32).view(6, 2, 6)
    out = fused_apply_mla_rope_for_q(q.clone(), cos * 2, sin, 2, 4, torch.tensor([0, 4]))
    torch.testing.assert_close(out[:4, :, 2:], 2 * torch.cat((q[:4, :, 2::2], q[:4, :, 3::2]), -1))
    torch.testing.assert_close(out[4:, :, 2:], torch.cat((q[4:, :, 2::2], q[4:, :, 3::2]), -1))


def test_errors_name_the_values():
    cos = torch.zeros(4, 1, 1, 8)
    with pytest.raises(ValueError, match=r"q must be \[seq_len, batch_size, head_num, 12\].*\(4, 1, 2, 10\)"):
        fused_apply_mla_rope_for_q(torch.zeros(4, 1, 2, 10), cos, cos, 4, 8)
    with pytest.raises(ValueError, match="rotary_interleaved=True"):
        fused_apply_mla_rope_for_q(torch.zeros(4, 1, 2, 12), cos, cos, 4, 8, rotary_interleaved=True)
    with pytest.raises(ValueError, match=r"emb_dim \(7\)"):
        fused_apply_mla_rope_for_q(torch.zeros(4, 1, 2, 11), cos, cos, 4, 7)
    with pytest.raises(ValueError, match="hold 4 positions, fewer than the sequence's 5"):
        fused_apply_mla_rope_for_q(torch.zeros(5, 1, 2, 12), cos, cos, 4, 8)
    with pytest.raises(ValueError, match=r"k_pos_emb must be .*\(4, 1, 1, 6\)"):
        fused_apply_mla_rope_for_kv(torch.zeros(4, 1, 2, 10), torch.zeros(4, 1, 1, 6), cos, cos, 8, 4, 6)
    with pytest.raises(ValueError, match=r"cp_rank \(2\)"):
        fused_apply_mla_rope_for_kv(torch.zeros(4, 1, 2, 10), torch.zeros(4, 1, 1, 8), cos, cos, 8, 4, 6, None, 2, 2)


def test_kernel_names_are_module_attributes_where_triton_is_installed():
    for name in fused_rope._KERNEL_NAMES:
        if fused_rope.triton_modules() is None:
            with pytest.raises(AttributeError, match="Triton is not installed"):
                getattr(fused_rope, name)
        else:
            assert callable(getattr(fused_rope, name).run), name


_INTERPRETER_SCRIPT = """
import torch
from megatron_core.fusions import fused_mla_yarn_rope_apply
from tests.fusions import test_fused_mla_yarn_rope_apply as t

fused_mla_yarn_rope_apply._kernels_serve = lambda tensor: True  # CPU tensors through the kernels
for shape in t.SHAPES:
    t._compare("cpu", torch.float32, shape)
for packed, rank in ((t.PACKED[0], 0), (t.PACKED[1], 0), (t.PACKED[1], 1)):
    t._compare("cpu", torch.float32, (0, 1, 3, 6, 10, 12), packed, rank)
t._compare("cpu", torch.float32, (0, 1, 20, 4, 4, 8), t.PACKED[0])  # two blocks of heads, the last one partial
t.test_rows_past_the_last_document_keep_their_values()
"""


@needs_triton
def test_kernels_in_the_triton_interpreter():
    run_in_triton_interpreter(_INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [(64, 2, 128, 128, 128, 64)],
                         ids=["deepseek_like", "odd_widths", "no_nope_channels", "deepseek_v3"])
def test_kernels_match_unfused_cuda(dtype, shape):
    assert fused_rope._kernels_serve(torch.zeros(1, device="cuda"))
    _compare("cuda", dtype, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed,cp_rank", [(PACKED[0], 0), (PACKED[1], 1)], ids=["thd", "thd_cp2_rank1"])
def test_kernels_match_unfused_packed_cuda(dtype, packed, cp_rank):
    _compare("cuda", dtype, (0, 1, 20, 16, 16, 8), packed, cp_rank)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_match_torch_path_cuda(dtype, monkeypatch):
    """The kernels against the PyTorch path on identical CUDA inputs (fp32 arithmetic in both)."""
    shape = (32, 2, 24, 32, 48, 16)
    q, kv, emb, (g_q, g_k, g_v) = _inputs(shape, None, "cuda", dtype)
    _, cos, sin, _ = _tables(40, 16, dtype=dtype, device="cuda")
    results = []
    for kernels in (True, False):
        monkeypatch.setattr(fused_rope, "_kernels_serve", lambda t, k=kernels: k)
        x_q, x_kv, x_emb = (t.clone().requires_grad_(True) for t in (q, kv, emb))
        out_q = fused_apply_mla_rope_for_q(x_q.clone(), cos, sin, 32, 16)
        key, value = fused_apply_mla_rope_for_kv(x_kv, x_emb, cos, sin, 16, 32, 48)
        torch.autograd.backward((out_q, key, value), (g_q, g_k, g_v))
        results.append((out_q, key, value, x_q.grad, x_kv.grad, x_emb.grad))
    # fp32: the same arithmetic up to the compiler's fused multiply-adds
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol)


# --- MLA with apply_rope_fusion --------------------------------------------------------------------------------------
def _mla_outputs(fusion: bool, packed: bool, recompute: bool = False, device: str = "cpu"):
    from megatron_core.packed_seq_params import PackedSeqParams
    from tests.transformer.test_multi_latent_attention import _config, _model

    extra = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]) if recompute else {}
    model = _model(_config(apply_rope_fusion=fusion, **extra)).to(device)
    gen = torch.Generator().manual_seed(2)
    batch = 1 if packed else 2
    ids = torch.randint(0, 64, (batch, 12), generator=gen).to(device)
    labels = torch.randint(0, 64, (batch, 12), generator=gen).to(device)
    pos = torch.arange(12, device=device).expand(batch, 12)
    params = None
    if packed:
        cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    loss = model(ids, pos, None, labels=labels, packed_seq_params=params)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed,recompute", [(False, False), (True, False), (False, True)],
                         ids=["sbhd", "packed", "recompute_up_proj"])
def test_mla_with_rope_fusion_equals_unfused(packed, recompute, monkeypatch):
    from megatron_core.transformer import multi_latent_attention

    calls = []
    for name in ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"):
        fn = getattr(multi_latent_attention, name)
        monkeypatch.setattr(multi_latent_attention, name, lambda *a, fn=fn, **k: calls.append(fn) or fn(*a, **k))
    loss, grads = _mla_outputs(True, packed, recompute)
    assert len(calls) >= 4  # query and key/value of both layers went through the fused functions
    calls.clear()
    ref_loss, ref_grads = _mla_outputs(False, packed, recompute)
    assert not calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_mla_with_rope_fusion_under_context_parallelism_matches_single_process():
    from tests.dist_harness import run_on_ranks
    from tests.transformer.test_multi_latent_attention import _check_parallel

    assert len(run_on_ranks(2, _check_parallel, 1, 2, dict(cp_comm_type="p2p", apply_rope_fusion=True))) == 2


@pytest.mark.gpu
def test_mla_with_rope_fusion_equals_unfused_cuda():
    for packed in (False, True):
        loss, grads = _mla_outputs(True, packed, device="cuda")
        ref_loss, ref_grads = _mla_outputs(False, packed, device="cuda")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_the_three_fusions_work_without_triton_and_import_quietly():
    """In a process where Triton cannot be imported: no output at import, the PyTorch paths run."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "import megatron_core.transformer.multi_latent_attention\n"
        "from megatron_core.fusions import fused_mla_yarn_rope_apply as rope\n"
        "from megatron_core.fusions.fused_indices_converter import fused_indices_to_multihot\n"
        "from megatron_core.fusions.fused_pad_routing_map import fused_pad_routing_map\n"
        "q = rope.fused_apply_mla_rope_for_q(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4), torch.zeros(2, 1, 1, 4),"
        " 0, 4)\n"
        "assert q.sum() == 8\n"
        "assert fused_indices_to_multihot(torch.tensor([[1]]), torch.ones(1, 1), 2)[0].tolist() == [[False, True]]\n"
        "assert fused_pad_routing_map(torch.zeros(3, 1, dtype=torch.bool), 2).sum() == 0\n"
        "try:\n"
        "    rope.rotary_fwd_q_kernel\n"
        "except AttributeError as error:\n"
        "    assert 'Triton is not installed' in str(error)\n"
        "else:\n"
        "    raise AssertionError('a kernel without Triton')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    assert done.stderr == "", done.stderr
