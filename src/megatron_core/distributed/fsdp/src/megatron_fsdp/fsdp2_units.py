"""How ``fully_shard`` lays a module out on PyTorch FSDP2: meshes, units and meta-device materialisation.

Each Megatron-FSDP sharding strategy becomes an FSDP2 mesh and resharding policy:

- ``optim_grads_params`` (ZeRO-3): the shard mesh, ``reshard_after_forward=True``;
- ``optim_grads`` (ZeRO-2) and ``optim`` (ZeRO-1): the shard mesh, ``reshard_after_forward=False``
  (``optim`` also keeps the gathered weights and the unreduced gradients through gradient
  accumulation, see ``megatron_fsdp``);
- ``no_shard``: a 2-D ``(replicate, shard)`` mesh whose shard dimension has size 1, so every rank holds
  every weight and FSDP2 all-reduces gradients across the replicate dimension, as DDP does.

With HSDP (``dp_outer_dim``) the mesh is ``(dp_outer, dp_shard)``: FSDP2 shards over the inner
dimension and replicates over the outer one (``no_shard`` replicates over both).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from megatron_core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

__all__ = ["cast_parameters", "fsdp2_mesh", "materialize_meta_module", "shard_units"]

_MESH_COUNT = itertools.count()


def fsdp2_mesh(dist_index: FSDPDistributedIndex, strategy: str) -> DeviceMesh:
    """The mesh FSDP2 shards over for ``strategy`` (see the module docstring)."""
    mesh = dist_index.device_mesh
    if strategy != "no_shard":
        if dist_index.use_hybrid_fsdp:
            return mesh[(dist_index.dp_outer_dim, dist_index.dp_shard_dim)]
        return mesh[dist_index.dp_shard_dim]
    group = dist_index.get_dp_group()
    ranks = dist.get_process_group_ranks(group)
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    # A fresh name per mesh: torch caches meshes by ranks and names, which would revive destroyed groups.
    n = next(_MESH_COUNT)
    return DeviceMesh.from_group([group, alone], mesh.device_type, mesh=torch.tensor(ranks).view(-1, 1),
                                 mesh_dim_names=(f"mfsdp_replicate{n}", f"mfsdp_shard{n}"))


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every floating-point parameter ``dtype`` (their attributes and ties kept; buffers untouched)."""
    new: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in new:
                cast = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                cast.__dict__.update(vars(param))
                new[id(param)] = cast
            sub._parameters[name] = new[id(param)]


def shard_units(module: torch.nn.Module, unit_types: Sequence[type], mesh: DeviceMesh, reshard_after_forward: bool,
                policy: TorchMixedPrecisionPolicy) -> list[torch.nn.Module]:
    """Apply FSDP2 to every ``unit_types`` sub-module (innermost first), then to ``module``; return the units."""
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": policy}
    units = []
    for sub_module in reversed(list(module.modules())):
        if sub_module is not module and unit_types and isinstance(sub_module, tuple(unit_types)):
            fully_shard(sub_module, **kwargs)
            units.append(sub_module)
    fully_shard(module, **kwargs)
    units.append(module)
    return units


def _shard_rows(param: DTensor) -> tuple[int, int]:
    """``[start, end)`` rows of dim 0 held by this rank (``torch.chunk`` layout along the ``Shard(0)`` dim)."""
    rows = param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            size, rank = param.device_mesh.size(mesh_dim), param.device_mesh.get_local_rank(mesh_dim)
            chunk = -(-rows // size)
            start = min(rank * chunk, rows)
            return start, min(start + chunk, rows)
    return 0, rows


def _reset(module: torch.nn.Module, name: str) -> None:
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is None:
        raise ValueError(f"init_model_with_meta_device=True: module {name or '<root>'} "
                         f"({type(module).__name__}) owns meta parameters but has no reset_parameters or "
                         "_reset_parameters method to initialise them")
    reset()


def materialize_meta_module(module: torch.nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) storage of a module built on the meta device and initialise it.

    Modules are visited children first (the order their constructors ran in); each one that owns
    parameters gets full-size temporary tensors, runs its ``reset_parameters`` (or ``_reset_parameters``)
    on them and keeps this rank's rows, so the result equals building the module on ``device`` with the
    same seed while only one module's weights are ever whole. A module whose reset also writes its
    children's weights sees their current values.
    """
    meta_names = {name for name, p in module.named_parameters() if p.is_meta}
    if not meta_names:
        return
    module.to_empty(device=device)
    for name, owner in _post_order(module, ""):
        direct = [n for n, p in owner.named_parameters(recurse=False)
                  if _qualify(name, n) in meta_names]
        if not direct:
            continue
        swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.Tensor]] = []
        for sub in owner.modules():
            for pname, param in list(sub.named_parameters(recurse=False)):
                if sub is owner:
                    full = torch.empty(param.shape, dtype=param.dtype, device=device)
                else:
                    full = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
                sub._parameters[pname] = torch.nn.Parameter(full, requires_grad=param.requires_grad)
                swapped.append((sub, pname, param, full))
        try:
            with torch.no_grad():
                _reset(owner, name)
        finally:
            for sub, pname, param, _ in swapped:
                full = sub._parameters[pname].detach()
                sub._parameters[pname] = param
                with torch.no_grad():
                    if isinstance(param, DTensor):
                        start, end = _shard_rows(param)
                        local = param._local_tensor
                        if local.numel():
                            local.copy_(full[start:end].reshape(local.shape))
                    else:
                        param.copy_(full)


def _post_order(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` children first, siblings in registration order (the order constructors run in)."""
    for child_name, child in module.named_children():
        yield from _post_order(child, _qualify(prefix, child_name))
    yield prefix, module


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
