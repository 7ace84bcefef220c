"""Tiles of the single-row GEMV (``tensor_parallel/fused_gemv.py``) on the decode-step weights, against cuBLAS (GPU only).

For each weight of a decode step of the reference 1.1B Llama and each fused variant the decode layer uses,
times every tile in ``--tiles`` and the tile the library picks, plus ``torch.mm`` on the same weight. Each
measurement replays a CUDA graph of 24 launches that cycle through enough copies of the weight (400 MB)
that L2 holds none of them, so the times are what a decode step sees; the floor is the weight's bytes over
the copy bandwidth measured first.

    PYTHONPATH=src python benchmarks/gemv_tiles.py
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import torch

from megatron_core.tensor_parallel.fused_gemv import _fused_gemv, _tile

LAUNCHES = 24
# name: (weight rows, columns, RMSNorm prologue, gated SiLU, residual)
CASES = {
    "qkv + norm": (2560, 2048, True, False, False),
    "proj + residual": (2048, 2048, False, False, True),
    "fc1 + norm + swiglu": (11264, 2048, True, True, False),
    "fc2 + residual": (2048, 5632, False, False, True),
    "output layer": (32000, 2048, False, False, False),
}


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy (read plus write)."""
    a = torch.empty(1 << 29, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 4 / ((time.perf_counter() - start) / 20) / 1e9


def graph_us(launch: Callable[[int], object]) -> float:
    """Microseconds per call of ``launch(i)`` inside a replayed CUDA graph of ``LAUNCHES`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(LAUNCHES):
            launch(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            launch(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 / LAUNCHES * 1e3


def measure(name: str, case: tuple[int, int, bool, bool, bool], bandwidth: float, tiles: list[tuple]) -> None:
    """Print cuBLAS, the library's tile and the best of ``tiles`` for one weight and variant."""
    n, k, norm, gated, residual = case
    dtype = torch.bfloat16
    copies = max(4, int(400e6 // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    norm_weight = torch.ones(k, device="cuda", dtype=dtype) if norm else None
    res = torch.randn(1, n // 2 if gated else n, device="cuda", dtype=dtype) if residual else None

    def gemv(tile: tuple) -> float:
        return graph_us(lambda i: _fused_gemv(x, weights[i % copies], None, norm_weight, 1e-5, res, gated, tile))

    floor = n * k * 2 / bandwidth / 1e3
    cublas = graph_us(lambda i: torch.mm(x, weights[i % copies].t()))
    picked = _tile(norm, gated)
    mine = gemv(picked)
    best_us, best = min((gemv(t), t) for t in tiles)
    print(f"{name:22s} [{n} x {k}]  floor {floor:6.2f} us  cuBLAS (plain) {cublas:6.2f} us ({floor / cublas:4.0%})"
          f"  picked {picked} {mine:6.2f} us ({floor / mine:4.0%})  best {best} {best_us:6.2f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-n", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--block-k", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    args = p.parse_args()
    bandwidth = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bandwidth:.0f} GB/s")
    tiles = list(itertools.product(args.block_n, args.block_k, args.warps, args.stages))
    for name, case in CASES.items():
        measure(name, case, bandwidth, tiles)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
