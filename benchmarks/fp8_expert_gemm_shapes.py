"""GPU time of one MoE layer's expert GEMMs, each of the six shapes, in bf16 and in several FP8 forms.

Mixtral 8x7B's expert shape by default (hidden 4096, expert FFN 14336 with SwiGLU so fc1 has 28672 outputs, 8 experts,
8192 routed rows split unevenly). For each GEMM of the layer (fc1 / fc2 forward, data gradient, weight gradient) it
times, with the host taken out (the calls captured in a CUDA graph and replayed):

- ``bf16``: one ``torch.mm`` per expert;
- ``fp8 rowwise``: one ``torch._scaled_mm`` per expert with one scale per row / column (what the library's
  ``per_expert`` mode runs);
- ``fp8 tensorwise``: one ``torch._scaled_mm`` per expert with one scale per operand;
- ``fp8 grouped``: one ``torch._scaled_grouped_mm`` (row-wise scales) for all experts, where torch has it, and with
  ``--autotune`` the same compiled by Inductor with ``max-autotune`` (``fp8 grouped tuned``);
- ``fp8 dense``: one tensorwise GEMM over all rows as if a single expert had them (the ceiling);
- ``.. N st``: the per-expert loop spread over ``N`` CUDA streams, so that one expert's last wave of tiles overlaps
  the next expert's first (each expert's GEMM alone leaves part of the GPU idle in its last wave).

Prints milliseconds per layer and TFLOP/s for each. The library's per-expert step (``benchmarks/RESULTS.md``, issue
44) spends most of its GPU time in these GEMMs, so this says which form of them is worth building on.

    PYTHONPATH=src python3 benchmarks/fp8_expert_gemm_shapes.py
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from grouped_gemm_parts import capture_graph, time_ms

E4M3 = torch.float8_e4m3fn
_GROUPED = getattr(torch, "_scaled_grouped_mm", None)


def _codes(rows: int, cols: int) -> torch.Tensor:
    """Random e4m3 codes ``[rows, cols]`` (row-major)."""
    return (torch.randn(rows, cols, device="cuda") * 4).to(E4M3)


def _scale(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, device="cuda") + 0.5


def _gemm_forms(sizes: list[int], k: int, n: int, autotune: bool = False) -> dict[str, Callable[[], object]]:
    """``out_e = a_e @ b_e`` for experts with ``sizes`` rows, ``a [M, k]`` row-major and ``b_e [k, n]``
    column-major, in every form this script times."""
    rows, experts = sum(sizes), len(sizes)
    a, b = _codes(rows, k), _codes(experts * n, k).view(experts, n, k)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    a_row, b_col = _scale(rows), _scale(experts, n)
    one = torch.ones((), device="cuda")
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    a_parts, a16_parts, row_parts, out_parts = a.split(sizes), a16.split(sizes), a_row[:, None].split(sizes), out.split(sizes)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    big_b = _codes(n, k)

    bf16 = [functools.partial(torch.mm, a_e, b16[e].t(), out=out_e)
            for e, (a_e, out_e) in enumerate(zip(a16_parts, out_parts))]
    rowwise = [functools.partial(torch._scaled_mm, a_e, b[e].t(), s_e, b_col[e][None], out_dtype=torch.bfloat16,
                                 use_fast_accum=True, out=out_e)
               for e, (a_e, s_e, out_e) in enumerate(zip(a_parts, row_parts, out_parts))]
    tensorwise = [functools.partial(torch._scaled_mm, a_e, b[e].t(), one, one, out_dtype=torch.bfloat16,
                                    use_fast_accum=True, out=out_e)
                  for e, (a_e, out_e) in enumerate(zip(a_parts, out_parts))]

    def dense() -> None:
        torch._scaled_mm(a, big_b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True, out=out)

    forms = {**_loop_forms(bf16, rowwise, tensorwise), "fp8 dense": dense}
    if _GROUPED is not None:
        forms.update(_grouped_forms(lambda: _GROUPED(a, b.transpose(1, 2), a_row, b_col, offs=ends,
                                                     out_dtype=torch.bfloat16, use_fast_accum=True), autotune))
    return forms


def _grouped_forms(call: Callable[[], object], autotune: bool) -> dict[str, Callable[[], object]]:
    """PyTorch's grouped kernel as it is and, with ``--autotune``, compiled by Inductor with ``max-autotune`` (its
    Triton grouped-GEMM template against the ATen kernel; the autotuner prints every candidate's time)."""
    forms = {"fp8 grouped": call}
    if autotune:
        compiled = torch.compile(call, mode="max-autotune-no-cudagraphs", dynamic=False)
        compiled()
        forms["fp8 grouped tuned"] = compiled
    return forms


def _shapes(hidden: int, ffn: int, rows: list[int]) -> dict[str, tuple[list[int], int, int]]:
    """Each GEMM of a SwiGLU expert layer as ``(per-expert rows, k, n)``; the weight gradients contract over an
    expert's tokens, so they are ``experts`` GEMMs of ``out x in`` over ``rows_e``, written here as rows ``out``."""
    fc1_out = 2 * ffn
    return {
        "fc1 forward": (rows, hidden, fc1_out),
        "fc2 forward": (rows, ffn, hidden),
        "fc1 dgrad": (rows, fc1_out, hidden),
        "fc2 dgrad": (rows, hidden, ffn),
    }


def _wgrad_forms(rows: list[int], p: int, q: int, autotune: bool = False) -> dict[str, Callable[[], object]]:
    """``dW_e [p, q] = dy_e.T @ x_e`` over each expert's ``rows_e`` tokens (operands stored transposed,
    row-major ``[p, M]`` / ``[q, M]``) in bf16, FP8 row-wise and FP8 tensorwise."""
    experts, total = len(rows), sum(rows)
    a_t, b_t = _codes(p, total), _codes(q, total)
    a16, b16 = a_t.to(torch.bfloat16), b_t.to(torch.bfloat16)
    out = torch.empty(experts, p, q, device="cuda", dtype=torch.bfloat16)
    a_parts, b_parts, a16_parts, b16_parts = a_t.split(rows, 1), b_t.t().split(rows), a16.split(rows, 1), b16.t().split(rows)
    a_s, b_s, one = _scale(p, 1), _scale(1, q), torch.ones((), device="cuda")

    bf16 = [functools.partial(torch.mm, a_e, b_e, out=out_e)
            for a_e, b_e, out_e in zip(a16_parts, b16_parts, out.unbind(0))]
    rowwise = [functools.partial(torch._scaled_mm, a_e, b_e, a_s, b_s, out_dtype=torch.bfloat16, use_fast_accum=True,
                                 out=out_e) for a_e, b_e, out_e in zip(a_parts, b_parts, out.unbind(0))]
    tensorwise = [functools.partial(torch._scaled_mm, a_e, b_e, one, one, out_dtype=torch.bfloat16,
                                    use_fast_accum=True, out=out_e)
                  for a_e, b_e, out_e in zip(a_parts, b_parts, out.unbind(0))]
    forms = _loop_forms(bf16, rowwise, tensorwise)
    if _GROUPED is not None:
        ends = torch.tensor(rows, device="cuda").cumsum(0).to(torch.int32)
        a_group, b_group = _scale(experts * p), _scale(experts * q)
        forms.update(_grouped_forms(lambda: _GROUPED(a_t, b_t.t(), a_group, b_group, offs=ends,
                                                     out_dtype=torch.bfloat16, use_fast_accum=True), autotune))
    return forms


def _on_streams(calls: list[Callable[[], object]], streams: int) -> Callable[[], None]:
    """Run ``calls`` in order, spread round-robin over the current stream and ``streams - 1`` side streams (each
    forked from and joined back into the current one), so one GEMM's last wave overlaps the next one's first."""
    side = [torch.cuda.Stream() for _ in range(streams - 1)]

    def run() -> None:
        current = torch.cuda.current_stream()
        lanes = [current, *side]
        for stream in side:
            stream.wait_stream(current)
        for i, call in enumerate(calls):
            with torch.cuda.stream(lanes[i % streams]):
                call()
        for stream in side:
            current.wait_stream(stream)

    return run


def _loop_forms(bf16: list, rowwise: list, tensorwise: list) -> dict[str, Callable[[], object]]:
    """The per-expert loops, on one stream and spread over two and four."""
    forms = {"bf16": _on_streams(bf16, 1), "fp8 rowwise": _on_streams(rowwise, 1)}
    forms.update({f"fp8 rowwise {n} st": _on_streams(rowwise, n) for n in (2, 4)})
    forms["fp8 tensorwise"] = _on_streams(tensorwise, 1)
    forms["fp8 tensorwise 2 st"] = _on_streams(tensorwise, 2)
    return forms


def _kernel_names(fn: Callable[[], object]) -> str:
    """The CUDA kernels one call of ``fn`` runs (which library serves the GEMM)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}
    return "; ".join(sorted(name[:90] for name in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--rows", type=int, nargs="+", default=[1104, 880, 1200, 960, 1008, 1056, 912, 1072])
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--kernel-names", action="store_true", help="print the kernels each form runs")
    parser.add_argument("--autotune", action="store_true", help="also the grouped GEMM compiled with max-autotune")
    parser.add_argument("--only", nargs="*", default=None, help="GEMMs to time (e.g. 'fc1 forward'); default all")
    args = parser.parse_args()
    torch.manual_seed(0)
    total = sum(args.rows)
    builders = {name: functools.partial(_gemm_forms, *shape, args.autotune)
                for name, shape in _shapes(args.hidden, args.ffn, args.rows).items()}
    builders["fc1 wgrad"] = functools.partial(_wgrad_forms, args.rows, 2 * args.ffn, args.hidden, args.autotune)
    builders["fc2 wgrad"] = functools.partial(_wgrad_forms, args.rows, args.hidden, args.ffn, args.autotune)
    cases = {name: build() for name, build in builders.items() if args.only is None or name in args.only}
    layer: dict[str, float] = {}
    for name, forms in cases.items():
        flops = 2 * total * args.hidden * (2 * args.ffn if "fc1" in name else args.ffn)
        for form, fn in forms.items():
            graph = capture_graph(fn, args.replays)
            ms = time_ms(graph.replay, iters=10, warmup=2) / args.replays
            layer[form] = layer.get(form, 0.0) + ms
            print(f"{name:12s} {form:15s} {ms:7.3f} ms {flops / ms / 1e9:7.0f} TFLOP/s", flush=True)
            if args.kernel_names:
                print(f"    kernels: {_kernel_names(fn)}")
    print("per layer (the forms timed for all six GEMMs):",
          ", ".join(f"{form} {ms:.2f} ms" for form, ms in layer.items() if all(form in f for f in cases.values())))


if __name__ == "__main__":
    main()
