"""Gradient clipping folded into PyTorch's fused Adam kernel: no pass over the gradients, no host wait.

Clipping by the global norm multiplies every gradient by ``clip / (norm + 1e-6)`` when that is below 1,
which costs a pass over all gradients and, to decide, a device-to-host copy of the norm. PyTorch's
fused ``Adam``/``AdamW`` kernels already divide the gradients by an optional ``grad_scale`` tensor and
skip the whole update (moments, step count and weight decay included) when an optional ``found_inf``
tensor is non-zero; ``torch.amp.GradScaler`` uses both. Setting ``grad_scale = max(1, (norm + 1e-6) /
clip)`` and ``found_inf = not isfinite(norm)`` on the device gives exactly the clipped (or skipped)
update, and the norm is read on the host only after the update has been queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["fused_adam_step_with_clipping", "supports_fused_clipping"]


def supports_fused_clipping(optimizer: torch.optim.Optimizer | None) -> bool:
    """True for a torch ``Adam``/``AdamW`` whose every param group runs the fused kernel."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or not optimizer.param_groups:
        return False
    return all(group.get("fused") for group in optimizer.param_groups)


def fused_adam_step_with_clipping(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                                  grad_norm: torch.Tensor, clip_grad: float, step: Callable[[], None],
                                  skip_check: torch.Tensor | None = None) -> None:
    """Run ``step()`` (which calls ``optimizer.step()``, or each one's of a sequence) with the clip factor and the
    inf check on the device.

    ``grad_norm`` is the global gradient norm as a 1-element fp32 tensor on the parameters' device; the
    update is skipped when ``skip_check`` (default: the norm) is not finite.
    """
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    norm = grad_norm.reshape(())
    check = norm if skip_check is None else skip_check.reshape(())
    grad_scale = torch.clamp((norm + 1.0e-6) / clip_grad, min=1.0)
    found_inf = (~torch.isfinite(check)).to(torch.float32)
    for opt in optimizers:
        opt.grad_scale, opt.found_inf = grad_scale, found_inf
    try:
        step()
    finally:
        for opt in optimizers:
            del opt.grad_scale, opt.found_inf
