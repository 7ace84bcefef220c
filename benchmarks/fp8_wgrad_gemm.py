"""The FP8 weight-gradient GEMM with accumulation into ``main_grad``: Triton's kernel against ``_scaled_mm`` + add.

For the weight shapes of a layer of ``--config`` (QKV, attention projection, FC1, FC2; ``--tokens`` the reduction
dimension), times on one GPU in one process:
- ``scaled_mm + add``: ``torch._scaled_mm`` (full-precision accumulation) to a bf16 tensor, then ``main_grad.add_``
  (what :func:`megatron_core.fp8.fp8_param_ops.fp8_wgrad_into` did until 2026-12-04);
- ``scaled_mm alone``: the GEMM without the add (the floor of that path);
- ``triton accumulate``: :func:`megatron_core.fp8.wgrad_gemm.fp8_gemm_accumulate`, the add in the GEMM's epilogue;
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


def tma_accumulate(bm: int = 128, bn: int = 256, bk: int = 128, warps: int = 8, stages: int = 3):
    """A variant of the accumulating kernel whose operand tiles come through Hopper's tensor memory accelerator
    (Triton's host-side ``TensorDescriptor``), launched directly: ``fn(c, a, a_scale, b, b_scale)``; ``None`` where
    this Triton lacks descriptors."""
    import triton
    import triton.language as tl

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None

    @triton.jit
    def kernel(a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, STAGES: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        blocks_m, blocks_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
            a = a_desc.load([pid_m * BM, k * BK])
            b = b_desc.load([pid_n * BN, k * BK])
            acc = tl.dot(a, b.T, acc)
        acc = acc * (1.0 / tl.load(a_scale_ptr)) * (1.0 / tl.load(b_scale_ptr))
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        offsets = rm.to(tl.int64)[:, None] * N + rn[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        old = tl.load(c_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + offsets, (old + acc).to(c_ptr.dtype.element_ty), mask=mask)

    def run(c, a, a_scale, b, b_scale):
        (m, k), n = a.shape, b.shape[0]
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
        grid = (-(-m // bm) * -(-n // bn),)
        kernel[grid](a_desc, b_desc, c, a_scale, b_scale, m, n, k, BM=bm, BN=bn, BK=bk, STAGES=stages, GROUP_M=8,
                     num_warps=warps)

    return run


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
    for tiles in ((128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3), (128, 256, 64, 8, 4)):
        try:
            fn = tma_accumulate(*tiles)
            if fn is None:
                break
            c3 = main_grad.clone()
            fn(c3, a, a_scale, b, b_scale)
            err = ((c3.float() - want).abs().max() / scale).item()
            times[f"tma {tiles} (err {err:.1e})"] = time_ms(lambda fn=fn: fn(c, a, a_scale, b, b_scale))
        except Exception as error:  # noqa: BLE001 -- an experimental variant: report and go on
            print(f"tma {tiles}: {type(error).__name__}: {str(error)[:200]}", flush=True)
    return times, err_add, err_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="3B-class", choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    total: dict[str, float] = {}
    for name, (out, inp) in weight_shapes(*SHAPES[args.config]).items():
        times, err_add, err_triton = measure(out, inp, args.tokens, gen)
        flops = 2 * out * inp * args.tokens
        print(f"RESULT {name} [{out} x {inp}] K={args.tokens}: " + ", ".join(
            f"{k} {v * 1e3:.0f} us ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in times.items())
            + f"; max error / max |c|: scaled_mm+add {err_add:.1e}, triton {err_triton:.1e}", flush=True)
        for k, v in times.items():
            key = k.split(" (err")[0]
            total[key] = total.get(key, 0.0) + v
    print("RESULT per layer: " + ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in total.items()), flush=True)


if __name__ == "__main__":
    main()
