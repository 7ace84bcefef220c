"""Where the experts' FP8 grouped GEMMs spend their time on Hopper, against bf16 (issue 44).

For one MoE layer's fc1 (``in -> 2 * ffn``) and fc2 (``ffn -> in``) at even routing, times each GEMM of the forward,
data gradient and weight gradient separately:

- bf16: ``torch._grouped_mm`` (what our bf16 experts run);
- FP8 grouped: ``torch._scaled_grouped_mm`` on codes made beforehand (the GEMM alone, no casts);
- FP8 per expert: one ``torch._scaled_mm`` (row-wise scales) per expert on the same codes;
- FP8 dense: one ``torch._scaled_mm`` over all rows (what an FP8 GEMM of these FLOPs can do at best here);
- the weight gradients as training runs them (the groups split the contraction): ``torch._scaled_grouped_mm`` on the
  transposed codes ``[out, rows]`` and ``[in, rows]`` against ``megatron_core::fp8_per_expert_wgrad_mm`` (one
  ``torch._scaled_mm`` per expert on column slices of the same codes, as ``set_fp8_expert_gemm("per_expert")`` runs);
- the row-wise cast of the GEMM's left operand (``megatron_core.fp8.cast_kernels.rowwise_cast``), one-pass and
  two-pass kernels (bytes moved: the bf16 read and the e4m3 write).

    PYTHONPATH=src:benchmarks python3 benchmarks/fp8_grouped_breakdown.py --hidden 4096 --ffn 14336 --experts 8 --rows 8192
"""

from __future__ import annotations

import argparse

import torch
from grouped_gemm_parts import time_ms  # the same CUDA-event timer

from megatron_core.fp8 import cast_kernels
from megatron_core.fp8.cast_kernels import rowwise_cast
from megatron_core.fp8.expert_gemm_mode import per_expert_wgrad_mm

E4M3 = torch.float8_e4m3fn


def gemm_row(name: str, rows: int, k: int, n: int, experts: int) -> None:
    """Time ``[rows, k] @ [k, n]`` split evenly over ``experts`` groups in each form."""
    dev = "cuda"
    a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    per = rows // experts
    offs = torch.arange(per, rows + 1, per, device=dev, dtype=torch.int32)
    a_codes, a_scale = rowwise_cast(a)
    w_codes, w_scale = rowwise_cast(w.view(-1, k))
    w_codes, w_scale = w_codes.view(experts, n, k), w_scale.view(experts, n)
    flops = 2.0 * rows * k * n

    def two_pass_cast() -> None:
        whole, cast_kernels.WHOLE_ROW_MAX = cast_kernels.WHOLE_ROW_MAX, 0
        try:
            rowwise_cast(a)
        finally:
            cast_kernels.WHOLE_ROW_MAX = whole
    results = {
        "bf16 grouped": time_ms(lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)),
        "fp8 grouped": time_ms(lambda: torch._scaled_grouped_mm(a_codes, w_codes.transpose(-2, -1), a_scale, w_scale,
                                                               offs=offs, out_dtype=torch.bfloat16,
                                                               use_fast_accum=True)),
        "fp8 per expert": time_ms(lambda: [torch._scaled_mm(a_codes[e * per:(e + 1) * per], w_codes[e].t(),
                                                          a_scale[e * per:(e + 1) * per, None], w_scale[e][None, :],
                                                          out_dtype=torch.bfloat16, use_fast_accum=True)
                                         for e in range(experts)]),
        "fp8 dense": time_ms(lambda: torch._scaled_mm(a_codes, w_codes[0].t(), a_scale[:, None], w_scale[0][None, :],
                                                    out_dtype=torch.bfloat16, use_fast_accum=True)),
        "bf16 dense": time_ms(lambda: a @ w[0].t()),
        "rowwise cast of a": time_ms(lambda: rowwise_cast(a)),
        "two-pass cast of a": time_ms(two_pass_cast),
    }
    cells = "  ".join(f"{key} {ms:6.3f} ms ({flops / ms / 1e9:5.0f} TF/s)" if "cast" not in key
                      else f"{key} {ms:6.3f} ms ({a.numel() * 3 / ms / 1e6:5.0f} GB/s)" for key, ms in results.items())
    print(f"{name:<10} [{rows}x{k}]@[{k}x{n}]: {cells}", flush=True)


def wgrad_row(name: str, rows: int, n_out: int, n_in: int, experts: int) -> None:
    """Time ``dW_e = dy_e.T @ x_e`` for ``experts`` even groups of ``rows`` (``dy [rows, n_out]``, ``x [rows, n_in]``)
    from the transposed codes, grouped and per expert, against bf16's ``torch._grouped_mm``."""
    dev = "cuda"
    dy = torch.randn(rows, n_out, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, n_in, device=dev, dtype=torch.bfloat16)
    per = rows // experts
    offs = torch.arange(per, rows + 1, per, device=dev, dtype=torch.int32)
    dyt_codes, dyt_scale = rowwise_cast(dy.t().contiguous())  # the codes' layout; one scale per row is enough here
    xt_codes, xt_scale = rowwise_cast(x.t().contiguous())
    dyt_scale, xt_scale = dyt_scale.repeat(experts), xt_scale.repeat(experts)  # [E * out], [E * in]
    flops = 2.0 * rows * n_out * n_in
    results = {
        "bf16 grouped": time_ms(lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
        "fp8 grouped": time_ms(lambda: torch._scaled_grouped_mm(dyt_codes, xt_codes.t(), dyt_scale, xt_scale,
                                                               offs=offs, out_dtype=torch.bfloat16,
                                                               use_fast_accum=True)),
        "fp8 per expert": time_ms(lambda: per_expert_wgrad_mm(dyt_codes, dyt_scale, xt_codes, xt_scale, offs,
                                                              torch.bfloat16)),
    }
    cells = "  ".join(f"{key} {ms:6.3f} ms ({flops / ms / 1e9:5.0f} TF/s)" for key, ms in results.items())
    print(f"{name:<10} {experts} x [{n_out}x{per}]@[{per}x{n_in}]: {cells}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=8192)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    h, f, m, e = args.hidden, args.ffn, args.rows, args.experts
    gemm_row("fc1 fwd", m, h, 2 * f, e)    # x @ W1.T
    gemm_row("fc1 dgrad", m, 2 * f, h, e)  # dy1 @ W1
    gemm_row("fc2 fwd", m, f, h, e)        # act @ W2.T
    gemm_row("fc2 dgrad", m, h, f, e)      # dy2 @ W2
    # weight gradients: [out, rows_e] @ [rows_e, in] per expert; the same FLOPs with k = rows per expert
    gemm_row("fc1 wgrad~", 2 * f, m // e, h, 1)
    gemm_row("fc2 wgrad~", h, m // e, f, 1)
    wgrad_row("fc1 wgrad", m, 2 * f, h, e)  # dW1_e = dy1_e.T @ x_e
    wgrad_row("fc2 wgrad", m, h, f, e)      # dW2_e = dy2_e.T @ act_e


if __name__ == "__main__":
    main()
