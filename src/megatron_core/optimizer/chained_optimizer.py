"""``ChainedOptimizer``: several optimizer wrappers stepped as one (Megatron-Core's, e.g. dense + expert).

The inf/nan check, the gradient norm (combined as ``sqrt(sum(norm_i^2))``), the clipping and the
skip on a non-finite norm are global over all sub-optimizers, so the chain behaves like one
optimizer over all parameters; so are the norms of separate grad-norm groups (:mod:`.grad_norm_groups`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_core.optimizer.checkpoint_state import is_model_space_state
from megatron_core.optimizer.clip_grads import get_grad_norm_fp32
from megatron_core.optimizer.grad_norm_groups import SEPARATE_GRAD_NORM_GROUPS, validate_grad_norm_group
from megatron_core.optimizer.megatron_optimizer import (
    MegatronOptimizer,
    clip_by_group_norms,
    combine_grad_norms,
)
from megatron_core.optimizer.proxy_dict import ProxyDict


class ChainedOptimizer(MegatronOptimizer):
    """Step a list of :class:`MegatronOptimizer` together."""

    def __init__(self, chained_optimizers: list[MegatronOptimizer]) -> None:
        # An empty chain is allowed (a rank without parameters of some kind), as in Megatron-Core; the config is
        # the first optimizer's (None when it has none, e.g. a plain torch optimizer).
        super().__init__(None, getattr(chained_optimizers[0], "config", None) if chained_optimizers else None)
        self.chained_optimizers = list(chained_optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every sub-optimizer's param groups, concatenated."""
        return [g for opt in self.chained_optimizers for g in opt.param_groups]

    @property
    def state(self) -> ProxyDict:
        """Every sub-optimizer's state, keyed ``(sub-optimizer index, param)``: a live view (0.19's ``ProxyDict``)."""
        return ProxyDict([opt.state for opt in self.chained_optimizers])

    def get_parameters(self) -> list[torch.Tensor]:
        """Every sub-optimizer's parameters."""
        return [p for opt in self.chained_optimizers for p in opt.get_parameters()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every sub-optimizer."""
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """The first sub-optimizer's loss scale."""
        return self.chained_optimizers[0].get_loss_scale()

    def reload_model_params(self) -> None:
        """Reload in every sub-optimizer."""
        for opt in self.chained_optimizers:
            opt.reload_model_params()

    def prepare_grads(self) -> bool:
        """Prepare every sub-optimizer; True if any found inf/nan."""
        found = [opt.prepare_grads() for opt in self.chained_optimizers]
        return any(found)

    def prepare_grads_checks_for_inf(self) -> bool:
        """True when every sub-optimizer's :meth:`prepare_grads` checks for inf/nan (all use grad scalers)."""
        return all(opt.prepare_grads_checks_for_inf() for opt in self.chained_optimizers)

    def get_grad_norm(self) -> float:
        """Global norm over every sub-optimizer."""
        return combine_grad_norms([opt.get_grad_norm() for opt in self.chained_optimizers])

    def get_grads_for_grad_norm(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
        """Every sub-optimizer's gradients of the main norm or of the named group."""
        return [g for opt in self.chained_optimizers for g in opt.get_grads_for_grad_norm(grad_norm_group)]

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any sub-optimizer has the group on any rank (each asks over its own grad-stats group)."""
        validate_grad_norm_group(grad_norm_group)
        return any([opt.has_grad_norm_group(grad_norm_group) for opt in self.chained_optimizers])

    def _grad_norm_of_group(self, grad_norm_group: str) -> float:
        """The group's norm over every sub-optimizer, each reduced over its own grad-stats group."""
        return combine_grad_norms([
            get_grad_norm_fp32(opt.get_grads_for_grad_norm(grad_norm_group),
                               grad_stats_parallel_group=opt.get_grad_stats_parallel_group())
            for opt in self.chained_optimizers])

    def _compute_grad_norms_by_group(self) -> dict[str, float]:
        """``{group: its norm over the chain}`` for every separate grad-norm group present."""
        self.grad_norms_by_group = {group: self._grad_norm_of_group(group) for group in SEPARATE_GRAD_NORM_GROUPS
                                    if self.has_grad_norm_group(group)}
        return self.grad_norms_by_group

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip every sub-optimizer by the global main norm and each separate group by its norm over the chain
        (not when the main norm is non-finite: ``step`` skips then); return the main norm."""
        grad_norm = self.get_grad_norm()
        self.grad_norms_by_group = {}
        if clip_grad > 0.0:
            self._compute_grad_norms_by_group()
        if math.isfinite(grad_norm):
            for opt in self.chained_optimizers:
                clip_by_group_norms(opt.get_parameters(), clip_grad, grad_norm, self.grad_norms_by_group)
        return grad_norm

    def count_zeros(self) -> float:
        """Zero gradient elements over every sub-optimizer."""
        return sum(opt.count_zeros() for opt in self.chained_optimizers)

    def _step_takes_clip_factor(self) -> bool:
        # Clipping folds into the chain's step when it folds into every sub-optimizer's: one global factor for all.
        return bool(self.chained_optimizers) and all(opt._step_takes_clip_factor() for opt in self.chained_optimizers)

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return [inner for opt in self.chained_optimizers for inner in opt._inner_optimizers()]

    def _grad_norm_tensor(self) -> torch.Tensor:
        """The global norm over every sub-optimizer (each over its own statistics group), on the device."""
        return torch.stack([opt._grad_norm_tensor() for opt in self.chained_optimizers]).pow(2).sum().sqrt()

    def step_with_ready_grads(self) -> bool:
        """Step every sub-optimizer."""
        results = [opt.step_with_ready_grads() for opt in self.chained_optimizers]
        return all(results)

    def state_dict(self) -> list[dict[str, Any]] | dict[str, Any]:
        """One state dict per sub-optimizer (a single dict when there is one, as Megatron-Core does)."""
        states = [opt.state_dict() for opt in self.chained_optimizers]
        return states[0] if len(states) == 1 else states

    @staticmethod
    def _sharded_key(index: int) -> str:
        return f"optimizer{index}" if index else "optimizer"

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           **kwargs: Any) -> dict[str, Any]:
        """Every sub-optimizer's sharded state: the first under ``optimizer``, the i-th under ``optimizer<i>``."""
        return {
            self._sharded_key(i): opt.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)["optimizer"]
            for i, opt in enumerate(self.chained_optimizers)
        }

    def load_state_dict(self, state_dict: list[dict[str, Any]] | dict[str, Any]) -> None:
        """Restore every sub-optimizer (from :meth:`state_dict` or a loaded :meth:`sharded_state_dict`)."""
        if is_model_space_state(state_dict):
            for i, opt in enumerate(self.chained_optimizers):
                opt.load_state_dict({"optimizer": state_dict[self._sharded_key(i)]})
            return
        states = [state_dict] if isinstance(state_dict, dict) else list(state_dict)
        if len(states) != len(self.chained_optimizers):
            raise ValueError(f"got {len(states)} optimizer states for {len(self.chained_optimizers)} optimizers")
        for opt, state in zip(self.chained_optimizers, states):
            opt.load_state_dict(state)
