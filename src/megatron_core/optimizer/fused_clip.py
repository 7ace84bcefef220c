"""Gradient clipping folded into PyTorch's fused Adam kernel: no pass over the gradients, no host wait.

Clipping by the global norm multiplies every gradient by ``clip / (norm + 1e-6)`` when that is below 1,
which costs a pass over all gradients and, to decide, a device-to-host copy of the norm. PyTorch's
fused ``Adam``/``AdamW`` kernels already divide the gradients by an optional ``grad_scale`` tensor and
skip the whole update (moments, step count and weight decay included) when an optional ``found_inf``
tensor is non-zero; ``torch.amp.GradScaler`` uses both. Setting ``grad_scale = max(1, (norm + 1e-6) /
clip)`` and ``found_inf = not isfinite(norm)`` on the device gives exactly the clipped (or skipped)
update, and the norm is read on the host only after the update has been queued. Where
:func:`~megatron_core.optimizer.triton_adam.supports_triton_adam` holds, the update runs in that
module's kernel instead, which also writes the model params' bf16/fp16 copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.optimizer.triton_adam import supports_triton_adam, triton_adam_step

__all__ = ["fused_adam_step_with_clipping", "supports_fused_clipping"]


def supports_fused_clipping(optimizer: torch.optim.Optimizer | None) -> bool:
    """True for a torch ``Adam``/``AdamW`` whose every param group runs the fused kernel."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or not optimizer.param_groups:
        return False
    return all(group.get("fused") for group in optimizer.param_groups)


def fused_adam_step_with_clipping(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, clip_grad: float,
                                  step: Callable[[], None],
                                  model_targets: dict[int, torch.Tensor] | None = None) -> set[int]:
    """Run ``step()`` (which calls ``optimizer.step()``) with the clip factor and the inf check on the device.

    ``grad_norm`` is the global gradient norm as a 1-element fp32 tensor on the parameters' device.
    ``model_targets`` (``{id(main param): model copy}``) are the tensors a mixed-precision wrapper copies
    the updated main params into; the returned ids are those the Triton kernel already wrote (the wrapper
    skips their copy). Empty when torch's fused kernel ran.
    """
    norm = grad_norm.reshape(())
    grad_scale = torch.clamp((norm + 1.0e-6) / clip_grad, min=1.0)
    found_inf = (~torch.isfinite(norm)).to(torch.float32)
    if supports_triton_adam(optimizer):
        written: set[int] = set()

        def triton_step(closure: Any = None) -> None:
            written.update(triton_adam_step(optimizer, grad_scale, found_inf, model_targets))

        optimizer.step = triton_step  # type: ignore[method-assign]  # this call's step() runs the kernel
        optimizer.model_params_written = written
        try:
            step()
        finally:
            del optimizer.step, optimizer.model_params_written
        return written
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
    return set()
