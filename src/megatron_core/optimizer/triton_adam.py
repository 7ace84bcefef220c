"""Adam/AdamW step in one Triton kernel per parameter, writing the bf16/fp16 model copy too (CUDA).

PyTorch's fused Adam reaches about 77% of the copy bandwidth on an H100, and a mixed-precision
optimizer then copies every updated fp32 main param into its bf16 model param in a second pass. This
kernel reads the fp32 gradient, main param and both moments once, writes them back, and writes the
model param's bf16/fp16 value in the same pass (30 bytes per parameter, the floor
``benchmarks/gpt_full_step.py`` prints). Clipping and the inf/nan skip come as device tensors
(``grad_scale``, ``found_inf``: see :mod:`.fused_clip`), so nothing waits for the host.

The update is torch's ``Adam``/``AdamW`` (``fused=True``) update, and the optimizer state keeps torch's
layout (``step`` as a float32 device tensor, ``exp_avg``, ``exp_avg_sq``), so checkpoints and
``state_dict`` are unchanged and the unfused path can resume from it. Used only where
:func:`supports_triton_adam` says so: every param group is a plain fused Adam/AdamW (no amsgrad,
maximize, capturable or tensor learning rate) over fp32 CUDA params with fp32 gradients, and Triton
is installed; ``MEGATRON_CORE_TRITON_ADAM=0`` in the environment turns it off. Triton is imported
lazily, here only.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

__all__ = ["supports_triton_adam", "triton_adam_step"]

_BLOCK = 2048


@functools.cache
def _triton() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


@functools.cache
def _kernel() -> Any:
    triton, tl = _triton()

    @triton.jit
    def adam_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, step_ptr, scale_ptr, found_inf_ptr,
                    n, lr, beta1, beta2, eps, weight_decay, log_beta1, log_beta2,
                    ADAMW: tl.constexpr, WRITE_OUT: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        limit = tl.where(tl.load(found_inf_ptr) == 0, n, 0)  # found_inf: no element is updated
        mask = offsets < limit
        step = tl.load(step_ptr)
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0) / tl.load(scale_ptr)
        param = tl.load(param_ptr + offsets, mask=mask, other=0.0)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
        if ADAMW:
            param = param * (1.0 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        bias_correction1 = 1.0 - tl.exp(step * log_beta1)
        bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * log_beta2))
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - (lr / bias_correction1) * exp_avg / denom
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        if WRITE_OUT:
            tl.store(out_ptr + offsets, param.to(out_ptr.dtype.element_ty), mask=mask)

    return adam_kernel


def supports_triton_adam(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether :func:`triton_adam_step` can replace ``optimizer.step()`` exactly."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not optimizer.param_groups:
        return False
    if os.environ.get("MEGATRON_CORE_TRITON_ADAM", "1") == "0" or _triton() is None:
        return False
    for group in optimizer.param_groups:
        if not all(0.0 < beta < 1.0 for beta in group["betas"]):
            return False
        if not group.get("fused") or group.get("amsgrad") or group.get("maximize") or group.get("capturable") \
                or group.get("differentiable") or isinstance(group["lr"], torch.Tensor):
            return False
        for p in group["params"]:
            if not p.is_cuda or p.dtype != torch.float32 or (p.grad is not None and p.grad.dtype != torch.float32):
                return False
    return True


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The param's state, created as torch's fused Adam creates it on its first step."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


@torch.no_grad()
def triton_adam_step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor, found_inf: torch.Tensor,
                     model_targets: dict[int, torch.Tensor] | None = None) -> set[int]:
    """One Adam/AdamW step of every param with a gradient; returns the ids of the main params whose model
    copy (``model_targets[id(main)]``, a contiguous bf16/fp16 tensor of the same size) was written.

    ``grad_scale`` (gradients are divided by it) and ``found_inf`` (non-zero: skip everything, step counts
    included) are 1-element fp32 tensors on the params' device.
    """
    kernel = _kernel()
    model_targets = model_targets or {}
    scale = grad_scale.reshape(1).to(torch.float32)
    skip = found_inf.reshape(1).to(torch.float32)
    written: set[int] = set()
    adamw = isinstance(optimizer, torch.optim.AdamW) or any(g.get("decoupled_weight_decay") for g in
                                                             optimizer.param_groups)
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [_state(optimizer, p) for p in params]
        torch._foreach_add_([s["step"] for s in states], 1.0 - skip.reshape(()))
        beta1, beta2 = group["betas"]
        decoupled = adamw or bool(group.get("decoupled_weight_decay"))
        for p, state in zip(params, states):
            n = p.numel()
            target = model_targets.get(id(p))
            write = target is not None and target.is_contiguous() and target.numel() == n
            if not (p.is_contiguous() and p.grad.is_contiguous()):
                raise ValueError("triton_adam_step needs contiguous params and gradients")
            kernel[(triton_grid(n),)](
                p, p.grad, state["exp_avg"], state["exp_avg_sq"], target if write else p, state["step"], scale, skip,
                n, float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                math.log(beta1), math.log(beta2), ADAMW=decoupled, WRITE_OUT=write, BLOCK=_BLOCK,
            )
            if write:
                written.add(id(p))
    return written


def triton_grid(n: int) -> int:
    """Programs of :data:`_BLOCK` elements for ``n`` elements."""
    return max(1, -(-n // _BLOCK))
