"""Optimizer state in model space for ``save_checkpoint``/``load_checkpoint`` (any optimizer layout).

Every per-parameter state (``exp_avg``, ``exp_avg_sq``, ... and ``fp32_param``, the fp32 main
copy when the model is bf16/fp16) is stored as a tensor shaped like the parameter's TP shard,
under ``optimizer.state.<name>.<model key>`` and sharded like the parameter (Megatron-Core's
``fully_reshardable`` format), so it reshards across TP, PP, DP and with or without the
distributed optimizer. A distributed optimizer's flat DP slices are assembled into whole tensors
(one all-reduce over the DP group per parameter and state) before saving and sliced after loading.

Besides the tensors only the step count is stored: param-group hyperparameters (lr, weight decay)
come from the optimizer config and the scheduler, and group order differs between pipeline stages.

The optimizer is read through the attributes of Megatron-Core's wrappers: ``optimizer`` (the
``torch.optim`` optimizer), ``float16_groups``/``fp32_from_float16_groups`` (mixed precision),
``shard_groups`` with ``model_param``/``main_param``/``param_range`` entries and
``data_parallel_group`` (distributed optimizer), ``chained_optimizers`` (a chain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.dict_utils import nested_items_iter
from megatron_core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron_core.dist_checkpointing.optimizer import (
    dp_flat_shard_to_full,
    full_to_dp_flat_shard,
    make_sharded_optimizer_tensor,
)

MAIN_PARAM = "fp32_param"


@dataclass
class _Entry:
    """One model parameter as one optimizer sees it (``main`` is ``None`` when another DP rank owns it)."""

    model_param: torch.Tensor
    main: torch.Tensor | None
    param_range: tuple[int, int] | None
    group_index: int


def _leaf_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed(opt: Any) -> bool:
    return hasattr(opt, "shard_groups")


def _entries(opt: Any, model_params: list[torch.Tensor]) -> list[_Entry]:
    """Entries in ``model_params`` order (the same order on every rank)."""
    found: dict[int, _Entry] = {}
    if _is_distributed(opt):
        for gi, group in enumerate(opt.shard_groups):
            for e in group:
                found[id(e.model_param)] = _Entry(e.model_param, e.main_param,
                                                  (e.param_range.start, e.param_range.end), gi)
        groups_of = {id(p): gi for gi, g in enumerate(opt.shard_groups) for p in (e.model_param for e in g)}
        return [found.get(id(p)) or _Entry(p, None, None, groups_of.get(id(p), -1))
                for p in model_params if p.requires_grad]
    main_to_model = {}
    for model_group, main_group in zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])):
        main_to_model.update({id(main): model for model, main in zip(model_group, main_group)})
    for gi, group in enumerate(opt.optimizer.param_groups):
        for main in group["params"]:
            model = main_to_model.get(id(main), main)
            found[id(model)] = _Entry(model, main, None, gi)
    return [found[id(p)] for p in model_params if id(p) in found]


def _model_params_and_keys(model_sharded_sd: dict) -> tuple[list[torch.Tensor], dict[int, Any], dict[int, str]]:
    """Parameters in state-dict order, their ShardedTensors and their (unique, local) state-dict paths.

    Layers stacked on a global axis share one ShardedTensor key, so the path names the entry.
    """
    params, sharded, paths = [], {}, {}
    for path, sh in nested_items_iter(model_sharded_sd):
        # An FSDP2 parameter's entry holds its local rows; ``fsdp_param`` is the DTensor parameter.
        param = getattr(sh, "fsdp_param", getattr(sh, "data", None))
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and isinstance(param, torch.nn.Parameter):
            if id(param) not in sharded:
                params.append(param)
                sharded[id(param)] = sh
                paths[id(param)] = ".".join(map(str, path))
    return params, sharded, paths


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor, else the tensor itself."""
    return tensor._local_tensor if hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local") else tensor


def _state_names(opt: Any) -> list[str]:
    names = {name for state in opt.optimizer.state.values() for name in state if name != "step"}
    return sorted(set().union(*collectives.all_gather_object(names)))


def _step(opt: Any) -> int:
    """Adam's step count (0 before the first step; a distributed-optimizer rank may own no state)."""
    steps = [int(state["step"]) for state in opt.optimizer.state.values() if "step" in state]
    return max(steps, default=0)


def optimizer_sharded_state_dict(optimizer: Any, model_sharded_sd: dict, is_loading: bool = False,
                                 state_names: list[str] | None = None) -> dict:
    """The optimizer's sharded state dict in model space (see the module docstring).

    When loading, ``state_names`` (read from the checkpoint) says which states to allocate; a
    checkpoint without ``fp32_param`` (an fp32 model) refreshes the main params from the model.
    """
    params, sharded, paths = _model_params_and_keys(model_sharded_sd)
    out: dict[str, Any] = {}
    for index, opt in enumerate(_leaf_optimizers(optimizer)):
        names = list(state_names) if is_loading else _state_names(opt)
        entries = _entries(opt, params)
        if not is_loading and any(e.model_param.dtype != torch.float32 for e in entries):
            names = sorted(set(names) | {MAIN_PARAM})
        states: dict[str, Any] = {}
        for e in entries:
            key = paths[id(e.model_param)]
            per_param = {}
            for name in names:
                if is_loading:
                    local = _local(e.model_param)
                    value = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
                else:
                    value = _model_space_value(opt, e, name)
                per_param[name] = make_sharded_optimizer_tensor(sharded[id(e.model_param)], value,
                                                                f"optimizer.state.{name}")
            states[key] = per_param
        step = 0 if is_loading else max(collectives.all_gather_object(_step(opt)))
        leaf: dict[str, Any] = {"state": states, "step": step}
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            leaf["grad_scaler"] = scaler.state_dict()
        out[f"optimizer{index}" if index else "optimizer"] = leaf
    return out


def _model_space_value(opt: Any, e: _Entry, name: str) -> torch.Tensor:
    if e.main is None:
        flat = None
    elif name == MAIN_PARAM:
        flat = e.main.detach()
    else:
        flat = opt.optimizer.state.get(e.main, {}).get(name)
        if flat is None:
            flat = torch.zeros_like(e.main, dtype=torch.float32)
    if not _is_distributed(opt):
        return _local(flat.detach()).float().clone()
    if flat is None:
        flat = torch.zeros(0, dtype=torch.float32, device=e.model_param.device)
    param_range = e.param_range or (0, 0)
    # Offloaded (CPU) shards join the all-reduce on the model's device.
    return dp_flat_shard_to_full(flat.detach().float().to(e.model_param.device), param_range, e.model_param.shape,
                                 opt.data_parallel_group)


def load_optimizer_state(optimizer: Any, model_sharded_sd: dict, loaded: dict) -> None:
    """Copy a loaded model-space optimizer state dict into ``optimizer`` (this rank's slices)."""
    params, sharded, paths = _model_params_and_keys(model_sharded_sd)
    for index, opt in enumerate(_leaf_optimizers(optimizer)):
        leaf = loaded[f"optimizer{index}" if index else "optimizer"]
        step = int(leaf["step"])
        has_main = False
        for e in _entries(opt, params):
            if e.main is None:
                continue
            values = leaf["state"][paths[id(e.model_param)]]
            state = opt.optimizer.state.setdefault(e.main, {})
            main = _local(e.main)
            for name, full in values.items():
                value = full if e.param_range is None else full_to_dp_flat_shard(full, e.param_range)
                value = value.reshape(main.shape).to(main.device)
                if name == MAIN_PARAM:
                    main.data.copy_(value)
                    has_main = True
                elif main is not e.main:  # FSDP2: the optimizer's state is a DTensor sharded like the param
                    state[name] = type(e.main).from_local(value.clone(), e.main.device_mesh, e.main.placements,
                                                          shape=e.main.shape, stride=e.main.stride())
                else:  # keep the optimizer's storage dtype (bf16 moments of the precision-aware optimizer)
                    state[name] = value.to(getattr(opt.optimizer, f"{name}_dtype", value.dtype)).clone()
            state["step"] = torch.tensor(float(step))
        if not has_main:
            opt.reload_model_params()
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None and "grad_scaler" in leaf:
            scaler.load_state_dict(leaf["grad_scaler"])
