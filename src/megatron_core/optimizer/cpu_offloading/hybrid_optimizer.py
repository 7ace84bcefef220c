"""``HybridDeviceOptimizer``: one optimizer whose parameters are updated partly on the host (Megatron-Core 0.19).

Walking the param groups in order, the first parameters on the device are *offloaded* until about
``offload_fraction`` of the device elements are: each gets a CPU copy (fp32 with ``param_update_in_fp32``,
pinned on CUDA with ``pin_cpu_params``) that ``cpu_optimizer_cls`` updates; the others are updated in place by
``gpu_optimizer_cls`` (on an fp32 copy when ``param_update_in_fp32`` and the parameter is not fp32). Each step
copies the offloaded gradients to the host, steps the sub-optimizers and copies the updated values back (a
step post-hook on every sub-optimizer). With ``overlap_cpu_optimizer_d2h_h2d`` every offloaded parameter has a
CPU optimizer of its own, so its update starts as soon as its gradient has arrived, and on CUDA the copies run
on two side streams.

Which side is "the device": the parameters not on the CPU. When every parameter is on the CPU (a CPU-only
machine) the CPU plays the device, so offloading still makes separate host copies updated by
``cpu_optimizer_cls``; streams, events and pinned memory are used only for CUDA parameters. CPU parameters beside
CUDA ones are updated by the CPU optimizer directly.

``state`` is keyed by the original parameters and holds the sub-optimizers' own state dicts (plus
``master_param``, the fp32 copy, with ``param_update_in_fp32``), so ``state_dict`` / ``load_state_dict`` work in
the model's parameter space. As in Megatron-Core, ``defaults`` (and so every param group and ``state_dict``)
carries the constructor's arguments, optimizer classes included.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from numbers import Real
from typing import Any

import torch

__all__ = ["HybridDeviceOptimizer"]

_CLASS_KEYS = ("cpu_optimizer_cls", "gpu_optimizer_cls")  # group entries saved as qualified names


def _param_generator(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of ``optimizer``, group by group."""
    for group in optimizer.param_groups:
        yield from group["params"]


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the update uses: ``decoupled_grad`` when the parameter has that attribute, else ``grad``."""
    return getattr(param, "decoupled_grad", param.grad)


def _check_offload_fraction(offload_fraction: Any) -> None:
    if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, Real) \
            or not 0.0 <= float(offload_fraction) <= 1.0:
        raise ValueError(f"HybridDeviceOptimizer: offload_fraction ({offload_fraction!r}) must be a number in "
                         "[0, 1] (the share of the device parameters' elements updated on the CPU)")


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Update about ``offload_fraction`` of the device parameters' elements on the CPU, the rest on the device.

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``.
        offload_fraction: share (in ``[0, 1]``) of the device elements whose update runs on the CPU.
        cpu_optimizer_cls: optimizer class for the host copies (and for CPU parameters beside CUDA ones).
        gpu_optimizer_cls: optimizer class for the parameters kept on the device.
        param_update_in_fp32: update fp32 copies of non-fp32 parameters and write the result back.
        pin_cpu_grads / pin_cpu_params: pin the host gradient buffers / parameter copies (CUDA only).
        overlap_cpu_optimizer_d2h_h2d: one CPU optimizer per offloaded parameter, copies on side streams.
        **kwargs: hyperparameters (``lr``, ``weight_decay``, ...) given to both sub-optimizers via the groups.
    """

    def __init__(
        self,
        params: Iterable[Any],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **kwargs: Any,
    ) -> None:
        _check_offload_fraction(offload_fraction)
        super().__init__(params, defaults={
            "offload_fraction": offload_fraction,
            "cpu_optimizer_cls": cpu_optimizer_cls,
            "gpu_optimizer_cls": gpu_optimizer_cls,
            "param_update_in_fp32": param_update_in_fp32,
            "pin_cpu_grads": pin_cpu_grads,
            "pin_cpu_params": pin_cpu_params,
            "overlap_cpu_optimizer_d2h_h2d": overlap_cpu_optimizer_d2h_h2d,
            **kwargs,
        })
        self.offload_fraction = offload_fraction
        self.cpu_optimizer_cls = cpu_optimizer_cls
        self.gpu_optimizer_cls = gpu_optimizer_cls
        self.pin_cpu_grads = pin_cpu_grads
        self.pin_cpu_params = pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.param_update_in_fp32 = param_update_in_fp32
        self.sub_optimizer_kwargs = kwargs
        self._init_sub_optimizers()

    # ----------------------------------------------------------------------------------------------- building
    def _init_sub_optimizers(self) -> None:
        """Split the params, make the host / fp32 copies and build the sub-optimizers with their hooks."""
        (self.cpu_param_groups, self.gpu_param_groups, self.gpu_params_map_cpu_copy,
         self.cpu_copys_map_gpu_param, self.param_to_fp32_param) = \
            self._get_sub_optimizer_param_groups(self.offload_fraction)
        self.param_to_inner_param: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            for param in group["params"]:
                self.param_to_inner_param[param] = self.param_to_fp32_param.get(
                    param, self.gpu_params_map_cpu_copy.get(param, param))
        self.inner_param_to_orig_param = {inner: orig for orig, inner in self.param_to_inner_param.items()}
        self.fp32_param_to_orig_param = {v: k for k, v in self.param_to_fp32_param.items()}

        for cls, groups, name in ((self.cpu_optimizer_cls, self.cpu_param_groups, "cpu_optimizer_cls"),
                                  (self.gpu_optimizer_cls, self.gpu_param_groups, "gpu_optimizer_cls")):
            if cls is None and groups:
                count = sum(p.numel() for g in groups for p in g["params"])
                raise ValueError(f"HybridDeviceOptimizer: {name} is None, but {count} parameter elements need it "
                                 f"(offload_fraction={self.offload_fraction})")
        if self.overlap_cpu_optimizer_d2h_h2d:
            self.cpu_optimizers = self.build_cpu_optimizer_list(self.cpu_optimizer_cls, self.cpu_param_groups)
        else:
            self.cpu_optimizers = [self.cpu_optimizer_cls(self.cpu_param_groups)] if self.cpu_param_groups else []
        self.gpu_optimizer = self.gpu_optimizer_cls(self.gpu_param_groups) if self.gpu_param_groups else None

        self.cpu_copy_map_grad: dict[torch.Tensor, torch.Tensor] = {}
        self._d2h_stream = self._h2d_stream = None
        if any(p.is_cuda for p in self.gpu_params_map_cpu_copy):
            self._d2h_stream = self._h2d_stream = torch.cuda.current_stream()
            if self.overlap_cpu_optimizer_d2h_h2d:
                self._d2h_stream, self._h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()
        self._cpu_optimizer_map_data_event: dict[torch.optim.Optimizer, Any] = {}
        self._register_param_copy_back_gpu_hook()

    @staticmethod
    def build_cpu_optimizer_list(cpu_optimizer_cls: type[torch.optim.Optimizer],
                                 cpu_param_groups: list[dict[str, Any]]) -> list[torch.optim.Optimizer]:
        """One ``cpu_optimizer_cls`` per parameter of ``cpu_param_groups`` (each keeps its group's settings)."""
        optimizers = []
        for group in cpu_param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            params = group["params"]
            for param in [params] if isinstance(params, torch.Tensor) else params:
                optimizers.append(cpu_optimizer_cls([{**settings, "params": [param]}]))
        return optimizers

    def _get_sub_optimizer_param_groups(self, offload_fraction: float) -> tuple[
            list[dict[str, Any]], list[dict[str, Any]], dict[torch.Tensor, torch.Tensor],
            dict[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
        """Split every param group into its CPU and device parts; make the host and fp32 copies.

        Returns ``(cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy, cpu_copys_map_gpu_param,
        param_to_fp32_param)``.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        has_accelerator = any(p.device.type != "cpu" for p in params)

        def on_device(param: torch.Tensor) -> bool:
            return param.device.type != "cpu" or not has_accelerator

        threshold = offload_fraction * sum(p.numel() for p in params if on_device(p))
        offloaded = 0
        cpu_groups, gpu_groups = [], []
        param_to_copy, copy_to_param, param_to_fp32 = {}, {}, {}
        for group in self.param_groups:
            cpu_group, gpu_group = {**group, "params": []}, {**group, "params": []}
            for param in group["params"]:
                wants_fp32 = self.param_update_in_fp32 and param.dtype != torch.float32
                if on_device(param) and offloaded < threshold:
                    offloaded += param.numel()
                    inner = torch.empty(param.shape, dtype=torch.float32 if wants_fp32 else param.dtype,
                                        device="cpu", pin_memory=self.pin_cpu_params and param.is_cuda)
                    inner.copy_(param.detach())
                    param_to_copy[param], copy_to_param[inner] = inner, param
                    cpu_group["params"].append(inner)
                else:
                    inner = param.detach().to(torch.float32) if wants_fp32 else param
                    (gpu_group if on_device(param) else cpu_group)["params"].append(inner)
                if wants_fp32:
                    param_to_fp32[param] = inner
            cpu_groups += [cpu_group] if cpu_group["params"] else []
            gpu_groups += [gpu_group] if gpu_group["params"] else []
        return cpu_groups, gpu_groups, param_to_copy, copy_to_param, param_to_fp32

    def _register_param_copy_back_gpu_hook(self) -> None:
        """After each sub-optimizer's step, write its updated copies back into the original parameters."""
        for optimizer in self.sub_optimizers:
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._copy_back(opt))

    def _copy_back(self, optimizer: torch.optim.Optimizer) -> None:
        host_pairs = []
        for inner in _param_generator(optimizer):
            orig = self.inner_param_to_orig_param[inner]
            if inner in self.cpu_copys_map_gpu_param:
                host_pairs.append((orig, inner))
            elif orig is not inner:
                orig.data.copy_(inner.data)
        if not host_pairs:
            return
        if self._h2d_stream is None:
            for orig, inner in host_pairs:
                orig.data.copy_(inner.data)
            return
        self._h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._h2d_stream):
            for orig, inner in host_pairs:
                orig.data.copy_(inner.data, non_blocking=True)
        torch.cuda.current_stream().wait_event(self._h2d_stream.record_event())

    # -------------------------------------------------------------------------------------------------- step
    def _set_sub_optimizer_grads(self) -> None:
        """Give the fp32 copies their (cast) gradients and copy the offloaded gradients to the host."""
        for param, fp32_param in self.param_to_fp32_param.items():
            if param not in self.gpu_params_map_cpu_copy:
                grad = _grad_of(param)
                fp32_param.grad = None if grad is None else grad.to(fp32_param.dtype)
        d2h = contextlib.nullcontext() if self._d2h_stream is None else torch.cuda.stream(self._d2h_stream)
        with d2h:
            for optimizer in self.cpu_optimizers:
                for inner in _param_generator(optimizer):
                    orig = self.cpu_copys_map_gpu_param.get(inner)
                    if orig is None:
                        continue  # a CPU parameter updated in place (or through its fp32 copy, done above)
                    grad = _grad_of(orig)
                    if grad is None:
                        inner.grad = None
                        continue
                    if inner not in self.cpu_copy_map_grad:
                        self.cpu_copy_map_grad[inner] = torch.empty(
                            inner.shape, dtype=inner.dtype, device="cpu",
                            pin_memory=self.pin_cpu_grads and orig.is_cuda)
                    buffer = self.cpu_copy_map_grad[inner]
                    buffer.copy_(grad, non_blocking=self._d2h_stream is not None)
                    inner.grad = buffer
                if self._d2h_stream is not None:
                    self._cpu_optimizer_map_data_event[optimizer] = self._d2h_stream.record_event()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Sync the hyperparameters, copy gradients to the host, step every sub-optimizer, gather their state.

        ``closure``, if given, runs once (with grad enabled) before anything else and its loss is returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hdo_param_groups_to_sub_optimizers()
        if self._d2h_stream is not None:
            self._d2h_stream.wait_stream(torch.cuda.current_stream())
        self._set_sub_optimizer_grads()
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.step()
        for cpu_optimizer in self.cpu_optimizers:
            event = self._cpu_optimizer_map_data_event.pop(cpu_optimizer, None)
            if event is not None:
                event.synchronize()
            cpu_optimizer.step()
        self._sync_sub_optimizers_state_to_hdo()
        return loss

    def dummy_step(self) -> None:
        """Step once on random gradients, then zero them: creates every state entry (before loading a checkpoint
        in place). The parameters change; load the checkpoint afterwards."""
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = torch.randn_like(param)
        self.step()
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the parameters' gradients, ``decoupled_grad`` included."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for param in group["params"]:
                if getattr(param, "decoupled_grad", None) is not None:
                    if set_to_none:
                        param.decoupled_grad = None
                    else:
                        param.decoupled_grad.zero_()

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The CPU optimizers followed by the device optimizer (when there is one)."""
        return self.cpu_optimizers + ([self.gpu_optimizer] if self.gpu_optimizer is not None else [])

    # -------------------------------------------------------------------------------------- groups and state
    def _sync_hdo_param_groups_to_sub_optimizers(self) -> None:
        """Copy this optimizer's group settings (``lr``, ``weight_decay``, ...) into the sub-optimizers' groups."""
        group_of = {p: group for group in self.param_groups for p in group["params"]}
        for optimizer in self.sub_optimizers:
            for sub_group in optimizer.param_groups:
                group = group_of[self.inner_param_to_orig_param[sub_group["params"][0]]]
                sub_group.update({k: v for k, v in group.items() if k != "params"})

    def _sync_sub_optimizers_state_to_hdo(self) -> None:
        """Rebuild ``state`` from the sub-optimizers' states, keyed by the original parameters."""
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for optimizer in self.sub_optimizers:
            for inner, param_state in optimizer.state.items():
                new_state[self.inner_param_to_orig_param[inner]] = param_state
                if self.param_update_in_fp32:
                    param_state["master_param"] = inner
        self.state = new_state

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """Hand ``state`` (e.g. after loading) to the sub-optimizers, on the devices of their parameters."""
        for optimizer in self.sub_optimizers:
            new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
            for inner in _param_generator(optimizer):
                orig = self.inner_param_to_orig_param[inner]
                if orig in self.state:
                    new_state[inner] = self.state[orig]
            optimizer.state = new_state
        self._update_fp32_params_by_new_state()
        self._move_new_state_to_right_device()

    def _update_fp32_params_by_new_state(self) -> None:
        """Write each state's ``master_param`` into the copy the sub-optimizer updates."""
        if not self.param_update_in_fp32:
            return
        for orig, param_state in self.state.items():
            inner, master = self.param_to_inner_param.get(orig), param_state.get("master_param")
            if inner is None or master is None:
                continue
            if master is not inner:
                inner.data.copy_(master)
            param_state["master_param"] = inner

    def _move_new_state_to_right_device(self) -> None:
        """Move state tensors (all but ``step``) to the device of the parameter their sub-optimizer updates."""
        for optimizer in self.sub_optimizers:
            for inner, param_state in optimizer.state.items():
                for key, value in param_state.items():
                    if key not in ("step", "master_param") and isinstance(value, torch.Tensor) \
                            and value.device != inner.device:
                        param_state[key] = value.to(inner.device)

    def update_fp32_param_by_new_param(self) -> None:
        """Refresh every fp32 and host copy from its original parameter (after the model weights were loaded)."""
        for orig, inner in self.param_to_inner_param.items():
            if inner is not orig:
                inner.data.copy_(orig.data)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict`` with the groups' optimizer classes written as their qualified names
        (``"torch.optim.adamw.AdamW"``), so that the file loads with ``torch.load(..., weights_only=True)``."""
        saved = super().state_dict()
        for group in saved["param_groups"]:
            for key in _CLASS_KEYS:
                if isinstance(group.get(key), type):
                    group[key] = f"{group[key].__module__}.{group[key].__qualname__}"
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict`` saved by a ``HybridDeviceOptimizer`` over the same parameters.

        The state is cast to the dtype and device of the copies the sub-optimizers update (fp32 master values
        are not rounded to the parameters' dtype), then the sub-optimizers are rebuilt around it. The optimizer
        classes stay this instance's (a saved group names them as strings).
        """
        swap = self.param_to_inner_param
        for group in self.param_groups:
            group["params"] = [swap.get(p, p) for p in group["params"]]
        try:
            super().load_state_dict(state_dict)
        finally:
            back = self.inner_param_to_orig_param
            for group in self.param_groups:
                group["params"] = [back.get(p, p) for p in group["params"]]
            restored: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
            restored.update({back.get(p, p): s for p, s in self.state.items()})
            self.state = restored
            for group in self.param_groups:
                group.update({"cpu_optimizer_cls": self.cpu_optimizer_cls, "gpu_optimizer_cls": self.gpu_optimizer_cls})
        self._init_sub_optimizers()
        self._sync_hdo_param_groups_to_sub_optimizers()
        self._sync_hdo_state_to_sub_optimizers()
