"""The flat state dict the ``fsdp_dtensor`` format hands to DCP, and the layouts it serves.

``model.<key>`` for every tensor of the model's ``state_dict()`` and ``optimizer.state.<key>.<state name>``
for every per-parameter optimizer state, keyed like the model (a grouped-experts parameter
``linear_fc1.weight [E, ...]`` gives one optimizer entry per expert, ``linear_fc1.weight<i>``, like its
state-dict keys); then experts are renamed to global indices and fused tensors split by the helpers of
:mod:`megatron_core.transformer.fsdp_dtensor_checkpoint`. Every value is a view of the live parameter or
state, so ``dcp.load`` into this dict restores the model and optimizer in place.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core._ground import get_pg_size, module_chain
from megatron_core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_core.transformer.fsdp_dtensor_checkpoint import (
    flatten_state_dict,
    handle_experts_in_state_dict,
    handle_fp8_extra_state_case,
    handle_gdn_in_state_dict,
    handle_swiglu_in_state_dict,
    innermost,
)

__all__ = ["check_fsdp_dtensor_layout", "fsdp_dtensor_state_dict", "init_optimizer_states"]

_OPTIMIZER_PREFIX = "optimizer.state."


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(sub, "optimizer", sub) for sub in subs]


def check_fsdp_dtensor_layout(model: Any, optimizer: Any) -> list[torch.nn.Module]:
    """The model chunks, after checking the format serves this layout; ``ValueError`` naming what it does not."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ValueError(f"ckpt_format='fsdp_dtensor' serves one model chunk, got {len(chunks)} (virtual pipeline)")
    if parallel_state.model_parallel_is_initialized():
        sizes = {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
                 "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
                 "context_parallel_size": parallel_state.get_context_parallel_world_size()}
        wrong = {k: v for k, v in sizes.items() if v != 1}
        if wrong:
            raise ValueError(f"ckpt_format='fsdp_dtensor' needs {', '.join(f'{k} 1 (got {v})' for k, v in wrong.items())}"
                             "; use the default ckpt_format='torch_dist', which reshards any layout")
    for wrapper in module_chain(chunks[0]):
        if isinstance(wrapper, DistributedDataParallel) and wrapper.ddp_config.use_distributed_optimizer:
            raise ValueError("ckpt_format='fsdp_dtensor' needs TorchFullyShardedDataParallel (or Megatron-FSDP's "
                             "optim_grads_params) or DistributedDataParallel with use_distributed_optimizer=False, "
                             "got use_distributed_optimizer=True (its state lives in flat shards); use "
                             "ckpt_format='torch_dist'")
    if optimizer is not None:
        params = {id(p) for p in innermost(chunks[0]).parameters()}
        for inner in _torch_optimizers(optimizer):
            foreign = [p for g in getattr(inner, "param_groups", []) for p in g["params"] if id(p) not in params]
            if foreign or not hasattr(inner, "state"):
                raise ValueError(
                    f"ckpt_format='fsdp_dtensor' needs an optimizer that updates the model parameters in place (FSDP2, "
                    f"or fp32 parameters with use_distributed_optimizer=False); {type(optimizer).__name__} keeps "
                    f"{len(foreign)} separate main parameters (e.g. bf16/fp16 with fp32 copies)")
    return chunks


def _param_keys(inner: torch.nn.Module, keys: set[str]) -> dict[int, list[tuple[str, int | None]]]:
    """``{id(param): [(state-dict key, index along dim 0 or None)]}``."""
    out: dict[int, list[tuple[str, int | None]]] = {}
    for name, param in inner.named_parameters():
        if name in keys:
            out[id(param)] = [(name, None)]
        elif f"{name}0" in keys and param.dim() >= 2:
            out[id(param)] = [(f"{name}{i}", i) for i in range(param.shape[0])]
    return out


def _optimizer_state(inner: torch.nn.Module, optimizer: Any, keys: set[str]) -> dict[str, Any]:
    by_param = _param_keys(inner, keys)
    state: dict[str, dict[str, Any]] = {}
    for torch_opt in _torch_optimizers(optimizer):
        for group in torch_opt.param_groups:
            for param in group["params"]:
                values = torch_opt.state.get(param)
                if not values:
                    continue
                for key, index in by_param[id(param)]:
                    state[key] = {name: (v[index] if index is not None and isinstance(v, torch.Tensor) and v.dim()
                                         else v) for name, v in values.items() if isinstance(v, torch.Tensor)}
    return {"state": state}


def _num_experts(inner: torch.nn.Module) -> tuple[int | None, Any]:
    """``(routed experts of the model, a pg_collection carrying their EP group)``; ``(None, None)`` without MoE."""
    for module in inner.modules():
        if hasattr(module, "num_local_experts") and hasattr(module, "ep_group"):
            return get_pg_size(module.ep_group) * module.num_local_experts, SimpleNamespace(ep=module.ep_group)
    return None, None


def fsdp_dtensor_state_dict(chunk: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The flat ``{DCP key: tensor}`` of ``chunk`` (and ``optimizer``'s states when given); see the module docstring."""
    inner = innermost(chunk)
    model_sd = {k: v for k, v in inner.state_dict().items() if isinstance(v, torch.Tensor)}
    handle_fp8_extra_state_case(model_sd)
    opt_sd = _optimizer_state(inner, optimizer, set(model_sd)) if optimizer is not None else None
    model_sd, opt_sd = handle_swiglu_in_state_dict(inner, model_sd, opt_sd)
    model_sd, opt_sd = handle_gdn_in_state_dict(inner, model_sd, opt_sd)
    num_experts, pgs = _num_experts(inner)
    if num_experts:
        model_sd = handle_experts_in_state_dict(model_sd, num_experts, pgs)
        if opt_sd is not None:
            opt_sd["state"] = handle_experts_in_state_dict(opt_sd["state"], num_experts, pgs)
    state: dict[str, Any] = {"model": model_sd}
    if opt_sd is not None:
        state["optimizer"] = opt_sd
    return flatten_state_dict(state)


def init_optimizer_states(chunk: torch.nn.Module, optimizer: Any, saved: dict[str, Any]) -> None:
    """Give every parameter without optimizer state zero-filled states of the names the checkpoint holds
    (``saved``: DCP's ``state_dict_metadata``), so a load has tensors to fill; scalar states (``step``) are 0-d."""
    names: dict[str, Any] = {}
    for key, md in saved.items():
        if key.startswith(_OPTIMIZER_PREFIX) and hasattr(md, "size"):
            names.setdefault(key.rsplit(".", 1)[1], md)
    if not names:
        return
    for torch_opt in _torch_optimizers(optimizer):
        for group in torch_opt.param_groups:
            for param in group["params"]:
                if torch_opt.state.get(param):
                    continue
                torch_opt.state[param] = {
                    name: (torch.zeros((), dtype=md.properties.dtype) if len(md.size) == 0
                           else torch.zeros_like(param, dtype=md.properties.dtype).detach())
                    for name, md in names.items()}
