"""Time each GEMM of the experts' fc1 / fc2 (forward, data gradient, weight gradient) in several layouts.

The MoE reference config (issue 15: hidden 2048, expert FFN 5632 SwiGLU, 8 experts, top-2, 4096 tokens)
spends most of its step in grouped GEMMs, which run about 1.37x slower than one dense GEMM of the same
FLOPs. This script splits that figure by GEMM and tries the alternatives, each against the dense GEMM of
the same shape in the same run:

- ``grouped, weight^T view``: ``grouped_mm(x, W.transpose(1, 2))`` with ``W [E, out, in]`` (the layout of
  ``ColumnParallelGroupedLinear``), and the two gradient GEMMs autograd derives from it;
- ``grouped, [E, in, out]``: the same with the weight stored transposed;
- ``wgrad as [E, out, in]``: ``grouped_mm(dy.T, x)``, the weight gradient in the parameter's own layout;
- ``bmm``: every expert given the same number of rows (``torch.bmm``), the padded-capacity layout;
- ``per-expert mm``: one ``mm`` per expert.

    PYTHONPATH=src python3 benchmarks/grouped_gemm_parts.py          # GPU, bf16
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
PEAK_FLOPS = 989e12


def capture_graph(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` captured as one CUDA graph, after one warm-up call on a side stream (as capture
    needs); replay it to time GPU work without the host's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_ms(fn: Callable[[], object], iters: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of ``fn`` (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def row(name: str, ms: float, flops: float, dense_ms: float) -> None:
    """One line: time, TFLOP/s, MFU and the ratio to the dense GEMM of the same FLOPs."""
    print(f"{name:52s} {ms:7.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  {100 * flops / ms / 1e9 / (PEAK_FLOPS / 1e12):5.1f}% "
          f" {ms / dense_ms:5.2f}x dense", flush=True)


def bench_projection(label: str, rows: int, experts: int, n_in: int, n_out: int, counts: list[int]) -> None:
    """All variants of one projection ``[rows, n_in] -> [rows, n_out]`` split over ``experts``."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(rows, n_in, device=dev, dtype=dt)
    dy = torch.randn(rows, n_out, device=dev, dtype=dt)
    w = torch.randn(experts, n_out, n_in, device=dev, dtype=dt)
    w_t = w.transpose(1, 2).contiguous()  # [E, in, out]
    offs = torch.tensor(counts).cumsum(0).to(dev, torch.int32)  # each group's end row
    dense_w = torch.randn(n_out, n_in, device=dev, dtype=dt)
    flops = 2.0 * rows * n_in * n_out
    print(f"--- {label}: rows {rows}, in {n_in}, out {n_out}, experts {experts}, counts {counts[:4]}...", flush=True)

    dense = {
        "fwd": time_ms(lambda: F.linear(x, dense_w)),
        "dgrad": time_ms(lambda: dy @ dense_w),
        "wgrad": time_ms(lambda: dy.t() @ x),
    }
    for part, ms in dense.items():
        row(f"dense {part}", ms, flops, ms)
    variants: dict[str, Callable[[], object]] = {
        "grouped fwd, weight^T view": lambda: _GROUPED_MM(x, w.transpose(1, 2), offs=offs),
        "grouped fwd, [E, in, out]": lambda: _GROUPED_MM(x, w_t, offs=offs),
        "grouped dgrad, W [E, out, in]": lambda: _GROUPED_MM(dy, w, offs=offs),
        "grouped dgrad, W^T view of [E, in, out]": lambda: _GROUPED_MM(dy, w_t.transpose(1, 2), offs=offs),
        "grouped wgrad x^T dy -> [E, in, out]": lambda: _GROUPED_MM(x.t(), dy, offs=offs),
        "grouped wgrad x^T dy -> [E, in, out] + transpose copy":
            lambda: _GROUPED_MM(x.t(), dy, offs=offs).transpose(1, 2).contiguous(),
        "grouped wgrad dy^T x -> [E, out, in]": lambda: _GROUPED_MM(dy.t(), x, offs=offs),
    }
    cap = rows // experts
    xb, dyb = x[: cap * experts].view(experts, cap, n_in), dy[: cap * experts].view(experts, cap, n_out)
    variants.update({
        "bmm fwd (equal rows)": lambda: torch.bmm(xb, w.transpose(1, 2)),
        "bmm dgrad": lambda: torch.bmm(dyb, w),
        "bmm wgrad": lambda: torch.bmm(dyb.transpose(1, 2), xb),
        "per-expert mm fwd": lambda: [F.linear(p, w[e]) for e, p in enumerate(x.split(counts))],
        "per-expert mm wgrad": lambda: [d.t() @ p for d, p in zip(dy.split(counts), x.split(counts))],
    })
    for name, fn in variants.items():
        part = "fwd" if "fwd" in name else "dgrad" if "dgrad" in name else "wgrad"
        try:
            ms = time_ms(fn)
        except Exception as error:  # a layout the installed kernel refuses
            print(f"{name:52s} refused: {type(error).__name__}: {str(error)[:120]}", flush=True)
            continue
        row(name, ms, flops, dense[part])


def main() -> None:
    """Both projections of the reference config, even and uneven routing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    args = parser.parse_args()
    if _GROUPED_MM is None or not torch.cuda.is_available():
        raise SystemExit("needs CUDA and a torch with grouped_mm")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = args.tokens * args.topk
    even = [rows // args.experts] * args.experts
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(args.experts, generator=gen) + 0.5
    uneven = [int(rows * w / weights.sum()) // 16 * 16 for w in weights]
    uneven[-1] += rows - sum(uneven)
    for routing, counts in (("even", even), ("uneven", uneven)):
        bench_projection(f"fc1 ({routing})", rows, args.experts, args.hidden, 2 * args.ffn, counts)
        bench_projection(f"fc2 ({routing})", rows, args.experts, args.ffn, args.hidden, counts)


if __name__ == "__main__":
    main()
