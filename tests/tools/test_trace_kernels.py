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


def _trace(path: Path) -> Path:
    """Two CPU operators (``outer`` around ``aten::add_``, then ``aten::fill_``), their runtime launches and kernels."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "outer", "pid": 1, "tid": 7, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "pid": 1, "tid": 7, "ts": 10, "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 12, "dur": 3,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::fill_", "pid": 1, "tid": 7, "ts": 200, "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 205, "dur": 3,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": _ADD, "pid": 0, "tid": 9, "ts": 50, "dur": 23.0,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": _FILL, "pid": 0, "tid": 9, "ts": 250, "dur": 5.0,
         "args": {"correlation": 2}},
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


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
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "step", "pid": 1, "tid": 7, "ts": 0, "dur": 400},
        {"ph": "X", "cat": "cpu_op", "name": "layer", "pid": 1, "tid": 7, "ts": 1, "dur": 390},
        {"ph": "X", "cat": "cpu_op", "name": "mlp", "pid": 1, "tid": 7, "ts": 2, "dur": 380},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 7, "ts": 20, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 5, "dur": 2,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cpu_op", "name": "triton_poi_fused_0", "pid": 1, "tid": 7, "ts": 200, "dur": 20},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "pid": 1, "tid": 7, "ts": 205, "dur": 3,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "k0", "pid": 0, "tid": 9, "ts": 10, "dur": 40.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_0", "pid": 0, "tid": 9, "ts": 210, "dur": 5.0,
         "args": {"correlation": 2}},
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    _, _, gaps = trace_kernels.idle_gaps(trace, min_us=10, depth=2)
    assert dict(gaps) == {"idle at: step > ... > mlp > aten::copy_ | resumed by: mlp > triton_poi_fused_0 > "
                          "cuLaunchKernelEx": [160.0]}
