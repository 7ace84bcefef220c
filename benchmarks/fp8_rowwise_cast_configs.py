"""The row-wise FP8 cast of the experts' long rows on Hopper: the one-pass whole-row kernel against two-pass blockings.

The data gradient of an FP8 expert layer's fc1 casts ``dy [rows, 2 * ffn]`` (28,672 columns for Mixtral) with the
weight scales folded in (``rowwise_cast(t, factors, row_groups)``); fc2's forward casts the activation ``[rows, ffn]``.
For each shape this times :func:`megatron_core.fp8.cast_kernels.rowwise_cast` as the library launches it, then the
two-pass kernel (``rowwise_kernel``: one pass for the row maxima, one to cast, the second reading what the first
just read, from L2 when a program's rows are few) at several blockings, and prints the bandwidth of each (the bf16
read and the e4m3 write).

    PYTHONPATH=src:benchmarks python3 benchmarks/fp8_rowwise_cast_configs.py
"""

from __future__ import annotations

import argparse

import torch
from grouped_gemm_parts import time_ms  # the same CUDA-event timer

from megatron_core.fp8 import cast_kernels
from megatron_core.fp8.cast_kernels import rowwise_cast

TWO_PASS = [(1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (2, 2048, 8), (4, 1024, 8), (4, 512, 4),
            (16, 256, 4)]  # rows per program, columns per step, warps


def two_pass(t: torch.Tensor, factors: torch.Tensor, groups: torch.Tensor, has_factors: bool,
             rows_per_program: int, block_cols: int, warps: int) -> None:
    rows, cols = t.shape
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=t.device)
    inverse = torch.empty(rows, dtype=torch.float32, device=t.device)
    cast_kernels._kernels()[0][(-(-rows // rows_per_program),)](
        t, factors, groups, out, inverse, rows, cols, HAS_FACTOR=has_factors, BR=rows_per_program, BC=block_cols,
        num_warps=warps)


def time_shape(t: torch.Tensor, factors: torch.Tensor, groups: torch.Tensor, has_factors: bool) -> str:
    """One line: the library's cast of ``t`` and each two-pass blocking, in ms and GB/s."""
    gigabytes = t.numel() * 3 / 1e9
    f = factors if has_factors else t
    line = [f"[{t.shape[0]}x{t.shape[1]}]{' with factors' if has_factors else ''}:"]
    ms = time_ms(lambda: rowwise_cast(t, factors, groups) if has_factors else rowwise_cast(t))
    line.append(f"library {ms:.3f} ms ({gigabytes / ms * 1e3:.0f} GB/s)")
    for config in TWO_PASS:
        ms = time_ms(lambda c=config: two_pass(t, f, groups, has_factors, *c))
        line.append(f"2-pass {config} {ms:.3f} ({gigabytes / ms * 1e3:.0f})")
    return "  ".join(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--cols", type=int, nargs="+", default=[4096, 14336, 28672])
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for cols in args.cols:
        t = torch.randn(args.rows, cols, device="cuda", dtype=torch.bfloat16)
        factors = torch.rand(args.experts, cols, device="cuda") + 0.5
        groups = (torch.arange(args.rows, device="cuda") * args.experts // args.rows).to(torch.int32)
        for has_factors in (False, True):
            print(time_shape(t, factors, groups, has_factors), flush=True)


if __name__ == "__main__":
    main()
