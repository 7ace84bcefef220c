"""The FP8 weight-gradient GEMM with accumulation into ``main_grad``: Triton's kernel against ``_scaled_mm`` + add.

For the weight shapes of a layer of ``--config`` (QKV, attention projection, FC1, FC2; ``--tokens`` the reduction
dimension), times on one GPU in one process:
- ``scaled_mm + add``: ``torch._scaled_mm`` (full-precision accumulation) to a bf16 tensor, then ``main_grad.add_``
  (what :func:`megatron_core.fp8.fp8_param_ops.fp8_wgrad_into` did until 2026-12-04);
- ``scaled_mm alone``: the GEMM without the add (the floor of that path);
- ``triton accumulate``: :func:`megatron_core.fp8.wgrad_gemm.fp8_gemm_accumulate` (tensor-memory-accelerator loads,
  tiles chosen per shape by timing), the add in the GEMM's epilogue;
and the largest difference of each result from the fp32 product of the same float8 operands (relative to its
largest entry). TFLOP/s count ``2 M N K``.

    PYTHONPATH=src python3 benchmarks/fp8_wgrad_gemm.py [--config 3B-class] [--tokens 4096]
"""

from __future__ import annotations

import argparse

import torch

from megatron_core.fp8.wgrad_gemm import accumulate_kernel_serves, fp8_gemm_accumulate

SHAPES = {  # (hidden, heads, query groups, ffn): per layer (out, in) of QKV, projection, FC1 (gated), FC2
    "3B-class": (3072, 24, 8, 8192),
    "reference (tinyllama-1.1b)": (2048, 32, 4, 5632),
}


def weight_shapes(hidden: int, heads: int, groups: int, ffn: int) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of a Llama-like layer's four weights."""
    head = hidden // heads
    return {"qkv": ((heads + 2 * groups) * head, hidden), "proj": (hidden, hidden), "fc1": (2 * ffn, hidden),
            "fc2": (hidden, ffn)}


def time_ms(fn, iters: int = 30) -> float:
    """Mean milliseconds of ``fn()`` over ``iters`` calls after warm-up, between CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(out: int, inp: int, tokens: int, gen: torch.Generator) -> tuple[dict[str, float], float, float]:
    """Milliseconds of the three paths for a weight ``[out, inp]`` and ``tokens``, and the largest error of the
    ``_scaled_mm`` + add and of the Triton result against fp32 (relative to the largest entry)."""
    dev = gen.device
    dy = torch.randn(out, tokens, device=dev, generator=gen)
    x = torch.randn(inp, tokens, device=dev, generator=gen)
    a_scale, b_scale = torch.tensor(2.0, device=dev), torch.tensor(4.0, device=dev)
    a = (dy * a_scale).to(torch.float8_e5m2)  # the output gradient in e5m2 (fp8='hybrid'), the input in e4m3
    b = (x * b_scale).to(torch.float8_e4m3fn)
    main_grad = torch.randn(out, inp, device=dev, generator=gen).to(torch.bfloat16)
    want = main_grad.float() + (a.float() / a_scale) @ (b.float() / b_scale).t()
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16)

    c1 = main_grad.clone()
    c1.add_(mm())
    c2 = main_grad.clone()
    assert accumulate_kernel_serves(c2, a, b)
    fp8_gemm_accumulate(c2, a, a_scale, b, b_scale)
    scale = want.abs().max()
    err_add = ((c1.float() - want).abs().max() / scale).item()
    err_triton = ((c2.float() - want).abs().max() / scale).item()
    c = main_grad.clone()
    times = {"scaled_mm + add": time_ms(lambda: c.add_(mm())), "scaled_mm alone": time_ms(mm),
             "triton accumulate": time_ms(lambda: fp8_gemm_accumulate(c, a, a_scale, b, b_scale))}
    return times, err_add, err_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="3B-class", choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = dict.fromkeys(("scaled_mm + add", "scaled_mm alone", "triton accumulate"), 0.0)
    for name, (out, inp) in weight_shapes(*SHAPES[args.config]).items():
        times, err_add, err_triton = measure(out, inp, args.tokens, gen)
        flops = 2 * out * inp * args.tokens
        print(f"RESULT {name} [{out} x {inp}] K={args.tokens}: " + ", ".join(
            f"{k} {v * 1e3:.0f} us ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in times.items())
            + f"; max error / max |c|: scaled_mm+add {err_add:.1e}, triton {err_triton:.1e}", flush=True)
        for k, v in times.items():
            total[k] += v
    print("RESULT per layer: " + ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in total.items()), flush=True)


if __name__ == "__main__":
    main()
