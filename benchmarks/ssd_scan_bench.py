"""The SSD scan kernels alone (``hybrid_fwd_bwd.py --scan-bench``): ours against the bound, mamba_ssm's, variants.

Ours: :func:`megatron_core.ssm.ssd_scan_triton.ssd_chunk_scan_triton`, forward and forward+backward, median of
CUDA-event timings, against the bound max(FLOPs / matmul rate, bytes / copy bandwidth), both ceilings measured in
the same run (an 8192^3 bf16 matmul, a 4 GiB device copy), with the time of each of its kernels (profiler).
FLOPs at the kernels' chunk of 64: forward ``2 g Q n + 2 h Q p + 4 h p n`` per token, backward twice that; bytes:
every input read once and every output written once (forward: x, B, C in bf16, dt in fp32, y; backward: those,
dy, and dx, dB, dC in bf16, ddt in fp32). The fp32 states kept per chunk are this design's extra traffic.

The reference kernel, ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``, is timed at the same
shapes with chunk_size 64 and 128 when it can be imported (an optional oracle of this benchmark only; its source
may be put on PYTHONPATH). ``variants=True`` also times each entry of :data:`SCAN_VARIANTS` (changes to
``SCAN_BLOCKS``), checks its outputs against the default blocks', and prints the best blocks per kernel. The
variants run in a worker process that is started again after a variant kills it or leaves a CUDA error (an illegal
address is sticky: every later launch in that process fails), so one bad block shape costs one row, not the table.

Forward + backward is timed as ``torch.autograd.grad`` (no accumulation into ``.grad``); "outside" is that time less
our kernels' (the small reductions and allocations around them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator

import torch

# Changes to SCAN_BLOCKS, one kernel's settings at a time (the kernels are independent, so the best of each
# combine), the one-program-per-group backward, then C B^T once per group and the chunk length (which change
# several kernels).
SCAN_VARIANTS: list[dict[str, int]] = [
    {"state_p": 16}, {"state_p": 64}, {"state_n": 32}, {"state_n": 128}, {"state_p": 16, "state_n": 32},
    {"state_p": 64, "state_n": 32}, {"state_warps": 8}, {"state_stages": 2}, {"state_stages": 4},
    {"fwd_p": 32}, {"fwd_warps": 8}, {"fwd_p": 32, "fwd_warps": 2}, {"fwd_k": 32}, {"fwd_k": 128},
    {"fwd_stages": 1}, {"fwd_stages": 3}, {"fwd_k": 32, "fwd_stages": 4},
    {"dx_p": 32}, {"dx_warps": 4}, {"dx_p": 32, "dx_warps": 4}, {"dx_k": 32}, {"dx_k": 128}, {"dx_stages": 1},
    {"dx_stages": 3}, {"dx_k": 32, "dx_stages": 4},
    {"dbc_n": 32}, {"dbc_n": 128}, {"dbc_p": 32}, {"dbc_warps": 4}, {"dbc_n": 32, "dbc_warps": 4},
    {"dbc_stages": 1}, {"dbc_stages": 3}, {"dbc_p": 32, "dbc_stages": 3},
    {"cb_scratch": 1}, {"cb_scratch": 1, "fwd_warps": 8},
    {"bwd_fused": 1}, {"bwd_fused": 1, "fused_warps": 4}, {"bwd_fused": 1, "fused_warps": 16},
    {"bwd_fused": 1, "fused_p": 32}, {"bwd_fused": 1, "fused_p": 32, "fused_warps": 4},
    {"bwd_fused": 1, "fused_stages": 1}, {"bwd_fused": 1, "fused_stages": 3},
    {"chunk": 128}, {"chunk": 128, "fwd_warps": 8, "dx_p": 32}, {"chunk": 128, "cb_scratch": 1}, {"chunk": 32},
    {"states_lowp": 1}, {"states_lowp": 1, "bwd_fused": 1}, {"states_lowp": 1, "chunk": 128},
    {"states_lowp": 1, "bwd_fused": 1, "chunk": 128},
    # Chunk 128 with bf16 states and the blocks that spill least there (benchmarks/ssd_scan_resources.py).
    {"chunk": 128, "states_lowp": 1, "fwd_warps": 8, "dx_warps": 8, "dx_p": 32, "dbc_n": 64},
    {"chunk": 128, "states_lowp": 1, "fwd_warps": 8, "fwd_k": 32, "dx_warps": 8, "dx_k": 32, "dx_p": 32, "dbc_n": 32,
     "dbc_p": 32},
    {"states_lowp": 1, "dx_warps": 8, "dbc_n": 64}, {"states_lowp": 1, "fwd_warps": 8, "dx_warps": 8, "dbc_n": 64},
    # Block shapes without spills at the defaults' chunk (ssd_scan_resources.py) that no GPU has timed yet.
    {"dx_warps": 8}, {"dbc_n": 64}, {"dbc_n": 64, "dbc_warps": 4},
]
# Which SCAN_BLOCKS keys each kernel reads (the two walks share theirs).
KERNEL_KEYS = {"ssd_state_kernel": "state", "ssd_state_grad_kernel": "state", "ssd_chunk_forward_kernel": "fwd",
               "ssd_chunk_cb_kernel": "cb", "ssd_chunk_dx_kernel": "dx", "ssd_chunk_dbc_kernel": "dbc",
               "ssd_chunk_bwd_group_kernel": "fused"}


def scan_flops(g: int, n: int, h: int, p: int, chunk: int) -> float:
    """Forward FLOPs of the chunked scan per token: ``2 g Q n + 2 h Q p + 4 h p n``."""
    return 2 * g * chunk * n + 2 * h * chunk * p + 4 * h * p * n


def event_median(fn: Callable[[], object], reps: int = 20) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after 3 warm-ups, CUDA events around each."""
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[reps // 2] / 1e3


def measure_ceilings() -> tuple[float, float]:
    """(bf16 matmul FLOP/s, copy bytes/s) measured here: an 8192^3 matmul, a 4 GiB device-to-device copy."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul = 2 * 8192 ** 3 / event_median(lambda: a @ a, reps=10)
    src = torch.randn(2 ** 30, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / event_median(lambda: dst.copy_(src), reps=10)
    return matmul, copy


def kernel_us(fn: Callable[[], object], steps: int = 3) -> dict[str, float]:
    """Microseconds per call of ``fn`` of each of our scan kernels, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out = dict.fromkeys(KERNEL_KEYS, 0.0)
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        for name in KERNEL_KEYS:
            if name in evt.key and total:
                out[name] += total / steps
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()


def _fwd_bwd(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], dy: torch.Tensor) -> None:
    torch.autograd.grad(fn(*leaves), leaves, dy)


def _outputs(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    """``y`` and the gradients of every leaf, from fresh copies of the leaves."""
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*fresh)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in fresh]


def _import_reference() -> Callable[..., torch.Tensor]:
    """``mamba_chunk_scan_combined``; where the package's ``__init__`` fails (its compiled extensions missing, as
    with plain source on PYTHONPATH), the Triton submodule is imported under a bare package module instead."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        import importlib.util
        import sys
        import types

        for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            raise
        bare = types.ModuleType("mamba_ssm")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = bare
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def _time_reference(leaves: list[torch.Tensor], dy: torch.Tensor, ours: list[torch.Tensor]) -> None:
    """Time ``mamba_chunk_scan_combined`` (if importable) at chunk 64 and 128; print its rows of the table."""
    try:
        mamba_chunk_scan_combined = _import_reference()
    except Exception as exc:  # noqa: BLE001 - any import failure only skips the optional oracle
        print(f"| mamba_ssm mamba_chunk_scan_combined | not importable ({type(exc).__name__}: {exc}) | | |")
        return
    for chunk in (64, 128):
        def run(x, dt, A, B, C, D, chunk=chunk):
            return mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D)

        try:
            fwd = event_median(lambda: run(*leaves))
            both = event_median(lambda: run(*leaves).backward(dy))
            err = max(_rel(got, want) for got, want in zip(_outputs(run, leaves, dy), ours))
            print(f"| mamba_ssm mamba_chunk_scan_combined, chunk {chunk} | {fwd * 1e6:.0f} | {both * 1e6:.0f} | "
                  f"{err:.1e} |")
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"| mamba_ssm mamba_chunk_scan_combined, chunk {chunk} | failed: {type(exc).__name__}: {exc} | | |")


def _scan_inputs(b: int, length: int, h: int, p: int, g: int, n: int, device: str = "cuda"
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The scan's leaves (bf16 x/B/C, fp32 dt/A/D, requiring grad) and ``dy``, from a fixed seed."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    leaves = [rand(b, length, h, p, dtype=torch.bfloat16),
              torch.rand(b, length, h, device=device, generator=gen) * 0.1 + 0.001,
              -torch.rand(h, device=device, generator=gen) * 8 - 1,
              rand(b, length, g, n, dtype=torch.bfloat16), rand(b, length, g, n, dtype=torch.bfloat16),
              torch.ones(h, device=device)]
    return [t.requires_grad_() for t in leaves], rand(b, length, h, p, dtype=torch.bfloat16)


def _variant_worker(shape: list[int], start: int) -> None:
    """Time :data:`SCAN_VARIANTS` from index ``start`` on, one ``ROW <json>`` line each; exit 3 after a CUDA error."""
    from megatron_core.ssm import ssd_scan_triton
    from megatron_core.ssm.ssd_scan_triton import ssd_chunk_scan_triton as scan

    leaves, dy = _scan_inputs(*shape)
    ours = _outputs(scan, leaves, dy)
    default = dict(ssd_scan_triton.SCAN_BLOCKS)
    for index in range(start, len(SCAN_VARIANTS)):
        change = SCAN_VARIANTS[index]
        ssd_scan_triton.SCAN_BLOCKS.update(change)
        row: dict = {"index": index}
        try:
            row["err"] = max(_rel(got, want) for got, want in zip(_outputs(scan, leaves, dy), ours))
            row["fwd"] = event_median(lambda: scan(*leaves))
            row["both"] = event_median(lambda: _fwd_bwd(scan, leaves, dy))
            row["kernels"] = kernel_us(lambda: _fwd_bwd(scan, leaves, dy))
        except Exception as exc:  # noqa: BLE001 - a block shape that does not fit (shared memory) is reported
            row["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            ssd_scan_triton.SCAN_BLOCKS.clear()
            ssd_scan_triton.SCAN_BLOCKS.update(default)
        print("ROW " + json.dumps(row), flush=True)
        if "failed" in row:
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - the error is sticky: a fresh process takes the next variant
                sys.exit(3)


def _variant_rows(shape: list[int]) -> Iterator[dict]:
    """The worker's rows for every variant, starting a fresh worker after one dies or leaves a CUDA error."""
    index = 0
    while index < len(SCAN_VARIANTS):
        worker = subprocess.Popen([sys.executable, __file__, "--variant-worker", json.dumps(shape), str(index)],
                                  stdout=subprocess.PIPE, text=True)
        for line in worker.stdout:
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                index = row["index"] + 1
                yield row
            else:
                print(line, end="")
        if worker.wait() not in (0, 3) and index < len(SCAN_VARIANTS):
            yield {"index": index, "failed": f"worker exited with status {worker.returncode}"}
            index += 1


def _time_variants(shape: list[int], default_kernels: dict[str, float]) -> None:
    """Time every entry of :data:`SCAN_VARIANTS` (in worker processes); print a table and the best settings per
    kernel."""
    best = {name: (us or float("inf"), {}) for name, us in default_kernels.items()}
    print("\n| SCAN_BLOCKS change | forward us | fwd+bwd us | " + " | ".join(KERNEL_KEYS)
          + " | outside us | max rel err vs default |")
    print("|---" * (5 + len(KERNEL_KEYS)) + "|")
    for row in _variant_rows(shape):
        change = SCAN_VARIANTS[row["index"]]
        if "failed" in row:
            print(f"| {change} | failed: {row['failed']} | | " + "| " * (len(KERNEL_KEYS) + 1) + "|")
            continue
        per_kernel, err = row["kernels"], row["err"]
        outside = row["both"] * 1e6 - sum(per_kernel.values())
        print(f"| {change} | {row['fwd'] * 1e6:.0f} | {row['both'] * 1e6:.0f} | "
              + " | ".join(f"{us:.0f}" for us in per_kernel.values()) + f" | {outside:.0f} | {err:.1e} |")
        if "chunk" not in change and err < 3e-2:
            for name, us in per_kernel.items():
                keys = [key for key in change if key not in ("bwd_fused", "states_lowp")]  # switches, not blocks
                if us and all(key.startswith(KERNEL_KEYS[name]) for key in keys) and us < best[name][0]:
                    best[name] = (us, change)
    print("\nbest per kernel (us, change to SCAN_BLOCKS): "
          + "; ".join(f"{name} {us:.0f} {change}" for name, (us, change) in best.items()))


def run_scan_bench(b: int, length: int, h: int, p: int, g: int, n: int, variants: bool = False,
                   device: str = "cuda") -> None:
    """Time the scans at these shapes (bf16 x/B/C, fp32 dt/A/D) and print the tables (see the module docstring)."""
    from megatron_core.ssm.ssd_scan_triton import SCAN_BLOCKS, ssd_chunk_scan_triton

    leaves, dy = _scan_inputs(b, length, h, p, g, n, device)
    ours = _outputs(ssd_chunk_scan_triton, leaves, dy)
    fwd = event_median(lambda: ssd_chunk_scan_triton(*leaves))
    both = event_median(lambda: _fwd_bwd(ssd_chunk_scan_triton, leaves, dy))
    per_kernel = kernel_us(lambda: _fwd_bwd(ssd_chunk_scan_triton, leaves, dy))

    matmul, copy = measure_ceilings()
    tokens, chunk = b * length, 64
    flops_fwd = tokens * scan_flops(g, n, h, p, chunk)
    in_bytes = tokens * (2 * h * p + 2 * 2 * g * n + 4 * h)
    bytes_fwd = in_bytes + tokens * 2 * h * p
    bytes_bwd = in_bytes + tokens * 2 * h * p + in_bytes  # inputs and dy read; dx, ddt, dB, dC written
    bound_fwd = max(flops_fwd / matmul, bytes_fwd / copy)
    bound_both = bound_fwd + max(2 * flops_fwd / matmul, bytes_bwd / copy)
    states = b * -(-length // SCAN_BLOCKS["chunk"]) * h * p * n * (2 if SCAN_BLOCKS["states_lowp"] else 4)
    print(f"ceilings measured here: bf16 matmul {matmul / 1e12:.0f} TFLOP/s, copy {copy / 1e12:.2f} TB/s")
    print(f"scan forward: FLOPs {flops_fwd / 1e9:.1f} G ({flops_fwd / matmul * 1e6:.0f} us), bytes "
          f"{bytes_fwd / 1e6:.0f} MB ({bytes_fwd / copy * 1e6:.0f} us); kept states {states / 1e6:.0f} MB (extra)")
    print("our kernels (us per forward+backward): " + ", ".join(f"{k} {v:.0f}" for k, v in per_kernel.items())
          + f"; outside them {both * 1e6 - sum(per_kernel.values()):.0f}")
    print(f"our SCAN_BLOCKS: {SCAN_BLOCKS}")
    print(f"\n| scan (b {b}, l {length}, h {h}, p {p}, g {g}, n {n}, bf16) | forward us | fwd+bwd us | "
          "max rel err vs ours (y and 6 grads) |\n|---|---|---|---|")
    print(f"| bound | {bound_fwd * 1e6:.0f} | {bound_both * 1e6:.0f} | |")
    print(f"| megatron_core ssd_chunk_scan_triton | {fwd * 1e6:.0f} | {both * 1e6:.0f} | 0 |")
    try:
        _time_reference(leaves, dy, ours)
    except Exception:  # noqa: BLE001 - the oracle never stops the benchmark
        traceback.print_exc()
    print(f"RESULT scan kernel: forward {fwd * 1e6:.0f} us vs bound {bound_fwd * 1e6:.0f} us "
          f"({fwd / bound_fwd:.2f}x); forward+backward {both * 1e6:.0f} us vs bound {bound_both * 1e6:.0f} us "
          f"({both / bound_both:.2f}x)")
    if variants:
        _time_variants([b, length, h, p, g, n], per_kernel)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--variant-worker":
        _variant_worker(json.loads(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit("run through hybrid_fwd_bwd.py --scan-bench (this entry point is the variants' worker)")
