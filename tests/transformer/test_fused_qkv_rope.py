"""The fused QKV split + RoPE kernel (``fused_qkv_rope``) against the unfused split and rotation.

The kernel itself runs on CUDA (GPU tests) and, where Triton is installed, in Triton's interpreter on the CPU.
Attention with ``apply_rope_fusion`` / ``fused_single_qkv_rope`` must give the unfused results everywhere: on
the CPU through the plain path, on CUDA through the kernel.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from megatron_core.transformer import fused_qkv_rope
from megatron_core.transformer.fused_qkv_rope import fused_qkv_rope_supported, split_qkv_with_rope
from megatron_core.transformer.rope_utils import apply_rotary_pos_emb, rotary_cos_sin

# (seq, batch, groups, heads per group, head dim, rotary dim, interleaved): GQA, MHA (one head per group), MQA
# (one group); a partial rotation with a head size that is not a power of two; the interleaved rotation.
SHAPES = [(6, 2, 2, 3, 16, 16, False), (5, 1, 3, 1, 32, 32, False), (4, 3, 1, 8, 64, 64, False),
          (5, 2, 2, 2, 24, 8, False), (4, 2, 2, 3, 16, 16, True)]


def _angles(seq: int, rot_dim: int, interleaved: bool) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.repeat_interleave(angles, 2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return emb[:, None, None, :]


def _unfused(mixed: torch.Tensor, angles: torch.Tensor, groups: int, per_group: int, head_dim: int,
             interleaved: bool, cu_seqlens: torch.Tensor | None = None):
    s, b = mixed.shape[:2]
    q, k, v = torch.split(mixed.view(s, b, groups, (per_group + 2) * head_dim),
                          [per_group * head_dim, head_dim, head_dim], dim=3)
    rotate = {"rotary_interleaved": interleaved, "cu_seqlens": cu_seqlens}
    q = apply_rotary_pos_emb(q.reshape(s, b, groups * per_group, head_dim), angles, **rotate)
    return q, apply_rotary_pos_emb(k, angles, **rotate), v


def _compare(device: str, dtype: torch.dtype, shape: tuple, compiled: bool = False, packed: bool = False) -> None:
    s, b, groups, per_group, head_dim, rot_dim, interleaved = shape
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randn(s, b, groups * (per_group + 2) * head_dim, generator=gen).to(device, dtype)
    angles = _angles(s + 3, rot_dim, interleaved).to(device)  # longer than the sequence, as RotaryEmbedding's
    # a packed sequence of two documents: the rotation restarts at the second one
    cu_seqlens = torch.tensor([0, 2, s], dtype=torch.int32, device=device) if packed else None
    grads = [torch.randn(s, b, n, head_dim, generator=gen).to(device, dtype)
             for n in (groups * per_group, groups, groups)]
    grads[0] = grads[0].transpose(0, 1).contiguous().transpose(0, 1)  # a gradient that is not contiguous

    def fused(x: torch.Tensor):
        cos, sin = rotary_cos_sin(angles, s, dtype, cu_seqlens=cu_seqlens)
        return split_qkv_with_rope(x, cos, sin, groups, per_group, interleaved)

    run = torch.compile(fused, fullgraph=True) if compiled else fused
    x, ref_x = mixed.clone().requires_grad_(True), mixed.clone().requires_grad_(True)
    outs, refs = run(x), _unfused(ref_x, angles, groups, per_group, head_dim, interleaved, cu_seqlens)
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    for name, out, ref in zip(("query", "key", "value"), outs, refs):
        assert out.shape == ref.shape and out.is_contiguous(), name
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol, msg=name)
    torch.testing.assert_close(x.grad, ref_x.grad, atol=tol, rtol=tol)


def test_not_supported_on_cpu_tensors():
    mixed, cos = torch.zeros(2, 1, 4 * 8), torch.zeros(2, 1, 1, 8)
    assert not fused_qkv_rope_supported(mixed, cos)


def test_shape_errors_name_the_sizes():
    cos = torch.zeros(4, 1, 1, 8)
    with pytest.raises(ValueError, match=r"shape \(4, 1, 32\).*groups 1 x \(heads_per_group 3 \+ 2\)"):
        split_qkv_with_rope(torch.zeros(4, 1, 32), cos, cos, 1, 3)
    with pytest.raises(ValueError, match="head_dim >= the rotary dim 8"):
        split_qkv_with_rope(torch.zeros(4, 1, 20), cos, cos, 1, 3)
    with pytest.raises(ValueError, match="cover the sequence of 4 positions"):
        split_qkv_with_rope(torch.zeros(4, 1, 40), cos[:2], cos[:2], 1, 3)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_kernels_in_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused_qkv_rope._kernels.cache_clear()  # build the kernels for the interpreter
    try:
        for shape in SHAPES:
            _compare("cpu", torch.float32, shape)
        _compare("cpu", torch.float32, SHAPES[0], packed=True)
    finally:
        fused_qkv_rope._kernels.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa", "mha", "mqa", "partial", "interleaved"])
def test_kernel_matches_unfused_cuda(dtype, shape):
    _compare("cuda", dtype, shape)


@pytest.mark.gpu
def test_kernel_packed_sequence_cuda():
    _compare("cuda", torch.float32, SHAPES[0], packed=True)


@pytest.mark.gpu
def test_kernel_under_torch_compile_cuda():
    _compare("cuda", torch.bfloat16, SHAPES[0], compiled=True)


def _attention_outputs(device: str, dtype: torch.dtype, fusion: bool, rotary_percent: float, packed: bool):
    from megatron_core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron_core.packed_seq_params import PackedSeqParams
    from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron_core.transformer.spec_utils import build_module
    from megatron_core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, apply_rope_fusion=fusion, params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    spec = get_gpt_layer_local_spec().submodules.self_attention
    attention = build_module(spec, config=config, layer_number=1).to(device)
    angles = RotaryEmbedding(kv_channels=8, rotary_percent=rotary_percent)(12).to(device)
    batch = 1 if packed else 2
    hidden = torch.randn(12, batch, 64, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    hidden.requires_grad_(True)
    params = None
    if packed:  # three documents in one row; RoPE positions restart at each
        cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32, device=device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    out, _ = attention(hidden, None, rotary_pos_emb=angles, packed_seq_params=params)
    out.float().square().sum().backward()
    return out, hidden.grad, {n: p.grad for n, p in attention.named_parameters()}


def _check_attention(device: str, dtype: torch.dtype, tol: float) -> None:
    for rotary_percent, packed in ((1.0, False), (0.5, False), (1.0, True)):
        fused = _attention_outputs(device, dtype, True, rotary_percent, packed)
        plain = _attention_outputs(device, dtype, False, rotary_percent, packed)
        torch.testing.assert_close(fused[0], plain[0], atol=tol, rtol=tol)
        torch.testing.assert_close(fused[1], plain[1], atol=tol, rtol=tol)
        assert fused[2].keys() == plain[2].keys()
        for name in fused[2]:
            torch.testing.assert_close(fused[2][name], plain[2][name], atol=tol, rtol=tol, msg=name)


def test_attention_with_rope_fusion_equals_unfused_cpu():
    _check_attention("cpu", torch.float32, 1e-6)


@pytest.mark.gpu
def test_attention_with_rope_fusion_equals_unfused_cuda():
    _check_attention("cuda", torch.float32, 1e-5)


def test_importing_without_triton_is_quiet_and_the_kernel_says_what_it_needs():
    # A fresh process where Triton cannot be imported, as on CI: no warning at import (a saver's first output
    # line is read by the crash-safety tests, and users should not see one), and a clear error on a direct call.
    script = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "import megatron_core.transformer.attention\n"
        "from megatron_core.transformer.fused_qkv_rope import split_qkv_with_rope\n"
        "from megatron_core.fusions.weighted_swiglu_triton import weighted_swiglu_backward\n"
        "for call in (lambda: split_qkv_with_rope(torch.zeros(2, 1, 40), torch.zeros(2, 1, 1, 8),"
        " torch.zeros(2, 1, 1, 8), 1, 3),\n"
        "             lambda: weighted_swiglu_backward(torch.zeros(2, 4), torch.zeros(2, 8), torch.zeros(2, 1))):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as error:\n"
        "        assert 'needs Triton' in str(error), error\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    assert done.stderr == "", done.stderr
