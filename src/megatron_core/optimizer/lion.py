"""``Lion`` (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of a momentum mix.

Megatron-Core 0.19 takes Lion from NVIDIA's emerging-optimizers for ``muon_scalar_optimizer="lion"`` (the
parameters Muon does not handle). Per parameter, with decoupled weight decay applied first::

    p <- p - lr * wd * p
    p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g

State: ``exp_avg`` (``m``) and an integer ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay (``lr``, ``betas=(beta1, beta2)``, ``weight_decay`` per param group)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.01) -> None:
        if lr < 0.0:
            raise ValueError(f"Lion: lr ({lr}) must be >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lion: betas[{i}] ({beta}) must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay ({weight_decay}) must be >= 0")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = True) -> None:
        """Create ``exp_avg`` and ``step`` for the group's params (only those with a gradient unless told)."""
        for p in group["params"]:
            if skip_non_grad_params and p.grad is None:
                continue
            if len(self.state[p]) == 0:
                self.state[p]["exp_avg"] = torch.zeros_like(p)
                self.state[p]["step"] = 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Lion update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_group(group)
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                exp_avg = state["exp_avg"]
                p.add_(torch.sign(exp_avg.lerp(p.grad, 1.0 - beta1)), alpha=-lr)
                exp_avg.lerp_(p.grad, 1.0 - beta2)
        return loss
