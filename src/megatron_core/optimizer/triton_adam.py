"""Adam/AdamW step in one Triton kernel launch per param group, writing the bf16/fp16 model copy too (CUDA).

PyTorch's fused Adam reaches about 77% of the copy bandwidth on an H100, and a mixed-precision
optimizer then copies every updated fp32 main param into its bf16 model param in a second pass. This
kernel reads the fp32 gradient, main param and both moments once, writes them back, and writes the
model param's bf16/fp16 value in the same pass, for all params of a param group in one launch (a table
of the tensors' addresses, cached while they do not move) (30 bytes per parameter, the floor
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
    def adam_kernel(table_ptr, block_tensor_ptr, block_start_ptr, scale_ptr, found_inf_ptr,
                    lr, beta1, beta2, eps, weight_decay, log_beta1, log_beta2,
                    ADAMW: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        # One program per BLOCK elements of one tensor; the table row of tensor t holds the addresses of
        # its param, grad, exp_avg, exp_avg_sq, model copy (0: none) and step, and its element count.
        block = tl.program_id(0)
        row = table_ptr + tl.load(block_tensor_ptr + block).to(tl.int64) * 7
        param_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        out_address = tl.load(row + 4)
        step = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))
        n = tl.load(row + 6)
        offsets = tl.load(block_start_ptr + block) + tl.arange(0, BLOCK)
        limit = tl.where(tl.load(found_inf_ptr) == 0, n, 0)  # found_inf: no element is updated
        mask = offsets < limit
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
        out_ptr = out_address.to(tl.pointer_type(OUT_DTYPE))
        out_limit = tl.where(out_address != 0, limit, 0)  # no model copy to write for this tensor
        tl.store(out_ptr + offsets, param.to(OUT_DTYPE), mask=offsets < out_limit)

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


class _LaunchTables:
    """Device tables of one param group's tensors and blocks, rebuilt only when an address changes."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def get(self, rows: list[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = tuple(rows)
        if key != self.key:
            counts = torch.tensor([-(-row[6] // _BLOCK) for row in rows], dtype=torch.int64)
            block_tensor = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), counts)
            first = torch.cumsum(counts, 0) - counts
            block_start = (torch.arange(int(counts.sum()), dtype=torch.int64)
                           - torch.repeat_interleave(first, counts)) * _BLOCK
            table = torch.tensor(rows, dtype=torch.int64).reshape(-1)
            self.tables = (table.to(device), block_tensor.to(device), block_start.to(device))
            self.key = key
        return self.tables


@torch.no_grad()
def triton_adam_step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor, found_inf: torch.Tensor,
                     model_targets: dict[int, torch.Tensor] | None = None) -> set[int]:
    """One Adam/AdamW step of every param with a gradient; returns the ids of the main params whose model
    copy (``model_targets[id(main)]``, a contiguous bf16/fp16 tensor of the same size) was written.

    ``grad_scale`` (gradients are divided by it) and ``found_inf`` (non-zero: skip everything, step counts
    included) are 1-element fp32 tensors on the params' device. One kernel launch per param group.
    """
    kernel, tl = _kernel(), _triton()[1]
    model_targets = model_targets or {}
    scale = grad_scale.reshape(1).to(torch.float32)
    skip = found_inf.reshape(1).to(torch.float32)
    written: set[int] = set()
    launch_tables = optimizer.__dict__.setdefault("_triton_adam_tables", {})
    for index, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [_state(optimizer, p) for p in params]
        torch._foreach_add_([s["step"] for s in states], 1.0 - skip.reshape(()))
        targets = [model_targets.get(id(p)) for p in params]
        out_dtypes = {t.dtype for t in targets if t is not None}
        if len(out_dtypes) > 1:
            raise ValueError(f"triton_adam_step: model copies of one param group in several dtypes {out_dtypes}")
        out_dtype = out_dtypes.pop() if out_dtypes else torch.bfloat16
        rows = []
        for p, state, target in zip(params, states, targets):
            if not (p.is_contiguous() and p.grad.is_contiguous()):
                raise ValueError("triton_adam_step needs contiguous params and gradients")
            write = target is not None and target.is_contiguous() and target.numel() == p.numel()
            rows.append((p.data_ptr(), p.grad.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                         target.data_ptr() if write else 0, state["step"].data_ptr(), p.numel()))
            if write:
                written.add(id(p))
        table, block_tensor, block_start = launch_tables.setdefault(index, _LaunchTables()).get(rows, params[0].device)
        beta1, beta2 = group["betas"]
        kernel[(block_tensor.numel(),)](
            table, block_tensor, block_start, scale, skip,
            float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            math.log(beta1), math.log(beta2),
            ADAMW=isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay")),
            OUT_DTYPE=tl.bfloat16 if out_dtype == torch.bfloat16 else tl.float16, BLOCK=_BLOCK,
        )
    return written
