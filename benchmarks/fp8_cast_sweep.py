"""The FP8 experts' casts at a MoE layer's shapes: time and memory bandwidth of each kernel configuration (issue 44).

For the tensors one expert MLP casts per micro-batch (``rows`` routed tokens; ``hidden``, ``ffn`` and ``2 * ffn``
columns) times :mod:`megatron_core.fp8.cast_kernels`' row-wise cast (one-pass whole-row kernel and two-pass
kernel, with and without the data gradient's per-group factors) and the per-group column-wise cast (column maxima,
then the transposing cast) over a grid of block sizes and warps, checks every configuration's codes and scales
against the default's bit for bit, and prints the bandwidth each reaches (bytes: the bf16 read plus the e4m3
write; the column maxima: the read). The best configuration per shape is what the library's constants should be. Times are GPU times (CUDA
graphs of ten calls): eager launches of kernels this short time the host.

    PYTHONPATH=src:benchmarks python3 benchmarks/fp8_cast_sweep.py --hidden 4096 --ffn 14336 --rows 8192
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from grouped_gemm_parts import capture_graph  # the same graph capture as the other GPU-time benchmarks

from megatron_core.fp8 import cast_kernels as ck


def graph_ms(fn: Callable[[], object], calls: int = 10, reps: int = 10) -> float:
    """Median milliseconds of one ``fn`` call, ``calls`` of them replayed as one CUDA graph (GPU time: the eager
    launches of these short kernels would time the host)."""
    graph = capture_graph(fn, calls)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


@contextmanager
def patched(**values: object) -> Iterator[None]:
    """Module constants (or functions) of ``cast_kernels`` set to ``values`` for the block."""
    old = {k: getattr(ck, k) for k in values}
    for k, v in values.items():
        setattr(ck, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(ck, k, v)


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Bit-for-bit equality of two tuples of tensors (float8 compared as bytes)."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return all(x.shape == y.shape and torch.equal(raw(x), raw(y)) for x, y in zip(a, b))


def report(name: str, fn: Callable[[], tuple[torch.Tensor, ...]], want: tuple[torch.Tensor, ...],
           nbytes: float) -> float:
    """Time ``fn``, check it against ``want``, print its bandwidth; returns milliseconds (inf when wrong)."""
    try:
        ok = same(fn(), want)
    except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses is reported and skipped
        print(f"  {name:58s} failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
        return float("inf")
    ms = graph_ms(fn)
    print(f"  {name:58s} {ms:7.3f} ms {nbytes / ms / 1e9:6.2f} TB/s{'' if ok else '  WRONG'}", flush=True)
    return ms if ok else float("inf")


def sweep_rowwise(t: torch.Tensor, factors: torch.Tensor | None, groups: torch.Tensor) -> None:
    """The row-wise cast of ``t`` in each configuration."""
    rows, cols = t.shape
    label = f"rowwise [{rows} x {cols}]" + (" with factors" if factors is not None else "")
    print(label, flush=True)
    has = factors is not None
    args = (t, factors if has else t, groups if has else t.new_zeros(1, dtype=torch.int32), has)
    want = ck._rowwise(*args)
    nbytes = rows * cols * 3.0
    results = {"default": report("default", lambda: ck._rowwise(*args), want, nbytes)}
    width = 1 << (cols - 1).bit_length()
    if cols <= ck.WHOLE_ROW_MAX:
        for per, warps in itertools.product((width, 2 * width, 4 * width), (4, 8, 16, 32)):
            if per > 32768 or per // (32 * warps) > 128 or per // (32 * warps) < 4:
                continue
            blocks = (per // width, width, warps)
            with patched(whole_row_blocks=lambda _c, b=blocks: b):
                results[f"whole rows={blocks[0]} warps={warps}"] = report(
                    f"whole rows={blocks[0]} warps={warps}", lambda: ck._rowwise(*args), want, nbytes)
    for br, bc, warps in itertools.product((1, 2, 4), (1024, 2048, 4096), (4, 8)):
        if br * bc // (32 * warps) > 64 or br * bc // (32 * warps) < 4:
            continue
        with patched(WHOLE_ROW_MAX=0, _ROW_BLOCK=br, _COL_BLOCK=bc, _ROW_WARPS=warps):
            name = f"two-pass rows={br} cols={bc} warps={warps}"
            results[name] = report(name, lambda: ck._rowwise(*args), want, nbytes)
    best = min(results, key=results.get)
    print(f"BEST {label}: {best} {results[best]:.3f} ms (default {results['default']:.3f} ms)", flush=True)


def sweep_columnwise(t: torch.Tensor, ends: torch.Tensor, groups: torch.Tensor) -> None:
    """The per-group column-wise transposing cast of ``t``: its column maxima and its cast, each configuration."""
    rows, cols = t.shape
    label = f"group columnwise [{rows} x {cols}]"
    print(label, flush=True)
    want = ck._group_columnwise(t, ends, groups)
    results = {"default": report("default (maxima + cast)", lambda: ck._group_columnwise(t, ends, groups), want,
                                 rows * cols * 5.0)}
    for br, bc, split, warps in itertools.product((32, 64), (64, 128, 256), (1, 8), (4, 8)):
        if br * bc // (32 * warps) > 64 or br * bc // (32 * warps) < 8:
            continue
        with patched(_AMAX_ROWS=br, _AMAX_COLS=bc, _AMAX_SPLIT=split, _AMAX_WARPS=warps):
            name = f"maxima rows={br} cols={bc} split={split} warps={warps}"
            results[name] = report(name, lambda: ck._group_columnwise(t, ends, groups), want, rows * cols * 5.0)
    best_amax = min(results, key=results.get)
    print(f"BEST {label} maxima: {best_amax} {results[best_amax]:.3f} ms", flush=True)
    cast_results = {}
    for tile, warps in itertools.product((32, 64, 128), (4, 8, 16)):
        if tile * tile // (32 * warps) > 128 or tile * tile // (32 * warps) < 8:
            continue
        with patched(_TILE=tile, _TILE_WARPS=warps):
            name = f"cast tile={tile} warps={warps}"
            cast_results[name] = report(name, lambda: ck._group_columnwise(t, ends, groups), want, rows * cols * 5.0)
    best = min(cast_results, key=cast_results.get)
    print(f"BEST {label} cast (default maxima): {best} {cast_results[best]:.3f} ms "
          f"(default {results['default']:.3f} ms)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=8192)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    per = args.rows // args.experts
    ends = torch.arange(per, args.rows + 1, per, device="cuda", dtype=torch.int32)
    groups = torch.searchsorted(ends, torch.arange(args.rows, device="cuda", dtype=torch.int32),
                                right=True).to(torch.int32)
    for cols in (args.hidden, args.ffn, 2 * args.ffn):
        t = torch.randn(args.rows, cols, device="cuda", dtype=torch.bfloat16)
        factors = torch.exp2(torch.randint(-8, 0, (args.experts, cols), device="cuda").float())
        sweep_rowwise(t, None, groups)
        if cols != args.ffn:  # the data gradients' casts: fc2's output gradient and SwiGLU's input gradient
            sweep_rowwise(t, factors, groups)
        sweep_columnwise(t, ends, groups)


if __name__ == "__main__":
    main()
