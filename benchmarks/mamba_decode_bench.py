"""One Mamba layer's decode step (one token per request): the fused Triton kernels against the PyTorch path.

Times ``ssm.mamba_decode_triton.mamba_decode_step`` (two kernels, states updated in place in the slot tensors)
and the PyTorch path ``mixer_inference`` takes without it (gather the rows' states, ``conv_step``, ``ssm_step``,
``index_copy_`` back), each replayed from a CUDA graph (as the engine's decode runs), against the floor: every
row's convolution and SSM states read and written once, plus its ``in_proj`` row read and ``y`` written, at the
measured copy bandwidth. Default shapes are the Nemotron-H-shaped model of ``inference_throughput.py --hybrid``
(64 heads of 64, 8 groups, state 128, d_conv 4, bf16 activations and states). The requests' slots are a random
permutation of a pool of ``--slots``.

    PYTHONPATH=src:benchmarks python benchmarks/mamba_decode_bench.py --batch 1 64
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouped_gemm_parts import capture_graph  # noqa: E402
from inference_throughput import copy_bandwidth  # noqa: E402

from megatron_core import device as mdevice  # noqa: E402
from megatron_core.ssm.mamba_decode_triton import mamba_decode_step, mamba_decode_supported  # noqa: E402
from megatron_core.ssm.mamba_inference import conv_step, ssm_step  # noqa: E402


def _pytorch_step(proj, conv_states, ssm_states, slots, weight, bias, dt_bias, A_log, D, groups):
    """The PyTorch decode path of ``mixer_inference`` (before the gate and norm)."""
    rows, (h, p, n), ch = slots.shape[0], ssm_states.shape[1:], conv_states.shape[1]
    d_inner = h * p
    out, conv = conv_step(conv_states[slots], proj[:, d_inner:d_inner + ch], weight, bias)
    x, B, C = torch.split(out, [d_inner, groups * n, groups * n], -1)
    dt = F.softplus(proj[:, d_inner + ch:].float() + dt_bias.float())
    y, ssm = ssm_step(ssm_states[slots], x.reshape(rows, h, p), dt, -torch.exp(A_log.float()),
                      B.reshape(rows, groups, n), C.reshape(rows, groups, n), D)
    conv_states.index_copy_(0, slots, conv.to(conv_states.dtype))
    ssm_states.index_copy_(0, slots, ssm.to(ssm_states.dtype))
    return y


def _fused_step(proj, conv_states, ssm_states, slots, weight, bias, dt_bias, A_log, D, groups):
    d_inner, ch = ssm_states.shape[1] * ssm_states.shape[2], conv_states.shape[1]
    return mamba_decode_step(proj[:, d_inner:], proj[:, d_inner + ch:], slots, conv_states, ssm_states, weight, bias,
                             dt_bias, A_log, D, groups)


def _time(fn, iters: int, graphs: bool) -> float:
    """Median seconds of ``fn`` (replayed from a CUDA graph when ``graphs``)."""
    fn()
    if graphs:
        fn = capture_graph(fn).replay
    mdevice.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        mdevice.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--d-conv", type=int, default=4)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--device", default="cuda" if mdevice.cuda_available() else "cpu")
    args = parser.parse_args()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    h, p, g, n, K = args.heads, args.head_dim, args.groups, args.state, args.d_conv
    d_inner, ch = h * p, h * p + 2 * g * n
    gen = torch.Generator().manual_seed(0)
    conv_states = (torch.randn(args.slots + 1, ch, K, generator=gen) * 0.1).to(dev, dtype)
    ssm_states = (torch.randn(args.slots + 1, h, p, n, generator=gen) * 0.1).to(dev, dtype)
    params = [t.to(dev) for t in (torch.randn(ch, 1, K, generator=gen) * 0.3, torch.randn(ch, generator=gen) * 0.1,
                                  torch.randn(h, generator=gen), torch.rand(h, generator=gen), torch.randn(h, generator=gen))]
    bandwidth = copy_bandwidth(dev)
    graphs = dev.type == "cuda"
    size = torch.empty((), dtype=dtype).element_size()
    print(f"device {dev}, torch {torch.__version__}, {args.dtype}; heads {h}x{p}, groups {g}, state {n}, d_conv {K}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; CUDA graphs: {graphs}")
    print("| batch | PyTorch path | fused kernels | floor | fused / floor | speed-up |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        proj = torch.randn(batch, d_inner + ch + h, generator=gen).to(dev, dtype)
        slots = torch.randperm(args.slots, generator=gen)[:batch].to(dev)
        step = (proj, conv_states, ssm_states, slots, *params, g)
        eager = _time(functools.partial(_pytorch_step, *step), args.iters, graphs)
        fused = _time(functools.partial(_fused_step, *step), args.iters, graphs) if mamba_decode_supported(
            proj, conv_states, ssm_states) else float("nan")
        moved = batch * (2 * (ch * K + h * p * n) * size + (d_inner + ch + h) * size + d_inner * size)
        floor = moved / bandwidth
        print(f"| {batch} | {eager * 1e6:.1f} us | {fused * 1e6:.1f} us | {floor * 1e6:.2f} us | "
              f"{fused / floor:.2f}x | {eager / fused:.2f}x |")


if __name__ == "__main__":
    main()
