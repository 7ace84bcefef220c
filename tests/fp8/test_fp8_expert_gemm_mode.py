"""The FP8 experts' GEMMs one per expert (``per_expert``; ``per_expert_backward`` in the backward only) against the
grouped kernel (``grouped``), on CPU.

``per_expert`` runs real ``torch._scaled_mm`` calls (PyTorch has them on CPU, row-wise scales included); the grouped
kernel is replaced by its fp32 statement (``tests/fp8/test_fp8_scaled_grouped_mm.py``), which also serves the weight
gradient in ``grouped`` mode. The forward, the data gradient and the weight gradient of ``ScaledGroupedMm`` agree, with
an expert without rows among the groups, eagerly and compiled; a bad mode is refused naming where it came from.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8 import expert_gemm_mode
from megatron_core.fp8 import scaled_grouped_mm as sgm
from tests.fp8.test_fp8_scaled_grouped_mm import COUNTS, _operands, _reference_kernel


@pytest.fixture
def reference_kernel(monkeypatch):
    monkeypatch.setattr(sgm, "_KERNEL", _reference_kernel)
    monkeypatch.setattr(expert_gemm_mode, "_mode", None)


def _run(mode: str, compile_backend: str | None = None) -> tuple[torch.Tensor, ...]:
    expert_gemm_mode.set_fp8_expert_gemm(mode)
    x, w, dy = _operands(3)
    x, w = x.requires_grad_(), w.requires_grad_()
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return sgm.ScaledGroupedMm.apply(x, w, ends)

    if compile_backend is not None:
        torch._dynamo.reset()
        gemm = torch.compile(gemm, backend=compile_backend, fullgraph=True)
    out = gemm(x, w)
    out.backward(dy)
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("mode", ["per_expert", "per_expert_backward"])
@pytest.mark.parametrize("compile_backend", [None, "aot_eager", "inductor"], ids=["eager", "aot_eager", "inductor"])
def test_per_expert_gemms_equal_the_grouped_kernel(reference_kernel, compile_backend, mode):
    grouped = _run("grouped")
    per_expert = _run(mode, compile_backend)
    assert COUNTS.count(0) == 1  # an expert without rows: skipped, its rows none
    for want, got in zip(grouped, per_expert):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("outputs", "inputs", "long"), [(128, 64, "dgrad"), (64, 128, "forward")])
def test_a_long_contraction_runs_tensorwise_with_the_scales_applied_after(reference_kernel, monkeypatch, outputs,
                                                                          inputs, long):
    """Where a GEMM's contraction is at least twice its output's columns (fc1's data gradient: 128 outputs against 64
    inputs; fc2's forward: 128 inputs against 64 outputs) each expert's GEMM is tensorwise with unit scales and the
    row (and column) scales are applied to the product afterwards; forward and gradients equal the grouped
    kernel's."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(COUNTS), inputs, generator=gen)
    x[:48] *= 100.0
    w = torch.randn(len(COUNTS), outputs, inputs, generator=gen) * 0.05
    dy = torch.randn(sum(COUNTS), outputs, generator=gen)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    results, scales = {}, []
    real = torch._scaled_mm
    contraction = outputs if long == "dgrad" else inputs

    def recording(a, b, scale_a, scale_b, **kwargs):
        if a.shape[1] == contraction and a.shape[0] in COUNTS:  # an expert's rows by the long contraction
            scales.append((scale_a.numel(), scale_b.numel()))
        return real(a, b, scale_a, scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    for mode in ("grouped", "per_expert"):
        expert_gemm_mode.set_fp8_expert_gemm(mode)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = sgm.ScaledGroupedMm.apply(xx, ww, ends)
        out.backward(dy)
        results[mode] = (out.detach(), xx.grad, ww.grad)
    assert scales == [(1, 1)] * sum(1 for c in COUNTS if c)
    for want, got in zip(results["grouped"], results["per_expert"]):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_per_expert_gemm_refuses_column_scales_without_row_scales(reference_kernel):
    a = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    b = torch.zeros(2, 32, 64).to(torch.float8_e4m3fn).transpose(1, 2)
    with pytest.raises(ValueError, match="a_scale is None but b_scale is given"):
        expert_gemm_mode.per_expert_mm(a, None, b, torch.ones(2, 32), torch.tensor([16, 32]), torch.float32)


def test_per_expert_wgrad_gemm_refuses_a_contraction_alignment_below_one(reference_kernel):
    codes = torch.zeros(32, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_align must be a positive number of tokens, got 0"):
        expert_gemm_mode.per_expert_wgrad_mm(codes, torch.ones(64), codes, torch.ones(64), torch.tensor([16, 32]),
                                             torch.float32, 0)


def test_per_expert_gemm_runs_one_scaled_mm_per_expert_with_rows(reference_kernel, monkeypatch):
    calls = []
    real = torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append(tuple(a.shape))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    expert_gemm_mode.set_fp8_expert_gemm("per_expert")
    x, w, _ = _operands(3)
    sgm.ScaledGroupedMm.apply(x, w, torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32))
    assert calls == [(c, x.shape[1]) for c in COUNTS if c]


def test_per_expert_backward_reads_the_transposed_codes_in_place(reference_kernel, monkeypatch):
    """The backward: one data-gradient GEMM per expert with rows, then one weight-gradient GEMM per expert with rows
    whose operands are column slices of the two transposed code matrices (no packed copies), each expert's
    contraction padded to a multiple of ``WGRAD_K_ALIGN``; an expert without rows gets a zero weight gradient."""
    calls = []
    real = torch._scaled_mm

    def recording(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape), a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()))
        return real(a, b, *args, **kwargs)

    expert_gemm_mode.set_fp8_expert_gemm("per_expert")
    x, w, dy = _operands(3)
    x, w = x.requires_grad_(), w.requires_grad_()
    out = sgm.ScaledGroupedMm.apply(x, w, torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32))
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    out.backward(dy)
    with_rows = [c for c in COUNTS if c]
    dgrad, wgrad = calls[:len(with_rows)], calls[len(with_rows):]
    assert [(a, b) for a, b, _, _ in dgrad] == [((c, w.shape[1]), (w.shape[1], w.shape[2])) for c in with_rows]
    padded = [-(-c // sgm.WGRAD_K_ALIGN) * sgm.WGRAD_K_ALIGN for c in with_rows]  # zero columns up to 128 tokens
    assert [(a, b) for a, b, _, _ in wgrad] == [((w.shape[1], c), (c, w.shape[2])) for c in padded]
    assert len({a for _, _, a, _ in wgrad}) == 1 and len({b for _, _, _, b in wgrad}) == 1  # one storage each
    assert torch.all(w.grad[COUNTS.index(0)] == 0) and w.grad.abs().sum() > 0


def test_per_expert_backward_mode_groups_the_forward_and_splits_the_backward(reference_kernel, monkeypatch):
    """``per_expert_backward``: the forward's GEMM is the grouped kernel (no ``torch._scaled_mm``), the group ends go
    to the host through the copy that does not wait, and the backward runs one data-gradient and one weight-gradient
    GEMM per expert with rows, on that copy."""
    calls, grouped_calls, copies = [], [], []
    real_mm, real_kernel = torch._scaled_mm, sgm._KERNEL
    real_async = expert_gemm_mode.group_ends_to_host_async
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, *args, **kw: calls.append(a.shape) or real_mm(a, b, *args, **kw))
    monkeypatch.setattr(sgm, "_KERNEL", lambda *args, **kw: grouped_calls.append(1) or real_kernel(*args, **kw))
    monkeypatch.setattr(expert_gemm_mode, "group_ends_to_host_async", lambda e: copies.append(real_async(e)) or copies[-1])
    expert_gemm_mode.set_fp8_expert_gemm("per_expert_backward")
    x, w, dy = _operands(3)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = sgm.ScaledGroupedMm.apply(x.requires_grad_(), w.requires_grad_(), ends)
    assert calls == [] and grouped_calls == [1] and len(copies) == 1
    assert copies[0] is not ends and torch.equal(copies[0], ends)
    out.backward(dy)
    assert len(calls) == 2 * sum(1 for c in COUNTS if c) and grouped_calls == [1]


def test_a_host_copy_on_its_way_is_waited_for_once(monkeypatch):
    """The first reader of a copy made by ``group_ends_to_host_async`` waits on the copy's event and forgets it;
    later readers find it done."""
    waits = []

    class _Event:
        def synchronize(self) -> None:
            waits.append(1)

    host = torch.tensor([4, 4, 12], dtype=torch.int32)
    monkeypatch.setitem(expert_gemm_mode._PENDING_HOST_ENDS, host.data_ptr(), _Event())
    assert expert_gemm_mode._group_sizes(host) == [4, 0, 8] and waits == [1]
    assert host.data_ptr() not in expert_gemm_mode._PENDING_HOST_ENDS
    assert expert_gemm_mode._group_sizes(host) == [4, 0, 8] and waits == [1]


def _counting_host_reads(monkeypatch) -> list[torch.Tensor]:
    """Record every host copy of the group ends made (``group_ends_to_host_async``, in both per-expert modes)."""
    copies = []
    real_copy = expert_gemm_mode.group_ends_to_host_async
    monkeypatch.setattr(expert_gemm_mode, "group_ends_to_host_async",
                        lambda ends: copies.append(real_copy(ends)) or copies[-1])
    return copies


def _ends_given_to_the_gemms(monkeypatch) -> list[torch.Tensor]:
    """Record the group ends each per-expert GEMM op is given."""
    seen = []
    for name in ("per_expert_mm", "per_expert_wgrad_mm"):
        real_op = getattr(sgm, name)
        monkeypatch.setattr(sgm, name, lambda *args, _op=real_op: seen.append(args[4]) or _op(*args))
    return seen


@pytest.mark.parametrize("fp8_param", [False, True], ids=["bf16-weight", "fp8-param"])
def test_per_expert_gemms_read_the_group_ends_once_per_layer(reference_kernel, monkeypatch, fp8_param):
    """One device-to-host read of the group ends per grouped layer and micro-batch: the forward makes the host copy
    and the forward, data-gradient and weight-gradient GEMMs all take it (not the device ends)."""
    from megatron_core.distributed.fp8_params import make_fp8_param
    from megatron_core.fp8 import fp8_param_grouped as fpg

    copies, seen = _counting_host_reads(monkeypatch), _ends_given_to_the_gemms(monkeypatch)
    expert_gemm_mode.set_fp8_expert_gemm("per_expert")
    x, w, dy = _operands(3)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = x.requires_grad_()
    if fp8_param:
        w = make_fp8_param(torch.nn.Parameter(w), scaling="rowwise")
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(w.shape), False
        out = fpg.ScaledGroupedMmFp8Param.apply(x, w, ends, w.fp8_scale, w.main_grad, "empty")
    else:
        out = sgm.ScaledGroupedMm.apply(x, w.requires_grad_(), ends)
    out.backward(dy)
    assert len(copies) == 1 and copies[0] is not ends and torch.equal(copies[0], ends)
    assert len(seen) == 3 and all(arg is copies[0] for arg in seen)  # forward, data gradient, weight gradient


def test_per_expert_gemm_refuses_a_cuda_graph_capture_by_name(reference_kernel, monkeypatch):
    monkeypatch.setattr(expert_gemm_mode.device, "is_capturing", lambda t: True)
    expert_gemm_mode.set_fp8_expert_gemm("per_expert")
    x, w, _ = _operands(3)
    with pytest.raises(RuntimeError, match=r"CUDA graph capture.*set_fp8_expert_gemm\('grouped'\)"):
        sgm.ScaledGroupedMm.apply(x, w, torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32))


def test_a_bad_mode_is_refused_naming_its_source(monkeypatch):
    monkeypatch.setattr(expert_gemm_mode, "_mode", None)
    with pytest.raises(ValueError, match=r"set_fp8_expert_gemm: mode='fast'.*'grouped', 'per_expert'"):
        expert_gemm_mode.set_fp8_expert_gemm("fast")
    monkeypatch.setenv(expert_gemm_mode.EXPERT_GEMM_ENV, "cutlass")
    with pytest.raises(ValueError, match=r"MEGATRON_CORE_FP8_EXPERT_GEMM='cutlass'"):
        expert_gemm_mode.fp8_expert_gemm()
    monkeypatch.setenv(expert_gemm_mode.EXPERT_GEMM_ENV, "per_expert")
    assert expert_gemm_mode.fp8_expert_gemm() == "per_expert"


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", [32, 256], ids=["short_dgrad", "long_dgrad"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_per_expert_gemms_equal_the_grouped_kernel(monkeypatch, compiled, outputs):
    """On Hopper with bf16 operands: forward, data and weight gradients of both modes agree (the same codes and
    scales; the kernels' fp32 accumulations may order their sums differently); with 256 outputs the per-expert data
    gradient takes the tensorwise kernels, its row scales applied after."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x, w, dy = _operands(3)
    if outputs != w.shape[1]:
        gen = torch.Generator().manual_seed(7)
        w = torch.randn(w.shape[0], outputs, w.shape[2], generator=gen) * 0.05
        dy = torch.randn(x.shape[0], outputs, generator=gen)
    x, w, dy = (t.cuda().to(torch.bfloat16) for t in (x, w, dy))
    if not sgm.scaled_grouped_mm_supported(x):
        pytest.skip("needs torch._scaled_grouped_mm (Hopper)")
    monkeypatch.setattr(expert_gemm_mode, "_mode", None)
    ends = torch.tensor(COUNTS, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    results = {}
    for mode in expert_gemm_mode.EXPERT_GEMM_MODES:
        expert_gemm_mode.set_fp8_expert_gemm(mode)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()

        def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return sgm.ScaledGroupedMm.apply(a, b, ends)

        if compiled:
            torch._dynamo.reset()
            gemm = torch.compile(gemm, fullgraph=True)
        out = gemm(xx, ww)
        out.backward(dy)
        results[mode] = (out.float(), xx.grad.float(), ww.grad.float())
    for mode in ("per_expert", "per_expert_backward"):
        for want, got in zip(results["grouped"], results[mode]):
            assert want.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert results["per_expert_backward"][0].equal(results["grouped"][0])  # the same grouped forward GEMM


@pytest.mark.gpu
def test_gpu_ends_copied_without_waiting_arrive_pinned_with_their_event():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ends = torch.tensor(COUNTS, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    torch.cuda._sleep(10_000_000)  # the copy queued behind a long kernel
    host = expert_gemm_mode.group_ends_to_host_async(ends)
    assert host.device.type == "cpu" and host.is_pinned()
    assert host.data_ptr() in expert_gemm_mode._PENDING_HOST_ENDS
    sizes = expert_gemm_mode._group_sizes(host)
    assert sizes == COUNTS and host.data_ptr() not in expert_gemm_mode._PENDING_HOST_ENDS


@pytest.mark.gpu
def test_gpu_unread_copies_past_the_limit_are_waited_for_and_forgotten(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(expert_gemm_mode, "_PENDING_LIMIT", 1)
    monkeypatch.setattr(expert_gemm_mode, "_PENDING_HOST_ENDS", {})
    ends = torch.tensor(COUNTS, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    torch.cuda._sleep(10_000_000)
    first = expert_gemm_mode.group_ends_to_host_async(ends)
    second = expert_gemm_mode.group_ends_to_host_async(ends)
    assert list(expert_gemm_mode._PENDING_HOST_ENDS) == [second.data_ptr()]
    assert first.tolist() == ends.tolist()  # waited for when forgotten
    assert expert_gemm_mode._group_sizes(second) == COUNTS


def test_a_known_host_copy_of_the_ends_is_not_read_again(reference_kernel, monkeypatch):
    """Given the host ends (read once by the expert MLP for fc1 and fc2), the function reads none and its forward,
    data-gradient and weight-gradient GEMMs take the copy it was given."""
    copies, seen = _counting_host_reads(monkeypatch), _ends_given_to_the_gemms(monkeypatch)
    expert_gemm_mode.set_fp8_expert_gemm("per_expert")
    x, w, dy = _operands(3)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    host_ends = ends.clone()
    out = sgm.ScaledGroupedMm.apply(x.requires_grad_(), w.requires_grad_(), ends, True, None, None, None, host_ends)
    out.backward(dy)
    assert copies == [] and len(seen) == 3 and all(arg is host_ends for arg in seen)


def _fp8_experts_and_layout():
    from tests.fp8.test_fp8_grouped_swiglu import _aligned_rows, _cpu_fp8_experts

    experts = _cpu_fp8_experts()
    x, layout, probs = _aligned_rows()
    return experts, x, layout, probs


def test_rows_for_gemms_reads_the_ends_once_in_per_expert_mode_only(monkeypatch):
    monkeypatch.setattr(expert_gemm_mode, "_mode", None)
    experts, _, layout, _ = _fp8_experts_and_layout()
    fc1 = experts.linear_fc1
    copies = _counting_host_reads(monkeypatch)
    assert fc1.rows_for_gemms(layout) is layout  # emulated GEMMs read the counts themselves
    fc1.float8_emulate = False
    expert_gemm_mode.set_fp8_expert_gemm("grouped")
    assert fc1.rows_for_gemms(layout) is layout and copies == []
    expert_gemm_mode.set_fp8_expert_gemm("per_expert")
    prepared = fc1.rows_for_gemms(layout)
    assert len(copies) == 1 and prepared.host_ends is copies[0] and torch.equal(prepared.host_ends, layout.ends)
    assert type(prepared) is type(layout) and prepared.index is layout.index and prepared.ends is layout.ends
    assert fc1.rows_for_gemms(prepared) is prepared and len(copies) == 1  # read already: kept
    assert fc1.rows_for_gemms([4, 0, 12]) == [4, 0, 12]  # host counts need no copy


def test_the_expert_mlp_gives_fc1_and_fc2_one_host_copy(monkeypatch):
    """``TEGroupedMLP`` asks fc1 once for the layout (``rows_for_gemms``) and hands the same one, carrying the one
    host copy of the ends, to fc1 and fc2 (on CPU the GEMMs themselves run emulated)."""
    monkeypatch.setattr(expert_gemm_mode, "_mode", None)
    experts, x, layout, probs = _fp8_experts_and_layout()
    want, _ = experts(x, layout, probs)
    experts.linear_fc1.float8_emulate = False
    copies, layouts = _counting_host_reads(monkeypatch), []
    for layer in (experts.linear_fc1, experts.linear_fc2):
        layer.register_forward_pre_hook(lambda module, args: layouts.append(args[1]))
    expert_gemm_mode.set_fp8_expert_gemm("per_expert")
    got, _ = experts(x, layout, probs)
    assert len(copies) == 1 and len(layouts) == 2 and layouts[0] is layouts[1]
    assert layouts[0].host_ends is copies[0] and torch.equal(copies[0], layout.ends)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_expert", "per_expert_backward"])
@pytest.mark.parametrize("fused", [True, False], ids=["fc1-swiglu-fused", "unfused"])
def test_gpu_fp8_expert_mlp_reads_the_ends_once_per_expert(monkeypatch, fused, mode):
    """A Hopper FP8 ``TEGroupedMLP`` in ``per_expert`` mode reads the group ends to the host once per forward (fc1 and
    fc2, forward and backward share the copy) and agrees with the grouped kernel."""
    from megatron_core.fp8 import grouped_swiglu
    from tests.fp8.test_fp8_grouped_swiglu import _experts_step, gpu_fp8_experts_and_batch

    experts, tokens_per_expert, x, probs, grad = gpu_fp8_experts_and_batch()
    monkeypatch.setattr(expert_gemm_mode, "_mode", None)
    monkeypatch.setattr(grouped_swiglu, "FUSED_WEIGHTED_SWIGLU", fused)
    expert_gemm_mode.set_fp8_expert_gemm("grouped")
    grouped = _experts_step(experts, x, tokens_per_expert, probs, grad)
    copies = _counting_host_reads(monkeypatch)
    expert_gemm_mode.set_fp8_expert_gemm(mode)
    per_expert = _experts_step(experts, x, tokens_per_expert, probs, grad)
    assert len(copies) == 1
    for got, want in zip(per_expert, grouped):
        assert want.abs().max() > 0
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
