"""Megatron-Core's optimizer wrappers: the base class, fp32, mixed precision and chained optimizers.

A wrapper owns a torch optimizer (``AdamW``/``Adam``/``SGD``) and runs one training step as
``prepare_grads`` (copy ``param.main_grad`` into the tensors the optimizer updates, unscale, and
agree across ranks whether any gradient is inf/nan) -> clip by the global norm -> inner step ->
copy updated main params back into the model. ``step()`` returns
``(update_successful, grad_norm, num_zeros_in_grad)``. A step whose gradients hold an inf/nan is
skipped on every rank, leaving weights and optimizer state untouched: with a grad scaler (fp16)
``prepare_grads`` finds it and the step returns ``(False, None, None)``; without one (fp32, bf16)
the global gradient norm is non-finite on every rank (the gradients were reduced over data parallel
ranks, the norm is reduced over the grad-stats group) and the step returns ``(False, grad_norm, None)``. Megatron-Core's fp32/bf16 optimizers step on such a
norm; these do not. The norm is computed for this check even with clipping off (one reduction).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from megatron_core.distributed import collectives
from megatron_core.optimizer.chained_optimizer import ChainedOptimizer as ChainedOptimizer
from megatron_core.optimizer.checkpoint_state import (
    is_model_space_state,
    load_model_space_state,
)
from megatron_core.optimizer.grad_norm_groups import GRAD_NORM_GROUP_ATTR as GRAD_NORM_GROUP_ATTR
from megatron_core.optimizer.grad_norm_groups import MTP_GRAD_NORM_GROUP as MTP_GRAD_NORM_GROUP
from megatron_core.optimizer.grad_norm_groups import SEPARATE_GRAD_NORM_GROUPS as SEPARATE_GRAD_NORM_GROUPS
from megatron_core.optimizer.grad_scaler import MegatronGradScaler
from megatron_core.optimizer.megatron_optimizer import (
    _MODEL_PARALLEL_ATTRIBUTES as _MODEL_PARALLEL_ATTRIBUTES,
)
from megatron_core.optimizer.megatron_optimizer import MegatronOptimizer as MegatronOptimizer
from megatron_core.optimizer.megatron_optimizer import OutcomeCallback as OutcomeCallback
from megatron_core.optimizer.megatron_optimizer import (
    _param_group_override_keys as _param_group_override_keys,
)
from megatron_core.optimizer.megatron_optimizer import _zero_grad_group as _zero_grad_group
from megatron_core.optimizer.megatron_optimizer import combine_grad_norms as combine_grad_norms
from megatron_core.optimizer.megatron_optimizer import (
    copy_optimizer_param_metadata as copy_optimizer_param_metadata,
)
from megatron_core.optimizer.megatron_optimizer import copy_param_attributes as copy_param_attributes
from megatron_core.optimizer.megatron_optimizer import (
    param_group_identifier_keys as param_group_identifier_keys,
)
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.optimizer.proxy_dict import ProxyDict as ProxyDict


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Shared logic of optimizers with a grad scaler: unscale, detect inf/nan across ranks, skip."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: OptimizerConfig,
                 grad_scaler: MegatronGradScaler | None,
                 init_state_fn: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None) -> None:
        super().__init__(optimizer, config, init_state_fn)
        if config.fp16 and grad_scaler is None:
            raise ValueError("fp16=True needs a grad scaler (set loss_scale or keep the dynamic default)")
        self.grad_scaler = grad_scaler
        self._unit_scale = torch.tensor([1.0], dtype=torch.float32)

    def get_loss_scale(self) -> torch.Tensor:
        """The scaler's scale, or 1.0 when there is no scaler (bf16)."""
        return self._unit_scale if self.grad_scaler is None else self.grad_scaler.scale

    def prepare_grads_checks_for_inf(self) -> bool:
        """True with a grad scaler: :meth:`prepare_grads` unscales and checks the gradients on every rank."""
        return self.grad_scaler is not None

    @abstractmethod
    def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
        """The main gradients to unscale and check."""

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None:
        """Fill the main params' ``.grad`` from the model params' ``main_grad``."""

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated main params into the model params."""

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        grads = [g for g in self._collect_main_grad_data_for_unscaling() if g is not None]
        found_inf = torch.zeros(1, dtype=torch.float32)
        if grads:
            torch._foreach_mul_(grads, self.grad_scaler.inv_scale.item())
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            found_inf = (~finite).float().reshape(1).cpu()
        device_flag = found_inf.to(grads[0].device if grads else "cpu")
        collectives.all_reduce(device_flag, self.get_grad_stats_parallel_group(), op="max")
        return bool(device_flag.item() > 0)

    def prepare_grads(self) -> bool:
        """Copy gradients to main grads, unscale them and check for inf/nan (updating the scaler)."""
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        found_inf = self._unscale_main_grads_and_check_for_nan()
        self.grad_scaler.update(found_inf)
        return found_inf

    def step_with_ready_grads(self) -> bool:
        """Inner optimizer step, then copy main params into the model params."""
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16/bf16 model params with fp32 main params that the inner optimizer updates."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: MegatronGradScaler | None,
                 init_state_fn: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None) -> None:
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.float16_groups: list[list[torch.nn.Parameter]] = []
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            float16, fp32_from_float16, fp32 = [], [], []
            for i, param in enumerate(group["params"]):
                if param.dtype in (torch.float16, torch.bfloat16):
                    main = param.detach().clone().float()
                    main.requires_grad_(param.requires_grad)
                    copy_param_attributes(main, param)
                    param.main_param = main
                    group["params"][i] = main
                    float16.append(param)
                    fp32_from_float16.append(main)
                elif param.dtype == torch.float32:
                    fp32.append(param)
                else:
                    raise TypeError(f"optimizer params must be fp32, fp16 or bf16; got {param.dtype}")
            self.float16_groups.append(float16)
            self.fp32_from_float16_groups.append(fp32_from_float16)
            self.fp32_from_fp32_groups.append(fp32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop model and main gradients."""
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group(group, set_to_none)

    def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
        return [p.grad for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups)
                for group in groups for p in group if p.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                grad = getattr(model_param, "main_grad", None)
                grad = model_param.grad if grad is None else grad
                main_param.grad = None if grad is None else grad.float()
                model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for param in group:
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad

    def _copy_main_params_to_model_params(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                model_param.data.copy_(main_param.data)

    def reload_model_params(self) -> None:
        """Copy the model params into the fp32 main params."""
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                main_param.data.copy_(model_param.data)

    def state_dict(self) -> dict[str, Any]:
        """``optimizer``, ``grad_scaler`` (if any) and ``fp32_from_fp16_params`` (Megatron-Core's keys)."""
        state = {"optimizer": self.optimizer.state_dict(),
                 "fp32_from_fp16_params": [[p.detach().clone() for p in g] for g in self.fp32_from_float16_groups]}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def _main_to_model(self) -> dict[int, torch.Tensor]:
        return {id(main): model for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups)
                for model, main in zip(model_group, main_group)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore inner optimizer state, scaler and fp32 main params (or a loaded sharded state)."""
        if is_model_space_state(state_dict):
            load_model_space_state(self, state_dict["optimizer"])
            return
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved = state_dict["fp32_from_fp16_params"]
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError(
                f"fp32_from_fp16_params has group sizes {[len(g) for g in saved]}, expected "
                f"{[len(g) for g in self.fp32_from_float16_groups]}"
            )
        for main_group, saved_group in zip(self.fp32_from_float16_groups, saved):
            for main, value in zip(main_group, saved_group):
                main.data.copy_(value)
        self._copy_main_params_to_model_params()


class FP32Optimizer(MegatronOptimizer):
    """fp32 params updated in place; gradients are read from ``param.main_grad`` when DDP set it."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 init_state_fn: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None) -> None:
        super().__init__(optimizer, config, init_state_fn)
        self._scale = torch.tensor([1.0], dtype=torch.float32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the params' gradients."""
        for group in self.optimizer.param_groups:
            _zero_grad_group(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """Always 1.0."""
        return self._scale

    def prepare_grads(self) -> bool:
        """Point ``param.grad`` at ``param.main_grad``; never finds inf/nan (``step`` checks the grad norm)."""
        for param in self.get_parameters():
            if hasattr(param, "main_grad"):
                param.grad = param.main_grad
        return False

    def step_with_ready_grads(self) -> bool:
        """Inner optimizer step."""
        self.optimizer.step()
        return True

    def reload_model_params(self) -> None:
        """Nothing to do: the model params are the main params."""

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the inner optimizer's state dict (or a loaded sharded state)."""
        if is_model_space_state(state_dict):
            load_model_space_state(self, state_dict["optimizer"])
            return
        self.optimizer.load_state_dict(state_dict)
