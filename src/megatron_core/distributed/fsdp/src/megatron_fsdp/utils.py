"""Which ranks shard and which replicate: ``FSDPDistributedIndex`` (0.19's ``megatron_fsdp.utils``).

The index keeps the user's ``DeviceMesh`` and the names of its dimensions: ``dp_shard_dim`` (parameters,
gradients and optimizer state are cut along it), ``dp_outer_dim`` (HSDP: replicas of the sharded model) and
``tp_dim``; ``hybrid_fsdp_group`` spans both data-parallel dimensions. Expert-parallel meshes and separate
all-gather groups are not served by :func:`~.fully_shard.fully_shard_model` and are not kept.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FSDPDistributedIndex", "import_class_from_path"]


class FSDPDistributedIndex:
    """The mesh dimensions and process groups of one ``fully_shard`` call (see the module docstring)."""

    def __init__(self, device_mesh: Any, dp_shard_dim: str, dp_outer_dim: str | None = None,
                 tp_dim: str | None = None, hybrid_fsdp_group: dist.ProcessGroup | None = None,
                 hsdp_outer_dp_shard: bool = False) -> None:
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.fsdp_group = device_mesh[dp_shard_dim].get_group()
        self.outer_fsdp_group = device_mesh[dp_outer_dim].get_group() if dp_outer_dim is not None else None
        self.hybrid_fsdp_group = hybrid_fsdp_group

    def get_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """The group parameters are sharded over (None for expert parameters: not served)."""
        return None if is_expert_parallel else self.fsdp_group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """The HSDP replica group (None without HSDP, or for expert parameters)."""
        return None if is_expert_parallel else self.outer_fsdp_group

    def get_dp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """Every data-parallel rank: the hybrid group under HSDP, else the shard group."""
        if is_expert_parallel:
            return None
        return self.hybrid_fsdp_group if self.use_hybrid_fsdp else self.fsdp_group

    def get_submesh(self, mesh_dim_names: str | tuple[str, ...], is_expert_parallel: bool = False) -> Any:
        """The sub-mesh of the named dimension(s) of the device mesh."""
        if is_expert_parallel:
            raise ValueError("FSDPDistributedIndex.get_submesh(is_expert_parallel=True): expert meshes are not "
                             "served by this fully_shard")
        return self.device_mesh[mesh_dim_names]

    def get_root_mesh(self) -> Any:
        """The device mesh passed to ``fully_shard`` (or the one it built)."""
        return self.device_mesh


def import_class_from_path(class_path: str) -> type[torch.nn.Module]:
    """The class named by a dotted path such as ``"torch.nn.Linear"``."""
    module_path, _, class_name = class_path.rpartition(".")
    if not module_path:
        raise ValueError(f"fsdp_unit_modules entry {class_path!r} must be a class or a dotted path "
                         "'package.module.ClassName'")
    cls = getattr(importlib.import_module(module_path), class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"fsdp_unit_modules entry {class_path!r} does not name a class")
    return cls
