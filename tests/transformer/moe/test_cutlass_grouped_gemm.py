"""The optional CUTLASS grouped GEMM (``transformer.moe.cutlass_grouped_gemm``).

On CPU: the operator's gradient, fake (compile) implementation and dispatch from ``grouped_gemm`` with the kernel
launch replaced by a per-group reference; backend selection and the errors that name what is missing. On a
Hopper GPU (``gpu``): the kernel itself against float32 per-group products (forward, data and weight gradients,
empty and 16-row groups) and a grouped MLP layer against the PyTorch backend.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megatron_core.transformer.moe import cutlass_grouped_gemm as cg
from megatron_core.transformer.moe.cutlass_grouped_gemm import build, ops
from megatron_core.transformer.moe.grouped_linear import grouped_gemm
from megatron_core.transformer.moe.token_permutation import AlignedRows


def _reference(a: torch.Tensor, weight: torch.Tensor, counts: list[int], transpose_weight: bool) -> torch.Tensor:
    pieces, start = [], 0
    for e, c in enumerate(counts):
        w = weight[e].t() if transpose_weight else weight[e]
        pieces.append(a[start:start + c].float() @ w.float())
        start += c
    return torch.cat(pieces)


def _fake_launch(a, weight, offs, out, transpose_weight):
    ends = offs.tolist()
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    out.copy_(_reference(a, weight, counts, transpose_weight).to(out.dtype))


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The kernel launch replaced by the per-group reference (the operator's plumbing runs for real)."""
    monkeypatch.setattr(ops, "_launch", _fake_launch)
    monkeypatch.setattr(cg, "check_cutlass_grouped_gemm", lambda x, weight: None)


COUNTS = [16, 0, 48, 32]


def test_operator_gradients_equal_per_group_products(cpu_kernel):
    torch.manual_seed(0)
    x = torch.randn(sum(COUNTS), 24, requires_grad=True)
    weight = torch.randn(len(COUNTS), 40, 24, requires_grad=True)  # [E, out, in]
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    out = cg.cutlass_grouped_linear(x, weight, offs)
    grad = torch.randn_like(out)
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    want = _reference(x_ref, w_ref, COUNTS, True)
    want.backward(grad)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    assert weight.grad[1].abs().sum() == 0  # the empty group


def test_operator_compiles_through_its_fake_implementation(cpu_kernel):
    torch.manual_seed(1)
    x, weight = torch.randn(sum(COUNTS), 16), torch.randn(len(COUNTS), 8, 16)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    compiled = torch.compile(lambda a, w, o: ops.grouped_mm(a, w, o, True) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, weight, offs), 2 * _reference(x, weight, COUNTS, True))


def test_grouped_gemm_dispatches_to_the_kernel_when_asked(cpu_kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(cg, "_backend", "cutlass")
    monkeypatch.setattr("megatron_core.transformer.moe.grouped_linear._use_grouped_mm", lambda x, w: True)
    real = ops._launch

    def counted(*args):
        calls.append(args[4])
        return real(*args)

    monkeypatch.setattr(ops, "_launch", counted)
    torch.manual_seed(2)
    x = torch.randn(sum(COUNTS), 16, requires_grad=True)
    weight = torch.randn(len(COUNTS), 8, 16, requires_grad=True)
    ends = torch.tensor(COUNTS).cumsum(0)
    rows = AlignedRows(torch.tensor(COUNTS), ends.to(torch.int32), sum(COUNTS))
    out = grouped_gemm(x, weight, rows)
    out.sum().backward()
    assert calls == [True, False]  # forward ("tn"), then the data gradient ("nn")
    torch.testing.assert_close(out, _reference(x, weight, COUNTS, True), rtol=1e-5, atol=1e-5)


def test_backend_choice_and_errors(monkeypatch):
    monkeypatch.setattr(cg, "_backend", "torch")
    assert not cg.cutlass_grouped_gemm_requested()
    cg.set_moe_grouped_gemm_backend("cutlass")
    assert cg.cutlass_grouped_gemm_requested()
    with pytest.raises(ValueError, match="choose one of"):
        cg.set_moe_grouped_gemm_backend("cublas")
    monkeypatch.setattr(cg, "_backend", "triton")
    with pytest.raises(ValueError, match=r"MEGATRON_CORE_MOE_GROUPED_GEMM='triton'"):
        cg.cutlass_grouped_gemm_requested()
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        cg.check_cutlass_grouped_gemm(torch.zeros(2, 8), torch.zeros(1, 8, 8))


def test_mismatched_shapes_are_refused_before_the_kernel(cpu_kernel):
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    with pytest.raises(ValueError, match=r"x \(96, 24\) must be \[T, in\]"):
        cg.cutlass_grouped_linear(torch.zeros(96, 24), torch.zeros(4, 8, 16), offs)
    with pytest.raises(ValueError, match=r"one end offset per expert \(4\)"):
        cg.cutlass_grouped_linear(torch.zeros(96, 16), torch.zeros(4, 8, 16), offs[:3])


def test_build_errors_name_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv(build.PREBUILT_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(build.CutlassBuildError, match="does not exist"):
        build.library_path()
    monkeypatch.delenv(build.PREBUILT_ENV)
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path))
    with pytest.raises(build.CutlassBuildError, match="holds no include/cutlass/cutlass.h"):
        build.find_cutlass_includes()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(build.CutlassBuildError, match="nvcc was not found"):
        build.find_nvcc()


def _headers_available() -> bool:
    try:
        build.find_cutlass_includes()
    except build.CutlassBuildError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None or not _headers_available(), reason="needs nvcc and CUTLASS headers")
def test_library_builds_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(build.PREBUILT_ENV, raising=False)
    path = build.library_path()
    assert path.is_file() and path.parent.parent == tmp_path / "cutlass_grouped_gemm"
    stamp = path.stat().st_mtime_ns
    assert build.library_path() == path and path.stat().st_mtime_ns == stamp  # cached, not rebuilt


# --- on a Hopper GPU ---------------------------------------------------------------------------------------------
def _hopper_with_kernel() -> bool:
    """An H100/H200 and a way to the kernel: a prebuilt library, or nvcc and the CUTLASS headers (optional extra)."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return False
    return bool(os.environ.get(build.PREBUILT_ENV)) or (shutil.which("nvcc") is not None and _headers_available())


HOPPER_KERNEL_REASON = "needs an H100/H200 and the kernel (nvcc and the 'cutlass' extra, or a prebuilt library)"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_kernel(), reason=HOPPER_KERNEL_REASON)
@pytest.mark.parametrize("counts", [[1024] * 4, [976, 1088, 0, 2032], [16, 0, 48, 4032]])
def test_kernel_matches_float32_products_on_hopper(counts):
    torch.manual_seed(3)
    device, total = torch.device("cuda"), sum(counts)
    x = torch.randn(total, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(len(counts), 768, 512, device=device) / 20).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    out = cg.cutlass_grouped_linear(x, weight, offs)
    grad = torch.randn_like(out)
    out.backward(grad)
    want = _reference(x.detach(), weight.detach(), counts, True)
    scale = want.abs().max()
    assert (out.float() - want).abs().max() / scale < 1e-2
    want_dx = _reference(grad, weight.detach(), counts, False)
    assert (x.grad.float() - want_dx).abs().max() / want_dx.abs().max() < 1e-2
    want_dw = torch.stack([grad[s:e].float().t() @ x.detach()[s:e].float()
                           for s, e in zip([0, *offs.tolist()[:-1]], offs.tolist())])
    assert (weight.grad.float() - want_dw).abs().max() / want_dw.abs().max().clamp(min=1e-6) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_kernel(), reason=HOPPER_KERNEL_REASON)
def test_grouped_gemm_backends_agree_on_hopper(monkeypatch):
    torch.manual_seed(4)
    counts = [912, 1104, 1024, 1056]
    x = torch.randn(sum(counts), 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(4, 2048, 1024, device="cuda") / 30).to(torch.bfloat16).requires_grad_()
    results = {}
    for backend in ("torch", "cutlass"):
        monkeypatch.setattr(cg, "_backend", backend)
        x.grad = weight.grad = None
        out = grouped_gemm(x, weight, counts)
        out.float().square().mean().backward()
        results[backend] = (out.float(), x.grad.float(), weight.grad.float())
    for got, want in zip(results["cutlass"], results["torch"]):
        assert (got - want).abs().max() / want.abs().max() < 1e-2
