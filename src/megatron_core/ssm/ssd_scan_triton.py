"""The chunked SSD scan (Mamba-2) as Triton kernels on CUDA, forward and backward.

Same function as :func:`megatron_core.ssm.ssd_scan.ssd_chunk_scan` (the CPU path and the reference). Forward
(:mod:`~megatron_core.ssm.ssd_scan_triton_forward`): a sequential walk over the chunks per ``(batch x head,
head_dim block, state_dim block)`` writes the state entering each chunk (``[b, chunks, h, p, n]``, kept for the
backward; fp32, or the inputs' dtype with ``states_lowp``), then a chunk-parallel kernel computes each chunk's
output. Inference prefill runs the same forward from a given initial state and gets the final state back
(``initial_state`` / ``return_final_state``, no backward). Backward
(:mod:`~megatron_core.ssm.ssd_scan_triton_backward`): a reverse walk writes the gradient of the state leaving each
chunk, then two chunk-parallel kernels: ``dx`` with the ``dt``/``A``/``D`` terms per head, and ``dB``/``dC`` per
group (its heads summed inside the program, no atomics), or both in one program per group (``bwd_fused``).

The kernels' chunk length is their own (``SCAN_BLOCKS["chunk"]``, :data:`KERNEL_CHUNK` = 64 rows unless changed);
the result is the same function as any other chunk length, rounded differently. Products take the inputs' dtype
(bf16 operands, fp32 accumulation); the decays, ``dt`` and the two walks' running states stay fp32, as
Megatron-Core keeps them; the per-chunk copies the chunk kernels read may be kept in the inputs' dtype
(``states_lowp``): those kernels use them only as product operands, which take that dtype anyway. fp32 inputs use
full-precision (not tf32) products. Block shapes are :data:`SCAN_BLOCKS` (read at each call). Triton is loaded
through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_op
from megatron_core.ssm.ssd_scan_triton_backward import backward_kernels
from megatron_core.ssm.ssd_scan_triton_forward import forward_kernels

__all__ = ["KERNEL_CHUNK", "SCAN_BLOCKS", "ssd_chunk_scan_triton", "ssd_scan_triton_supported"]

KERNEL_CHUNK = 64
_MAX_DIM = 256  # head_dim and state_dim up to this

# Block shapes and warps per kernel, for sm90 (H100/H200): the best of each kernel in benchmarks/RESULTS.md's
# variant table (H200, 2026-12-02); read at every call, so a benchmark may try others.
# ``*_p``: head_dim columns per program; ``*_n``: state_dim columns per program; ``*_k``: state_dim columns per
# step of a kernel's loop over state_dim; ``*_stages``: pipeline stages of those loops (fp32 inputs use one).
# ``chunk``: the kernels' chunk length (a power of two, 16 to 128). ``cb_scratch``: 1 to compute each chunk's
# ``C B^T`` once per group in the forward (fp32 scratch, kept for the backward) for the heads to read; 0 to
# recompute it per head. ``bwd_fused``: 1 for one backward program per (chunk, group) over the whole state_dim
# (``fused_*``) instead of the ``dx`` and ``dbc`` kernels. ``states_lowp``: 1 to keep the per-chunk states and
# state gradients in the inputs' dtype (bf16/fp16: half the bytes of fp32, the chunk kernels' largest read; their
# products round them to that dtype anyway, only dA's <state gradient, state> term sees the rounding); 0 for fp32.
# Training only: inference prefill (an initial or final state) keeps fp32 states. ``states_lowp`` 1 and ``state_p``
# 64: the five training kernels 1,324 -> 1,089 us and the walks 140 / 145 -> 125 / 126 us at Nemotron-H shapes (H200,
# benchmarks/RESULTS.md, 2026-12-05 session 41).
SCAN_BLOCKS: dict[str, int] = {
    "chunk": KERNEL_CHUNK, "cb_scratch": 0, "bwd_fused": 0, "states_lowp": 1,
    "state_p": 64, "state_n": 64, "state_warps": 4, "state_stages": 2,  # the two walks over the chunks
    "fwd_p": 64, "fwd_k": 64, "fwd_warps": 4, "fwd_stages": 1,  # chunk-parallel forward
    "dx_p": 64, "dx_k": 64, "dx_warps": 4, "dx_stages": 2,  # chunk-parallel dx / ddt / dA / dD
    "dbc_p": 64, "dbc_n": 128, "dbc_warps": 8, "dbc_stages": 2,  # chunk-parallel dB / dC per group
    "fused_p": 64, "fused_warps": 8, "fused_stages": 2,  # the two above in one program per group (bwd_fused)
}


def ssd_scan_triton_supported(x: torch.Tensor, initial_state: torch.Tensor | None = None,
                              return_final_state: bool = False) -> bool:
    """Whether :func:`ssd_chunk_scan_triton` serves these inputs.

    CUDA, bf16/fp16/fp32, ``head_dim`` and ``state_dim`` <= 256 (checked by the caller's shapes), Triton and
    ``torch.library.triton_op`` available. With an initial or a final state (inference prefill) the scan runs
    forward only.
    """
    op = _FORWARD_OP if initial_state is None and not return_final_state else _FORWARD_STATE_OP
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.shape[-1] <= _MAX_DIM
            and op is not None and have_triton())


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block(name: str, dim: int) -> int:
    """``SCAN_BLOCKS[name]`` capped at ``dim`` rounded up to a power of two, at least 16 (``tl.dot``'s least)."""
    return min(SCAN_BLOCKS[name], max(16, next_power_of_two(dim)))


def _states_dtype(dtype: torch.dtype, training: bool = True) -> torch.dtype:
    """The dtype of the kept per-chunk states and state gradients (``SCAN_BLOCKS["states_lowp"]``; fp32 for
    inference prefill)."""
    return dtype if SCAN_BLOCKS["states_lowp"] and training else torch.float32


def _stages(name: str, dtype: torch.dtype) -> int:
    # fp32 tiles with several pipeline stages can overflow shared memory; one stage fits.
    return 1 if dtype == torch.float32 else SCAN_BLOCKS[name]


def _forward(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, chunk: int, cb_scratch: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_forward(x, dt, A, B, C, D, chunk, cb_scratch, None, None)


def _forward_with_state(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor, initial_state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only, from ``initial_state`` ``[b, h, p, n]`` (contiguous): ``(y, final state fp32 [b, h, p, n])``."""
    final = torch.empty(initial_state.shape, device=x.device, dtype=torch.float32)
    y, _, _ = _launch_forward(x, dt, A, B, C, D, chunk, False, initial_state, final)
    return y, final


def _launch_forward(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor, chunk: int, cb_scratch: bool, initial_state: torch.Tensor | None,
                    final: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    chunks = -(-length // chunk)
    y = torch.empty(batch, length, heads, head_dim, device=x.device, dtype=x.dtype)
    states = torch.empty(batch, chunks, heads, head_dim, state_dim, device=x.device, dtype=_states_dtype(x.dtype, training=initial_state is None and final is None))
    prec = _precision(x.dtype)
    state_kernel, chunk_kernel, cb_kernel = (torch.library.wrap_triton(k) for k in forward_kernels())
    # C B^T per (chunk, group) where cb_scratch; else an empty tensor, and ``states`` stands in for the unused pointer.
    cb = torch.empty(batch * chunks * groups * chunk * chunk if cb_scratch else 0, device=x.device,
                     dtype=torch.float32)
    if cb_scratch:
        cb_kernel[(batch * chunks, groups)](
            B, C, cb, length, chunks, groups, state_dim, B.stride(0), B.stride(1), B.stride(2), C.stride(0),
            C.stride(1), C.stride(2), Q=chunk, BK=_block("fwd_k", state_dim), PREC=prec,
            num_warps=SCAN_BLOCKS["fwd_warps"], num_stages=_stages("fwd_stages", x.dtype))
    block_p, block_n = _block("state_p", head_dim), _block("state_n", state_dim)
    # Without an initial / final state (training) ``states`` stands in for the unused pointers.
    init = states if initial_state is None else initial_state
    fin = states if final is None else final
    state_kernel[(batch * heads, -(-head_dim // block_p), -(-state_dim // block_n))](
        x, dt, A, B, states, init, fin, length, chunks, heads, heads // groups, head_dim, state_dim,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2),
        states.stride(0), states.stride(1), states.stride(2), init.stride(0), init.stride(1), fin.stride(0),
        fin.stride(1), Q=chunk, BP=block_p, BN=block_n, PREC=prec, HAS_INIT=initial_state is not None,
        HAS_FINAL=final is not None, num_warps=SCAN_BLOCKS["state_warps"],
        num_stages=_stages("state_stages", x.dtype))
    block_p = _block("fwd_p", head_dim)
    chunk_kernel[(batch * chunks, heads, -(-head_dim // block_p))](
        x, dt, A, B, C, D, y, states, cb if cb_scratch else states, length, chunks, heads, heads // groups,
        head_dim, state_dim,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2), y.stride(0), y.stride(1), y.stride(2),
        states.stride(0), states.stride(1), states.stride(2),
        Q=chunk, BP=block_p, BK=_block("fwd_k", state_dim), PREC=prec, CB=cb_scratch,
        num_warps=SCAN_BLOCKS["fwd_warps"], num_stages=_stages("fwd_stages", x.dtype))
    return y, states, cb


def _backward(dy: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor, states: torch.Tensor, cb: torch.Tensor, chunk: int,
              cb_scratch: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    chunks = states.shape[1]
    prec = _precision(x.dtype)
    state_grad_kernel, dx_kernel, dbc_kernel, group_kernel = (torch.library.wrap_triton(k) for k in backward_kernels())
    # The gradient of the state leaving each chunk, in a buffer shaped (and strided) like ``states``.
    grad_states = torch.empty_like(states)
    block_p, block_n = _block("state_p", head_dim), _block("state_n", state_dim)
    state_grad_kernel[(batch * heads, -(-head_dim // block_p), -(-state_dim // block_n))](
        dt, A, C, dy, grad_states, length, chunks, heads, heads // groups, head_dim, state_dim,
        dt.stride(0), dt.stride(1), C.stride(0), C.stride(1), C.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
        grad_states.stride(0), grad_states.stride(1), grad_states.stride(2),
        Q=chunk, BP=block_p, BN=block_n, PREC=prec, num_warps=SCAN_BLOCKS["state_warps"],
        num_stages=_stages("state_stages", x.dtype))
    strides = (x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1),
               B.stride(2), C.stride(0), C.stride(1), C.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
               states.stride(0), states.stride(1), states.stride(2))
    dB = torch.empty(batch, length, groups, state_dim, device=x.device, dtype=B.dtype)
    dC = torch.empty(batch, length, groups, state_dim, device=x.device, dtype=C.dtype)
    if SCAN_BLOCKS["bwd_fused"]:
        dx = torch.empty_like(dy)
        ddt = torch.empty(batch, length, heads, device=x.device, dtype=torch.float32)
        dA = torch.empty(batch * chunks, heads, device=x.device, dtype=torch.float32)
        dD = torch.empty(batch * chunks, heads, head_dim, device=x.device, dtype=torch.float32)
        group_kernel[(batch * chunks, groups)](
            x, dt, A, B, C, D, dy, states, grad_states, dx, ddt, dA, dD, dB, dC,
            length, chunks, heads // groups, head_dim, state_dim, groups, *strides,
            # fp32 tiles: at most 32 head_dim columns per step, so that shared memory holds them.
            Q=chunk, BP=min(_block("fused_p", head_dim), 32 if x.dtype == torch.float32 else 256),
            BN=max(16, next_power_of_two(state_dim)), PREC=prec,
            num_warps=SCAN_BLOCKS["fused_warps"], num_stages=_stages("fused_stages", x.dtype))
        return dx, ddt, dA.sum(0), dB, dC, dD.sum(0)
    block_p = _block("dx_p", head_dim)
    p_blocks = -(-head_dim // block_p)
    dx = torch.empty_like(dy)
    ddt = (torch.zeros if p_blocks > 1 else torch.empty)(batch, length, heads, device=x.device, dtype=torch.float32)
    dA = torch.empty(batch * chunks, heads, p_blocks, device=x.device, dtype=torch.float32)
    dD = torch.empty(batch * chunks, heads, head_dim, device=x.device, dtype=torch.float32)
    dx_kernel[(batch * chunks, heads, p_blocks)](
        x, dt, A, B, C, D, dy, states, grad_states, cb if cb_scratch else states, dx, ddt, dA, dD,
        length, chunks, heads, heads // groups, head_dim, state_dim, p_blocks, *strides,
        Q=chunk, BP=block_p, BK=_block("dx_k", state_dim), PREC=prec, ATOMIC_DT=p_blocks > 1,
        CB=cb_scratch, num_warps=SCAN_BLOCKS["dx_warps"], num_stages=_stages("dx_stages", x.dtype))
    # fp32 tiles: at most 64 state columns per program (the width the GPU tests ran in fp32 with), for shared memory.
    block_n = min(_block("dbc_n", state_dim), 64 if x.dtype == torch.float32 else 256)
    dbc_kernel[(batch * chunks, groups, -(-state_dim // block_n))](
        x, dt, A, B, C, dy, states, grad_states, dB, dC,
        length, chunks, heads // groups, head_dim, state_dim, groups, *strides,
        Q=chunk, BP=_block("dbc_p", head_dim), BN=block_n, PREC=prec, num_warps=SCAN_BLOCKS["dbc_warps"],
        num_stages=_stages("dbc_stages", x.dtype))
    return dx, ddt, dA.sum((0, 2)), dB, dC, dD.sum(0)


# Registered at import where Triton is installed (the kernels are built on their first launch).
_FORWARD_OP = triton_op("megatron_core::ssd_scan_forward", _forward)
_FORWARD_STATE_OP = triton_op("megatron_core::ssd_scan_forward_with_state", _forward_with_state)
_BACKWARD_OP = triton_op("megatron_core::ssd_scan_backward", _backward)


class _SSDScan(torch.autograd.Function):
    """``y`` of the scan; the backward reads the states the forward kept (one per chunk)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor) -> torch.Tensor:
        chunk = SCAN_BLOCKS["chunk"]
        if chunk not in (16, 32, 64, 128):
            raise ValueError(f"SCAN_BLOCKS['chunk'] ({chunk}) must be 16, 32, 64 or 128")
        cb_scratch = bool(SCAN_BLOCKS["cb_scratch"])
        y, states, cb = _FORWARD_OP(x, dt, A, B, C, D, chunk, cb_scratch)
        ctx.chunk, ctx.cb_scratch = chunk, cb_scratch
        ctx.save_for_backward(x, dt, A, B, C, D, states, cb)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple:
        x, dt, A, B, C, D, states, cb = ctx.saved_tensors
        dx, ddt, dA, dB, dC, dD = _BACKWARD_OP(dy.contiguous(), x, dt, A, B, C, D, states, cb, ctx.chunk,
                                               ctx.cb_scratch)
        return dx, ddt, dA, dB, dC, dD


def ssd_chunk_scan_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                          return_final_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~megatron_core.ssm.ssd_scan.ssd_chunk_scan` through the Triton kernels.

    ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]`` (any float dtype; fp32 inside), ``A`` ``[h]``, ``B``/``C``
    ``[b, l, g, n]`` (any strides with a unit last stride: slices of one projection are read in place),
    ``D`` ``[h]`` or ``[h, p]``. Returns ``y`` in ``x``'s dtype; gradients flow to every input. With
    ``initial_state`` ``[b, h, p, n]`` (any float dtype, fp32 inside) or ``return_final_state`` (then
    ``(y, final state fp32 [b, h, p, n])``) the scan runs forward only (inference prefill): no gradient.
    """
    heads, head_dim = x.shape[2], x.shape[3]
    groups, state_dim = B.shape[2], B.shape[3]
    if heads % groups != 0 or C.shape != B.shape or state_dim > _MAX_DIM or head_dim > _MAX_DIM:
        raise ValueError(f"ssd_chunk_scan_triton: heads ({heads}) must be divisible by groups ({groups}), C "
                         f"{tuple(C.shape)} must match B {tuple(B.shape)}, head_dim ({head_dim}) and state_dim "
                         f"({state_dim}) at most {_MAX_DIM}")
    if D is None:
        D = torch.zeros(heads, head_dim, device=x.device, dtype=torch.float32)
    D_full = (D.float() if D.dim() == 2 else D.float()[:, None].expand(heads, head_dim)).contiguous()

    def unit_last(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    dt32 = dt.float()
    dt32 = dt32 if dt32.stride(-1) == 1 and dt32.stride(1) == heads else dt32.contiguous()
    if initial_state is None and not return_final_state:
        return _SSDScan.apply(unit_last(x), dt32, A.float().contiguous(), unit_last(B), unit_last(C), D_full)
    batch = x.shape[0]
    init = (initial_state.contiguous() if initial_state is not None
            else torch.zeros(batch, heads, head_dim, state_dim, device=x.device, dtype=torch.float32))
    if init.shape != (batch, heads, head_dim, state_dim):
        raise ValueError(f"ssd_chunk_scan_triton: initial_state {tuple(init.shape)} must be "
                         f"{(batch, heads, head_dim, state_dim)}")
    chunk = SCAN_BLOCKS["chunk"]
    if chunk not in (16, 32, 64, 128):
        raise ValueError(f"SCAN_BLOCKS['chunk'] ({chunk}) must be 16, 32, 64 or 128")
    with torch.no_grad():
        y, final = _FORWARD_STATE_OP(unit_last(x), dt32, A.float().contiguous(), unit_last(B), unit_last(C),
                                     D_full, init, chunk)
    return (y, final) if return_final_state else y
