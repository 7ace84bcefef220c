"""An optimizer's state in model space for sharded checkpoints (any optimizer layout).

Every per-parameter state (``exp_avg``, ``exp_avg_sq``, ... and ``fp32_param``, the fp32 main copy
when the model is bf16/fp16) is stored as a tensor shaped like the parameter's TP shard, under
``optimizer.state.<name>.<model key>`` and sharded like the parameter (Megatron-Core's
``fully_reshardable`` format), so it reshards across TP, PP, DP and with or without the
distributed optimizer. Besides the tensors only the step count (and a grad scaler's state) is
stored: param-group hyperparameters come from the optimizer config and the scheduler, and the
order of groups differs between pipeline stages.

The functions here are the shared half of ``MegatronOptimizer.sharded_state_dict`` and
``load_state_dict``; each optimizer class supplies its half through three hooks:
``_checkpoint_entries`` (which main tensor holds each model parameter), ``_checkpoint_full``
(flat main-space value -> whole TP-local tensor, e.g. assembled over DP ranks) and
``_checkpoint_local`` (the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.dict_utils import nested_path_items
from megatron_core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron_core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

MAIN_PARAM = "fp32_param"


@dataclass
class ParamStateEntry:
    """One model parameter as one optimizer holds it.

    ``main`` is the tensor the inner optimizer updates (``None`` when another DP rank owns every
    element); ``param_range`` is its flat ``[start, end)`` slice of the parameter (``None``: whole).
    """

    model_param: torch.Tensor
    main: torch.Tensor | None
    param_range: tuple[int, int] | None = None


def model_params_and_paths(model_sharded_state_dict: dict) -> tuple[list[torch.Tensor], dict[int, Any], dict[int, Any]]:
    """Parameters in state-dict order, their sharded tensors and their (unique, local) state-dict paths.

    Layers stacked on a global axis share one ShardedTensor key, so the path names the entry. A parameter saved as
    slices along its first dimension (the grouped experts' ``weight [E, ..]``, one entry per expert, each naming
    ``sliced_param`` and its ``slice_index``) has ``{index: sharded tensor}`` and ``{index: path}`` instead.
    """
    params, sharded, paths = [], {}, {}
    for path, sh in nested_path_items(model_sharded_state_dict):
        whole = getattr(sh, "sliced_param", None)
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and isinstance(whole, torch.nn.Parameter):
            if id(whole) not in sharded:
                params.append(whole)
                sharded[id(whole)], paths[id(whole)] = {}, {}
            sharded[id(whole)][sh.slice_index] = sh
            paths[id(whole)][sh.slice_index] = ".".join(map(str, path))
            continue
        # An FSDP2 parameter's entry holds its local rows; ``fsdp_param`` is the DTensor parameter. An FP8
        # parameter's entry holds its dequantized value; ``fp8_param`` is the parameter.
        param = getattr(sh, "fsdp_param", getattr(sh, "fp8_param", getattr(sh, "data", None)))
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and isinstance(param, torch.nn.Parameter):
            if id(param) not in sharded:
                params.append(param)
                sharded[id(param)] = sh
                paths[id(param)] = ".".join(map(str, path))
    return params, sharded, paths


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor, else the tensor itself."""
    return tensor._local_tensor if hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local") else tensor


def is_model_space_state(state_dict: Any) -> bool:
    """Whether ``state_dict`` is a loaded model-space checkpoint state (not a plain ``state_dict()``)."""
    inner = state_dict.get("optimizer") if isinstance(state_dict, dict) else None
    return isinstance(inner, dict) and "step" in inner and "param_groups" not in inner


def _state_names(opt: Any) -> list[str]:
    names = {name for state in opt.optimizer.state.values() for name in state if name != "step"}
    return sorted(set().union(*collectives.all_gather_object(names)))


def _step(opt: Any) -> int:
    """Adam's step count (0 before the first step; a distributed-optimizer rank may own no state)."""
    steps = [int(state["step"]) for state in opt.optimizer.state.values() if "step" in state]
    return max(steps, default=0)


def _main_space_value(opt: Any, entry: ParamStateEntry, name: str) -> torch.Tensor | None:
    if entry.main is None:
        return None
    if name == MAIN_PARAM:
        return entry.main.detach()
    value = opt.optimizer.state.get(entry.main, {}).get(name)
    if value is None:
        return torch.zeros_like(entry.main, dtype=torch.float32)
    if value.numel() != entry.main.numel():
        raise ValueError(
            f"sharded optimizer state: state {name!r} has shape {tuple(value.shape)}, not its parameter's "
            f"{tuple(entry.main.shape)}; sharded checkpoints hold parameter-shaped states only (e.g. "
            "adaptive_muon_moment2_method='normuon' keeps one value per row: save it with state_dict())")
    return value


def _keys_and_dotted_prefixes(keys: set[str]) -> set[str]:
    """``keys`` and every dotted prefix of each (``a.b.c`` gives ``a``, ``a.b``, ``a.b.c``): a factory's model key
    is the prefix of the sub-keys it saved under."""
    out: set[str] = set()
    for key in keys:
        parts = key.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def _saved_with(saved_keys_and_prefixes: set[str], sh: Any) -> bool:
    """Whether the model key of ``sh`` (a sharded tensor or ``{slice: sharded tensor}``) is among the saved keys
    or a dotted prefix of one (``saved_keys_and_prefixes`` from :func:`_keys_and_dotted_prefixes`)."""
    return any(s.key in saved_keys_and_prefixes for s in (sh.values() if isinstance(sh, dict) else [sh]))


def build_sharded_state(opt: Any, model_sharded_state_dict: dict, is_loading: bool,
                        state_names: list[str] | dict[str, set[str]] | None) -> dict[str, Any]:
    """``{"state": {path: {name: sharded tensor}}, "step": int[, "grad_scaler": ...]}`` of a leaf optimizer.

    When loading, ``state_names`` (read from the checkpoint) says which states to allocate: a list for every
    parameter, or ``{name: model keys saved with it}`` where parameters differ (Muon's momentum next to Adam's
    moments); a checkpoint without ``fp32_param`` (an fp32 model) refreshes the main params from the model.
    Remembers the parameter of every path for :func:`load_model_space_state`.
    """
    params, sharded, paths = model_params_and_paths(model_sharded_state_dict)
    names = list(state_names or []) if is_loading else _state_names(opt)
    entries = opt._checkpoint_entries(params)
    if not is_loading and any(e.model_param.dtype != torch.float32 for e in entries):
        names = sorted(set(names) | {MAIN_PARAM})
    saved_by_name = ({name: _keys_and_dotted_prefixes(keys) for name, keys in state_names.items()}
                     if is_loading and isinstance(state_names, dict) else None)
    states: dict[str, Any] = {}
    for e in entries:
        values = {}
        sh, path = sharded[id(e.model_param)], paths[id(e.model_param)]
        for name in names:
            if saved_by_name is not None and not _saved_with(saved_by_name[name], sh):
                continue
            if is_loading:
                local = local_tensor(e.model_param)
                values[name] = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            else:
                values[name] = opt._checkpoint_full(e, _main_space_value(opt, e, name))
        if isinstance(sh, dict):  # saved as slices along dim 0: the states too
            for i in sorted(sh):
                states[path[i]] = {name: make_sharded_optimizer_tensor(sh[i], value[i], f"optimizer.state.{name}")
                                   for name, value in values.items()}
        else:
            states[path] = {name: make_sharded_optimizer_tensor(sh, value, f"optimizer.state.{name}")
                            for name, value in values.items()}
    opt._checkpoint_param_paths = {_path_key(paths[id(p)]): p for p in params}
    leaf: dict[str, Any] = {"state": states, "step": 0 if is_loading else max(collectives.all_gather_object(_step(opt)))}
    scaler = getattr(opt, "grad_scaler", None)
    if scaler is not None:
        leaf["grad_scaler"] = scaler.state_dict()
    return leaf


def _path_key(path: str | dict[int, str]) -> str | tuple[str, ...]:
    """A parameter's path, or the paths of its slices in order."""
    return tuple(path[i] for i in sorted(path)) if isinstance(path, dict) else path


def _loaded_states(states: dict[str, Any], path: str | tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The loaded states of the parameter at ``path`` (a sliced parameter's slices stacked along dim 0)."""
    if not isinstance(path, tuple):
        return states[path]
    return {name: torch.stack([states[p][name] for p in path]) for name in states[path[0]]}


def load_model_space_state(opt: Any, leaf: dict[str, Any]) -> None:
    """Copy a loaded leaf (see :func:`build_sharded_state`) into ``opt``: this rank's slices and the step."""
    path_of = getattr(opt, "_checkpoint_param_paths", None)
    if path_of is None:
        raise RuntimeError(f"{type(opt).__name__}.load_state_dict got a sharded checkpoint state: call "
                           "sharded_state_dict(model_sharded_state_dict, is_loading=True) first")
    path_by_param = {id(p): path for path, p in path_of.items()}
    step = int(leaf["step"])
    has_main = False
    for e in opt._checkpoint_entries(list(path_of.values())):
        if e.main is None:
            continue
        state: dict[str, Any] = {}
        main = local_tensor(e.main)
        for name, full in _loaded_states(leaf["state"], path_by_param[id(e.model_param)]).items():
            value = opt._checkpoint_local(e, full).reshape(main.shape).to(main.device)
            if name == MAIN_PARAM:
                main.data.copy_(value)
                has_main = True
            elif main is not e.main:  # FSDP2: the optimizer's state is a DTensor sharded like the param
                state[name] = type(e.main).from_local(value.clone(), e.main.device_mesh, e.main.placements,
                                                      shape=e.main.shape, stride=e.main.stride())
            else:  # keep the optimizer's storage dtype (bf16 moments of the precision-aware optimizer)
                state[name] = value.to(getattr(opt.optimizer, f"{name}_dtype", value.dtype)).clone()
        if state:
            state["step"] = torch.tensor(float(step))
            opt.optimizer.state[e.main] = state
        else:  # saved before the first step: no moments, so a fresh state (Adam initialises it on its step)
            opt.optimizer.state.pop(e.main, None)
    if not has_main:
        opt.reload_model_params()
    scaler = getattr(opt, "grad_scaler", None)
    if scaler is not None and "grad_scaler" in leaf:
        scaler.load_state_dict(leaf["grad_scaler"])
