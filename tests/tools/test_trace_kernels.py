"""``benchmarks/trace_kernels.py`` reads a profiler Chrome trace: kernels by name, by functor, and by launcher."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_kernels  # noqa: E402

_ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
_FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
         "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")


def _event(cat: str, name: str, ts: float, dur: float, correlation: int | None = None) -> dict:
    """One complete (``"X"``) event of a Chrome trace: kernels on the GPU's row, everything else on the host's."""
    pid, tid = (0, 9) if cat == "kernel" else (1, 7)
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def _write(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _trace(path: Path) -> Path:
    """Two CPU operators (``outer`` around ``aten::add_``, then ``aten::fill_``), their runtime launches and kernels."""
    return _write(path, [
        _event("cpu_op", "outer", 0, 100),
        _event("cpu_op", "aten::add_", 10, 20),
        _event("cuda_runtime", "cudaLaunchKernel", 12, 3, correlation=1),
        _event("cpu_op", "aten::fill_", 200, 20),
        _event("cuda_runtime", "cudaLaunchKernel", 205, 3, correlation=2),
        _event("kernel", _ADD, 50, 23.0, correlation=1),
        _event("kernel", _FILL, 250, 5.0, correlation=2),
    ])


def test_kernels_are_grouped_by_name_and_told_apart_by_functor(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    assert dict(trace_kernels.kernel_times(trace)) == {"void at::native::vectorized_elementwise_kernel": [23.0, 5.0]}
    assert dict(trace_kernels.kernel_times(trace, functors=True)) == {
        "void at::native::vectorized_elementwise_kernel [CUDAFunctor_add]": [23.0],
        "void at::native::vectorized_elementwise_kernel [FillFunctor]": [5.0]}


def test_functor_prefers_the_kernel_function_over_the_wrapper() -> None:
    copy = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const>(int)")
    reciprocal = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
                  "reciprocal_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int)")
    assert trace_kernels.functor_of(copy) == " [direct_copy_kernel_cuda]"
    assert trace_kernels.functor_of(reciprocal) == " [reciprocal_kernel_cuda]"
    assert trace_kernels.functor_of("triton_poi_fused_add_0") == ""


def test_launchers_name_the_cpu_operators_around_the_launch(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    stacks = trace_kernels.launchers(trace, "CUDAFunctor_add", functors=True)
    assert dict(stacks) == {"outer > aten::add_ > cudaLaunchKernel": [23.0]}


def test_idle_gaps_name_what_the_host_did_and_what_resumed_the_gpu(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    busy, span, gaps = trace_kernels.idle_gaps(trace, min_us=10)
    assert (busy, span) == (28.0, 205.0)
    assert dict(gaps) == {"idle at: outer | resumed by: aten::fill_ > cudaLaunchKernel": [177.0]}
    assert dict(trace_kernels.idle_gaps(trace, min_us=200)[2]) == {}


def test_idle_gaps_know_driver_launches_and_name_the_outermost_operator(tmp_path: Path) -> None:
    """A Triton kernel is launched through the driver (``cuLaunchKernelEx``); the host's stack when the GPU went idle
    starts with its outermost operator where it is deeper than the depth shown."""
    trace = _write(tmp_path / "t.json", [
        _event("cpu_op", "step", 0, 400),
        _event("cpu_op", "layer", 1, 390),
        _event("cpu_op", "mlp", 2, 380),
        _event("cpu_op", "aten::copy_", 20, 100),
        _event("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _event("cpu_op", "triton_poi_fused_0", 200, 20),
        _event("cuda_driver", "cuLaunchKernelEx", 205, 3, correlation=2),
        _event("kernel", "k0", 10, 40.0, correlation=1),
        _event("kernel", "triton_poi_fused_0", 210, 5.0, correlation=2),
    ])
    _, _, gaps = trace_kernels.idle_gaps(trace, min_us=10, depth=2)
    assert dict(gaps) == {"idle at: step > ... > mlp > aten::copy_ | resumed by: mlp > triton_poi_fused_0 > "
                          "cuLaunchKernelEx": [160.0]}
