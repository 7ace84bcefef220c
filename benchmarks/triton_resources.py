"""What a Triton kernel costs a Hopper GPU's SM, found on a machine without a GPU: registers, spills, shared memory.

A launch is compiled ahead of time for ``GPUTarget("cuda", 90, 32)`` (sm_90) with the kernel's own argument
specialisation (the same binder Triton runs at a launch: integer arguments equal to 1 become constants, multiples
of 16 and pointers get the divisibility hint), then assembled by the ``ptxas`` that ships with Triton with ``-v``.
:func:`record_launches` collects the launches a launcher makes (its ``torch.library.wrap_triton`` replaced by a
recorder), so the launcher runs on ``meta`` tensors at any shape and nothing executes.

Occupancy here is the number of warps an SM can hold by registers and shared memory (65,536 registers, 227 KB of
shared memory, 64 warps, allocation granularities ignored): a bound on latency hiding, not a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

HOPPER = ("cuda", 90, 32)
_SM_REGISTERS = 65536
_SM_SHARED = 227 * 1024
_SM_WARPS = 64


@dataclasses.dataclass
class KernelResources:
    """One compiled launch: registers per thread, spilled bytes, shared memory, warps, the grid, and how many Hopper
    tensor-core instructions (``wgmma.mma_async``) its PTX holds."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    warps: int
    grid: tuple[int, ...]
    wgmma: int = 0

    @property
    def resident_warps(self) -> int:
        """Warps one SM can hold, by registers and by shared memory (whole programs)."""
        by_regs = _SM_REGISTERS // max(1, self.registers * 32 * self.warps)
        by_smem = _SM_SHARED // self.shared if self.shared else _SM_WARPS
        return min(by_regs, by_smem, _SM_WARPS // self.warps) * self.warps

    def row(self) -> str:
        """A Markdown table row (see :data:`HEADER`)."""
        programs = 1
        for g in self.grid:
            programs *= g
        return (f"| {self.name} | {self.registers} | {self.spill_stores} / {self.spill_loads} | "
                f"{self.shared // 1024} KB | {self.warps} | {self.resident_warps} | {programs} |")


HEADER = ("| kernel | registers / thread | spill stores / loads (bytes) | shared memory | warps | warps per SM |"
          " programs |\n|---|---|---|---|---|---|---|")


def _ptxas() -> str:
    import triton

    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # The newest assembler that ships with Triton reads the newest PTX version Triton writes.
    for name in ("ptxas-blackwell", "ptxas"):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise FileNotFoundError(f"no ptxas under {folder}")


def compile_launch(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> KernelResources:
    """Compile one launch (``kernel[grid](*args, **kwargs)``) for sm_90 and read its resources from ``ptxas -v``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*HOPPER)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        done = subprocess.run([_ptxas(), "--gpu-name", "sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    report = done.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return KernelResources(kernel.__name__, registers, int(spills.group(1)), int(spills.group(2)),
                           int(compiled.metadata.shared), int(options.num_warps), tuple(grid),
                           compiled.asm["ptx"].count("wgmma.mma_async"))


class _Recorder:
    """Stands in for ``torch.library.wrap_triton(kernel)``: ``[grid](...)`` records the launch."""

    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((self.kernel, tuple(grid), args, kwargs))
        return launch


@contextlib.contextmanager
def record_launches() -> Iterator[list]:
    """Within the block, ``torch.library.wrap_triton`` records launches instead of running them (launchers that
    look it up at each call); yields the list of ``(kernel, grid, args, kwargs)``."""
    import torch

    launches: list = []
    real = torch.library.wrap_triton
    torch.library.wrap_triton = lambda kernel: _Recorder(kernel, launches)
    try:
        yield launches
    finally:
        torch.library.wrap_triton = real
