"""The SSD scan's Triton kernels at a model's shapes, compiled for sm_90 without a GPU: registers, spills, memory.

The launcher (:mod:`megatron_core.ssm.ssd_scan_triton`) runs forward and backward on ``meta`` tensors with its
launches recorded (:mod:`triton_resources`), so every kernel is compiled with exactly the block shapes, warps,
stages and argument specialisation a GPU run would use, for the default :data:`SCAN_BLOCKS` and for each change
given. Spilled registers and low residency point at the kernels to restructure before a GPU measures them.

    PYTHONPATH=src:benchmarks python3 benchmarks/ssd_scan_resources.py                      # defaults
    PYTHONPATH=src:benchmarks python3 benchmarks/ssd_scan_resources.py '{"dx_warps": 8}' '{"chunk": 128}'
"""

from __future__ import annotations

import argparse
import json

import torch
from triton_resources import HEADER, KernelResources, compile_launch, record_launches


def scan_resources(b: int, length: int, h: int, p: int, g: int, n: int, dtype: torch.dtype = torch.bfloat16
                   ) -> list[KernelResources]:
    """Compile every kernel of one forward and one backward of the scan at these shapes (current SCAN_BLOCKS)."""
    from megatron_core.ssm import ssd_scan_triton

    meta = torch.device("meta")
    x = torch.empty(b, length, h, p, device=meta, dtype=dtype)
    dt = torch.empty(b, length, h, device=meta)
    A = torch.empty(h, device=meta)
    proj = torch.empty(b, length, 2 * g * n, device=meta, dtype=dtype)  # B and C as slices, as the mixer has them
    B, C = (t.view(b, length, g, n) for t in proj.split([g * n, g * n], -1))
    D = torch.empty(h, p, device=meta)
    chunk, cb_scratch = ssd_scan_triton.SCAN_BLOCKS["chunk"], bool(ssd_scan_triton.SCAN_BLOCKS["cb_scratch"])
    with record_launches() as launches:
        y, states, cb = ssd_scan_triton._forward(x, dt, A, B, C, D, chunk, cb_scratch)
        ssd_scan_triton._backward(torch.empty_like(y), x, dt, A, B, C, D, states, cb, chunk, cb_scratch)
    return [compile_launch(*launch) for launch in launches]


def main() -> None:
    """Print the table for the default blocks and for each change given as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("changes", nargs="*", help="JSON dicts of SCAN_BLOCKS changes")
    parser.add_argument("--shape", default="2,4096,64,64,8,128", help="b,l,h,p,g,n (the Nemotron-H-shaped model)")
    args = parser.parse_args()
    from megatron_core.ssm import ssd_scan_triton

    shape = [int(v) for v in args.shape.split(",")]
    default = dict(ssd_scan_triton.SCAN_BLOCKS)
    for change in [{}] + [json.loads(c) for c in args.changes]:
        ssd_scan_triton.SCAN_BLOCKS.update(change)
        try:
            print(f"\nSCAN_BLOCKS change {change or 'none (defaults)'} at b,l,h,p,g,n = {shape}, bf16\n{HEADER}")
            for res in scan_resources(*shape):
                print(res.row())
        finally:
            ssd_scan_triton.SCAN_BLOCKS.clear()
            ssd_scan_triton.SCAN_BLOCKS.update(default)


if __name__ == "__main__":
    main()
