"""``PrecisionAwareAdam``: Adam/AdamW whose moments and main params may be stored in bf16/fp16.

The optimizer behind ``OptimizerConfig.use_precision_aware_optimizer`` (Megatron-Core uses
Transformer Engine's ``FusedAdam`` with ``exp_avg_dtype``/``exp_avg_sq_dtype``/
``master_weight_dtype``). Each step reads the parameter, its gradient and both moments, computes
the Adam update in fp32 and rounds the results back to their storage dtypes, so a bf16
``exp_avg``/``exp_avg_sq`` halves the optimizer state's bytes without changing the arithmetic.
Parameters may live on different devices (CPU-offloaded shards next to device shards): each
``(device, dtype)`` group is updated with ``torch._foreach`` ops on its own device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch


class PrecisionAwareAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode``: decoupled weight decay) with moments stored in ``exp_avg_dtype``/``exp_avg_sq_dtype``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adam_w_mode: bool = True,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid Adam hyperparameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.exp_avg_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.exp_avg_sq_dtype,
                                                   memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Adam step over every parameter with a gradient (fp32 arithmetic, rounded to storage dtypes)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            by_device: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for param in group["params"]:
                if param.grad is not None:
                    by_device[(param.device, param.dtype)].append(param)
            for params in by_device.values():
                states = [self._state_of(p) for p in params]
                for s in states:
                    s["step"] += 1
                step = float(states[0]["step"])
                if any(float(s["step"]) != step for s in states):
                    raise RuntimeError("PrecisionAwareAdam: params of one group have different step counts")
                grads = [p.grad.float() for p in params]
                masters = [p.float() for p in params]
                if not self.adam_w_mode and wd != 0:
                    grads = torch._foreach_add(grads, masters, alpha=wd)
                exp_avgs = [s["exp_avg"].float() for s in states]
                exp_avg_sqs = [s["exp_avg_sq"].float() for s in states]
                torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
                bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
                denom = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_div_(denom, math.sqrt(bias2))
                torch._foreach_add_(denom, eps)
                if self.adam_w_mode and wd != 0:
                    torch._foreach_mul_(masters, 1 - lr * wd)
                torch._foreach_addcdiv_(masters, exp_avgs, denom, -lr / bias1)
                for p, s, m, v, new in zip(params, states, exp_avgs, exp_avg_sqs, masters):
                    s["exp_avg"].copy_(m)
                    s["exp_avg_sq"].copy_(v)
                    p.copy_(new)
        return loss
