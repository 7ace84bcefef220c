"""The weight-gradient GEMM of ``gradient_accumulation_fusion``: ``main_grad += dY^T X`` in one step.

Eagerly it is called directly. Inside ``torch.compile``d backward graphs it is the custom op
``torch.ops.megatron_core.accumulate_weight_gradient`` (it mutates ``main_grad``), so that the
compiled graph calls the same kernel instead of tracing it (torch 2.11's fake kernel of
``addmm(..., out_dtype=)`` fails) and the layer needs no graph break.

First writes (our extension, DDP's ``overwrite_main_grad_on_first_wgrad``): DDP may leave a
``main_grad`` unzeroed at the start of a step and register it here with :func:`expect_first_write`;
the next GEMM into it then writes the product (``beta = 0``: the stale values are never read)
instead of adding. Whatever is still pending when the gradients are consumed is zeroed by
:func:`zero_pending_first_writes`. The registry is keyed by ``data_ptr()`` and is a one-shot
decision per step, so a CUDA graph must not capture a GEMM that takes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = [
    "BACKWARD_ADDS_TO_MAIN_GRAD",
    "accumulate_embedding_gradient",
    "accumulate_weight_gradient",
    "expect_first_write",
    "finish_fused_weight_gradient",
    "gemm_accumulates_into_fp32",
    "gradient_into_main_grad",
    "mark_gradient_into_main_grad",
    "pending_first_writes",
    "zero_pending_first_writes",
]

_FP32_ACCUMULATING_GEMM: dict[torch.device, bool] = {}

# main_grad tensors whose memory is stale until their first weight-gradient GEMM of the step, by data_ptr(). Weak
# references: a model dropped mid-step (its DDP buffers with it) leaves no memory held here; its entry goes with it.
_PENDING_FIRST_WRITES: dict[int, weakref.ref] = {}


def gemm_accumulates_into_fp32(device: torch.device) -> bool:
    """Whether ``addmm(fp32, bf16, bf16, out_dtype=fp32, out=fp32)`` works on ``device`` (checked once, on CUDA).

    Newer PyTorch builds run it on CUDA as one cuBLAS GEMM with an fp32 C operand; the check compares a
    small product against the two-step result, so a build without it (or a wrong one) keeps the fallback.
    """
    if device.type != "cuda":
        return False
    key = device  # per device (a host-side lookup on every weight-gradient GEMM: no string formatting)
    if key not in _FP32_ACCUMULATING_GEMM:
        try:
            a = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
            b = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
            acc = torch.randn(64, 48, device=device, dtype=torch.float32)
            want = acc + (a @ b).float()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool(torch.allclose(acc, want, rtol=2e-2, atol=2e-1))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _FP32_ACCUMULATING_GEMM[key] = ok
    return _FP32_ACCUMULATING_GEMM[key]


def expect_first_write(main_grads: Iterable[torch.Tensor]) -> None:
    """Register ``main_grads`` (stale memory): the next :func:`accumulate_weight_gradient` into each overwrites it.

    The GEMM must receive the registered tensor's memory from its start (``param.main_grad`` itself). Only
    weak references are kept: the caller keeps each tensor alive until it is written or zeroed (DDP's
    ``param.main_grad`` views are), and a tensor that dies is forgotten. Empty tensors are skipped (they have
    no memory to share a ``data_ptr()`` with).
    """
    for main_grad in main_grads:
        if main_grad.numel() > 0:
            key = main_grad.data_ptr()
            _PENDING_FIRST_WRITES[key] = weakref.ref(main_grad, lambda ref, key=key: _forget(key, ref))


def _forget(key: int, ref: weakref.ref) -> None:
    if _PENDING_FIRST_WRITES.get(key) is ref:
        del _PENDING_FIRST_WRITES[key]


def _live(refs: Iterable[weakref.ref | None]) -> list[torch.Tensor]:
    return [t for t in (r() for r in refs if r is not None) if t is not None]


def pending_first_writes() -> list[torch.Tensor]:
    """The registered tensors that no weight-gradient GEMM has written yet."""
    return _live(_PENDING_FIRST_WRITES.values())


def zero_pending_first_writes(tensors: Iterable[torch.Tensor] | None = None) -> None:
    """Zero and forget the pending tensors (only those among ``tensors`` when given), in one ``_foreach_zero_``.

    Call before anything reads the gradients: a registered weight that got no gradient this step (an
    unused layer, an expert that skipped its GEMM) must read as zero. Idempotent; nearly free when
    nothing is pending.
    """
    if not _PENDING_FIRST_WRITES:
        return
    if tensors is None:
        stale = _live(_PENDING_FIRST_WRITES.values())
        _PENDING_FIRST_WRITES.clear()
    else:
        stale = _live([_PENDING_FIRST_WRITES.pop(t.data_ptr(), None) for t in tensors if t.numel() > 0])
    if stale:
        torch._foreach_zero_(stale)


def _take_first_write(main_grad: torch.Tensor) -> bool:
    """Whether this GEMM is ``main_grad``'s first write of the step (then it is no longer pending)."""
    if not _PENDING_FIRST_WRITES:  # nothing registered (the flag off): no lookup
        return False
    key = main_grad.data_ptr()
    ref = _PENDING_FIRST_WRITES.pop(key, None)
    pending = None if ref is None else ref()
    if pending is None:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _PENDING_FIRST_WRITES[key] = ref
        raise RuntimeError(
            "a CUDA graph is capturing the first weight-gradient GEMM into a main_grad that DDP left unzeroed "
            "(overwrite_main_grad_on_first_wgrad=True): the graph would replay the one-shot overwrite every time; "
            "turn overwrite_main_grad_on_first_wgrad off for captured backward passes"
        )
    if pending.numel() != main_grad.numel():
        # Only a slice that starts where the pending tensor starts: zero all of it, then accumulate.
        pending.zero_()
        return False
    return True


def accumulate_weight_gradient(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """``main_grad += grad_output_2d^T @ input_2d`` (``[out, in]`` from ``[tokens, out]`` and ``[tokens, in]``).

    When ``main_grad`` awaits its first write (:func:`expect_first_write`), ``main_grad = grad_output_2d^T @
    input_2d`` instead, without reading its old values.
    """
    overwrite = _take_first_write(main_grad)
    beta = 0 if overwrite else 1
    if main_grad.dtype == grad_output_2d.dtype:
        main_grad.addmm_(grad_output_2d.t(), input_2d, beta=beta)  # one GEMM; beta=0 does not read main_grad
    elif gemm_accumulates_into_fp32(main_grad.device):
        # bf16/fp16 operands on tensor cores, the product added to the fp32 main_grad inside the GEMM.
        torch.addmm(main_grad, grad_output_2d.t(), input_2d, beta=beta, out_dtype=main_grad.dtype, out=main_grad)
    elif overwrite:
        main_grad.copy_(grad_output_2d.t().matmul(input_2d))
    else:
        # bf16/fp16 activations with an fp32 main_grad: the GEMM runs in the activation dtype (tensor
        # cores, fp32 accumulation inside) and its result is added in fp32, as the unfused DDP hook does;
        # upcasting the operands instead would run the GEMM in fp32, many times slower on a GPU.
        main_grad.add_(grad_output_2d.t().matmul(input_2d))


def finish_fused_weight_gradient(weight: torch.Tensor) -> torch.Tensor | None:
    """What a fused backward returns as ``weight``'s gradient once it has written ``weight.main_grad``.

    Under DDP (the weight has Megatron's ``grad_added_to_main_grad``): eagerly the flag is set; inside a compiled
    graph, where setting an attribute would break the graph, the layer's ``wgrad_fused_into_main_grad`` mark
    stands in. The returned placeholder keeps DDP's hook running (it marks the gradient ready) and is ignored by
    it, except for a ``zero_out_wgrad`` weight (a tied weight whose other gradients arrive through ``.grad``),
    whose hook adds it: zeros then. Without DDP: None.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if not torch.compiler.is_compiling():
        weight.grad_added_to_main_grad = True
    return torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)


# The static mark of a weight whose gradient its own backward adds to ``main_grad`` (see ``gradient_into_main_grad``).
# Unlike ``wgrad_fused_into_main_grad`` it promises no overwrite: DDP zeroes these ``main_grad``s as usual.
BACKWARD_ADDS_TO_MAIN_GRAD = "backward_adds_to_main_grad"


def mark_gradient_into_main_grad(weight: torch.Tensor) -> None:
    """Mark ``weight`` as one whose forward goes through :func:`gradient_into_main_grad` (when DDP wraps it).

    DDP's backward hook then ignores the placeholder ``.grad`` inside compiled graphs too, where the backward cannot
    set ``grad_added_to_main_grad``.
    """
    setattr(weight, BACKWARD_ADDS_TO_MAIN_GRAD, True)


class _GradientIntoMainGrad(torch.autograd.Function):
    """Identity on a weight; its backward adds the weight's gradient to ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor | None:
        (weight,) = ctx.saved_tensors
        # A plain in-place add: inside a compiled backward Inductor folds it into the kernel that finishes the
        # gradient's reduction (a norm's weight gradient sums over every token), instead of DDP's hook adding the
        # finished gradient in a kernel of its own.
        weight.main_grad.add_(grad)
        return finish_fused_weight_gradient(weight)


def gradient_into_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` for a forward whose backward adds ``weight``'s gradient straight to ``weight.main_grad``.

    Applies when the weight is marked with :func:`mark_gradient_into_main_grad` and has a ``main_grad`` (DDP's
    buffer view); otherwise ``weight`` itself. The mark alone decides, as it does for DDP's hook, so the two never
    disagree (a gradient neither added here nor by the hook would be lost). The addition is the one DDP's hook
    would make (the gradient in the weight's dtype added to the fp32 ``main_grad``), so the result is the same;
    used for small weights (norms) whose gradient is a reduction that Inductor can finish in place.
    """
    if weight.requires_grad and getattr(weight, BACKWARD_ADDS_TO_MAIN_GRAD, False) and hasattr(weight, "main_grad"):
        return _GradientIntoMainGrad.apply(weight)
    return weight


def accumulate_embedding_gradient(main_grad: torch.Tensor, ids: torch.Tensor, grad_output_2d: torch.Tensor,
                                  deterministic: bool = False) -> None:
    """``main_grad[ids[i]] += grad_output_2d[i]`` for every token ``i``, in ``main_grad``'s dtype (fp32).

    The lookup's weight gradient added where it belongs instead of built as a dense ``[vocab, hidden]`` gradient in
    the weight's dtype and added afterwards. ``deterministic`` (or torch's deterministic-algorithms mode) sums the
    tokens of one row in a fixed order (``index_put_`` with accumulation); otherwise ``index_add_`` (atomic adds on
    CUDA: the order of a row's additions may vary from run to run). A ``main_grad`` awaiting its first write
    (:func:`expect_first_write`) is zeroed first: a scatter cannot overwrite.
    """
    if _take_first_write(main_grad):
        main_grad.zero_()
    values = grad_output_2d.to(main_grad.dtype)
    if deterministic or torch.are_deterministic_algorithms_enabled():
        main_grad.index_put_((ids,), values, accumulate=True)
    else:
        main_grad.index_add_(0, ids, values)


# Defined with the plain ``torch.library.Library`` API rather than ``torch.library.custom_op``: the dispatcher then
# calls the Python function directly, without custom_op's Python autograd / view / checking layers (about 60 us
# per call on the host; a backward makes four calls per layer).
_LIBRARY = torch.library.Library("megatron_core", "FRAGMENT")
_LIBRARY.define("accumulate_weight_gradient(Tensor(a!) main_grad, Tensor grad_output_2d, Tensor input_2d) -> ()")
_LIBRARY.impl("accumulate_weight_gradient", accumulate_weight_gradient, "CompositeExplicitAutograd")


@torch.library.register_fake("megatron_core::accumulate_weight_gradient", lib=_LIBRARY)
def _(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    return None


_LIBRARY.define("accumulate_embedding_gradient(Tensor(a!) main_grad, Tensor ids, Tensor grad_output_2d, "
                "bool deterministic=False) -> ()")
_LIBRARY.impl("accumulate_embedding_gradient", accumulate_embedding_gradient, "CompositeExplicitAutograd")


@torch.library.register_fake("megatron_core::accumulate_embedding_gradient", lib=_LIBRARY)
def _(main_grad: torch.Tensor, ids: torch.Tensor, grad_output_2d: torch.Tensor, deterministic: bool = False) -> None:
    return None
