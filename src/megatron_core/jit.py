"""The JIT fuser decorator that fused element-wise functions use (Megatron-Core's ``jit``).

``jit_fuser(fn)`` returns a function that runs ``torch.compile(fn)`` when the fuser is enabled and its
first tensor argument is on an accelerator, and plain ``fn`` otherwise (on CPU, compiling needs a C++
toolchain and buys little for these small functions). ``disable_jit_fuser()`` / ``enable_jit_fuser()``
switch it for every decorated function, including ones decorated before the call. Called while an
enclosing ``torch.compile`` traces, the plain function is inlined into that graph.

Triton, which the library's hand-written GPU kernels need, is an optional dependency loaded here only:
:func:`triton_modules` imports it on first use, :func:`have_triton` says whether it can be, and
:func:`triton_op` registers a kernel's ``torch.library.triton_op`` only where Triton is installed, and
:func:`kernel_device` selects the device a kernel is launched on, and :func:`shared_kernel_input` hands one
tensor to several kernels of a compiled graph without a copy for each.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])

_jit_enabled = True


def noop_decorator(func: _F) -> _F:
    """Return ``func`` unchanged."""
    return func


def enable_jit_fuser() -> None:
    """Compile ``jit_fuser``-decorated functions on accelerator tensors (the default)."""
    global _jit_enabled
    _jit_enabled = True


def disable_jit_fuser() -> None:
    """Run ``jit_fuser``-decorated functions eagerly."""
    global _jit_enabled
    _jit_enabled = False


def is_jit_fuser_enabled() -> bool:
    """Whether ``jit_fuser`` compiles on accelerator tensors."""
    return _jit_enabled


def _on_accelerator(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type != "cpu"
    return False


def jit_fuser(func: _F) -> _F:
    """Decorate an element-wise function so it is ``torch.compile``'d on accelerators while enabled."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Already inside a graph being traced (a compiled layer or model): inline the plain function, so
            # the caller's graph stays whole (touching ``compiled`` here would be a side effect that breaks it).
            return func(*args, **kwargs)
        if _jit_enabled and _on_accelerator(args, kwargs):
            if not compiled:
                compiled.append(torch.compile(func))
            return compiled[0](*args, **kwargs)
        return func(*args, **kwargs)

    wrapper.__wrapped_eager__ = func  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def triton_installed() -> bool:
    """Whether a Triton package is present, found without importing it."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a module entry without a spec
        return False


def triton_op(name: str, fn: Callable, mutates_args: tuple[str, ...] = ()) -> Any:
    """``torch.library.triton_op(name, fn, mutates_args=...)``, or ``None`` where torch lacks it or Triton is not
    installed.

    Registering inspects ``fn`` for Triton kernels, which imports Triton (and logs a warning when it is
    missing): callers register at import, so a machine without Triton gets ``None`` and no warning.
    """
    register = getattr(torch.library, "triton_op", None)
    if register is None or not triton_installed():
        return None
    return register(name, fn, mutates_args=mutates_args)


@functools.cache
def triton_modules() -> tuple[Any, Any] | None:
    """``(triton, triton.language)``, imported on first call, or ``None`` when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


@torch.compiler.assume_constant_result
def have_triton() -> bool:
    """Whether Triton can be imported (a constant to ``torch.compile``, which cannot trace the import)."""
    return triton_modules() is not None


def direct_triton_launches() -> contextlib.AbstractContextManager:
    """The context in which kernels wrapped by ``torch.library.wrap_triton`` launch straight away: for eager code that
    is never traced (the body of an opaque custom op), where the wrapper's higher-order-op dispatch would otherwise
    cost hundreds of microseconds of host time per launch (torch's ``set_wrap_triton_enabled``; nothing to switch
    where torch lacks it)."""
    try:
        from torch._library.triton import set_wrap_triton_enabled
    except ImportError:
        return contextlib.nullcontext()
    return set_wrap_triton_enabled(False)


def kernel_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context that launches a Triton kernel on ``t``'s CUDA device (nothing to select for the CPU tensors of
    Triton's interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def shared_kernel_input(t: torch.Tensor) -> torch.Tensor:
    """``t``, written to memory once for all the Triton kernels of a compiled graph that read it.

    Inductor hands each argument of a user-defined Triton kernel (the kernels of a ``triton_op``) over in a fixed
    layout (its ``triton_kernel_default_layout_constraint``). An argument that is not in memory yet, the result of
    element-wise ops Inductor fuses into one kernel, is then copied for each kernel argument it feeds: every copy
    one more store of the producing kernel (four stores of an FP8 expert layer's activation, read by the row-wise
    cast as two arguments and by the column-wise cast's two kernels). Called once where such a tensor is made, in
    code ``torch.compile`` traces, this lays it out in memory once (``prims.inductor_force_stride_order``, which
    Inductor lowers to nothing for a tensor that is in memory already) and every kernel reads that buffer. Eagerly,
    and for a tensor autograd tracks (the prim has no derivative), it is ``t`` itself.
    """
    if not torch.compiler.is_compiling() or (t.requires_grad and torch.is_grad_enabled()):
        return t
    from torch._inductor import inductor_prims  # noqa: F401  (registers the prim; loaded wherever Dynamo traces)

    return torch.ops.prims.inductor_force_stride_order(t, t.stride())


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``): a Triton block size covering ``n`` elements."""
    return 1 << (n - 1).bit_length()
