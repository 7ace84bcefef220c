"""Host time to issue the per-expert FP8 GEMMs: ``torch._scaled_mm`` alone and through the library's op.

Issues a layer's eight per-expert GEMMs (Mixtral 8x7B's fc1 shape by default, 8192 rows routed unevenly) and times
only the host's side: the wall time of the issuing loop, the GPU synchronized before each repeat and not inside it.
Prints microseconds of host time per GEMM for a plain loop of ``torch._scaled_mm`` calls on views made beforehand and
for the ``megatron_core::fp8_per_expert_mm`` op (which makes the views and the output itself). Where the MoE step
waits for the host (``benchmarks/RESULTS.md``, session 51), these microseconds are what it waits for.

    PYTHONPATH=src python3 benchmarks/fp8_gemm_host_time.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_core.fp8.expert_gemm_mode import _expert_operands, per_expert_mm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=28672)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = [1104, 880, 1200, 960, 1008, 1056, 912, args.rows - 7120]
    a = torch.randn(args.rows, args.k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8, args.n, args.k, device="cuda").to(torch.float8_e4m3fn)  # each b[e].T column-major
    a_scale = torch.rand(args.rows, device="cuda") + 0.5
    b_scale = torch.rand(8, args.n, device="cuda") + 0.5
    out = torch.empty(args.rows, args.n, dtype=torch.bfloat16, device="cuda")
    parts = list(zip(a.split(sizes), b.unbind(0), a_scale[:, None].split(sizes), b_scale[:, None, :].unbind(0),
                     out.split(sizes)))
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)

    def torch_path() -> None:
        for a_e, b_t_e, s_a, s_b, out_e in parts:
            torch._scaled_mm(a_e, b_t_e.t(), s_a, s_b, out_dtype=torch.bfloat16, use_fast_accum=True, out=out_e)

    def op_path() -> None:
        per_expert_mm(a, a_scale, b.transpose(1, 2), b_scale, ends, torch.bfloat16)

    def op_function() -> None:  # the op's Python function without the dispatcher
        per_expert_mm._init_fn(a, a_scale, b.transpose(1, 2), b_scale, ends, torch.bfloat16)

    def views_only() -> None:  # the op's host work but its GEMMs: output, sizes, views
        new = a.new_empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
        list(_expert_operands(a, a_scale, b.transpose(1, 2), b_scale, ends, new))

    def loop_new_output() -> None:  # the plain loop into a fresh output each time
        new = a.new_empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
        for (a_e, b_t_e, s_a, s_b, _), out_e in zip(parts, new.split(sizes)):
            torch._scaled_mm(a_e, b_t_e.t(), s_a, s_b, out_dtype=torch.bfloat16, use_fast_accum=True, out=out_e)

    def loop_no_out() -> None:  # the plain loop, each GEMM allocating its result
        for a_e, b_t_e, s_a, s_b, _ in parts:
            torch._scaled_mm(a_e, b_t_e.t(), s_a, s_b, out_dtype=torch.bfloat16, use_fast_accum=True)

    def host_us(issue) -> float:  # noqa: ANN001 - a callable issuing 8 GEMMs
        samples = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            issue()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) / 8 * 1e6

    print(f"torch._scaled_mm loop: {host_us(torch_path):.1f} us of host time per GEMM")
    print(f"fp8_per_expert_mm op: {host_us(op_path):.1f} us of host time per GEMM")
    print(f"the op's function called directly: {host_us(op_function):.1f} us per GEMM")
    print(f"the op's output and views, no GEMM: {host_us(views_only):.1f} us per GEMM")
    print(f"torch._scaled_mm loop into a fresh output: {host_us(loop_new_output):.1f} us per GEMM")
    print(f"torch._scaled_mm loop without out=: {host_us(loop_no_out):.1f} us per GEMM")


if __name__ == "__main__":
    main()
