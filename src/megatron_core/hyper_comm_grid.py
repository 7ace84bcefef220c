"""An N-dimensional grid of ranks with named axes that creates process groups on demand
(Megatron-Core's ``hyper_comm_grid.HyperCommGrid``).

``HyperCommGrid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"])`` lays ranks out like
``initialize_model_parallel(tp=2, cp=3, pp=4, order="tp-cp-pp-dp")``: the first name varies fastest.
``create_pg(["cp", "dp"])`` creates (once) the groups spanning those axes and returns this rank's;
``get_pg`` returns it later. ``register_view`` adds another factorisation of the same ranks whose
``shared_dims`` reuse the base grid's groups.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch.distributed as dist

logger = logging.getLogger(__name__)

_BASE_VIEW_NAME = "base"
_Key = Union[str, tuple[str, tuple[str, ...]]]


def _is_process_group_member(pg: dist.ProcessGroup | None) -> bool:
    """Whether this rank belongs to ``pg`` (``None`` and the non-member sentinel do not count)."""
    non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return pg is not None and pg is not non_member


@dataclass
class _RankViewSpec:
    """One factorisation of the grid's ranks."""

    name: str
    shape: list[int]
    dim_names: list[str]
    shared_dims: list[str] = field(default_factory=list)


class HyperCommGrid:
    """Named-axis rank grid; see the module docstring.

    ``rank_offset`` starts the grid at that global rank; ``backend`` is the backend of created groups
    (default: the default group's). The world size comes from ``WORLD_SIZE`` or the initialised
    default group.
    """

    def __init__(self, shape: list[int], dim_names: list[str], rank_offset: int = 0,
                 backend: str | None = None) -> None:
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"dim_names {dim_names} must be distinct")
        if any(not isinstance(s, (int, np.integer)) or s <= 0 for s in shape):
            raise ValueError(f"shape {shape} must hold positive integers")
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError("HyperCommGrid needs WORLD_SIZE set or torch.distributed initialized")
        self.rank_offset = rank_offset
        self.size = math.prod(shape)
        if self.size > world_size - rank_offset:
            raise RuntimeError(f"Grid shape {shape} is over sized ({self.size} ranks) with world size {world_size} "
                               f"and rank offset {rank_offset}")
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.backend = backend
        self._views = {_BASE_VIEW_NAME: _RankViewSpec(_BASE_VIEW_NAME, list(shape), list(dim_names))}
        self._pgs: dict[_Key, dist.ProcessGroup] = {}

    # -- rank enumeration -------------------------------------------------------------------
    def _gen_rank_enum_for(self, shape: list[int], dim_names: list[str], dims: list[str]) -> list[list[int]]:
        """Rank groups spanning ``dims`` of a (``shape``, ``dim_names``) factorisation."""
        reversed_names = dim_names[::-1]  # numpy: the last axis varies fastest
        sizes = dict(zip(dim_names, shape))
        ranks = np.arange(self.rank_offset, self.rank_offset + self.size).reshape([sizes[d] for d in reversed_names])
        source = [reversed_names.index(d) for d in dims]
        target = list(range(len(reversed_names) - len(dims), len(reversed_names)))
        ranks = np.moveaxis(ranks, source, target)
        return ranks.reshape(-1, math.prod(sizes[d] for d in dims)).tolist()

    def _gen_rank_enum(self, dims: list[str]) -> list[list[int]]:
        return self._gen_rank_enum_for(self.shape, self.dim_names, dims)

    @staticmethod
    def _order_dims_for(dim_names: list[str], dims: str | list[str]) -> tuple[list[str], str]:
        """``dims`` sorted slowest axis first (reverse of ``dim_names``), and the dash-joined key."""
        if not isinstance(dims, list):
            ordered = [dims]
        else:
            reversed_names = dim_names[::-1]
            ordered = [reversed_names[i] for i in sorted(reversed_names.index(d) for d in dims)]
        return ordered, "-".join(ordered)

    def _resolve_view(self, view: str | None) -> _RankViewSpec:
        name = _BASE_VIEW_NAME if view is None else view
        if name not in self._views:
            raise KeyError(f"view {name!r} is not registered; registered views: {sorted(self._views)}")
        return self._views[name]

    def _order_dims_for_view(self, view: _RankViewSpec, dims: str | list[str]) -> tuple[list[str], str]:
        requested = dims if isinstance(dims, list) else [dims]
        missing = [d for d in requested if d not in view.dim_names]
        if missing:
            raise ValueError(f"{missing[0]!r} is not in view {view.name!r} with dim_names {view.dim_names}")
        if len(set(requested)) != len(requested):
            raise ValueError(f"dims {requested} must be distinct")
        return self._order_dims_for(view.dim_names, dims)

    def _key_and_layout(self, view: _RankViewSpec, ordered: list[str]) -> tuple[_Key, _RankViewSpec, list[str]]:
        """Storage key, and the view and dims to enumerate (a view's shared dims use the base grid)."""
        if view.name == _BASE_VIEW_NAME:
            return "-".join(ordered), view, ordered
        if all(d in view.shared_dims for d in ordered):
            base = self._views[_BASE_VIEW_NAME]
            base_ordered, base_key = self._order_dims_for_view(base, ordered)
            return base_key, base, base_ordered
        return (view.name, tuple(ordered)), view, ordered

    # -- public API -------------------------------------------------------------------------
    def register_view(self, name: str, shape: list[int], dim_names: list[str],
                      shared_dims: list[str] | None = None) -> None:
        """Add a factorisation of the same ranks; each of ``shared_dims`` must give the base grid's groups."""
        if name in self._views:
            raise ValueError(f"view {name!r} is already registered")
        if len(shape) != len(dim_names) or len(set(dim_names)) != len(dim_names):
            raise ValueError(f"view {name!r}: shape {shape} and distinct dim_names {dim_names} must match in length")
        if any(not isinstance(s, (int, np.integer)) or s <= 0 for s in shape):
            raise ValueError(f"view {name!r} shape must be positive ints, got {shape}")
        if math.prod(shape) != self.size:
            raise ValueError(f"view {name!r} shape {shape} has {math.prod(shape)} ranks, the grid has {self.size}")
        shared = list(shared_dims or [])
        if len(set(shared)) != len(shared):
            raise ValueError(f"view {name!r} has duplicate shared_dims {shared}")
        for dim in shared:
            if dim not in self.dim_names or dim not in dim_names:
                raise ValueError(f"shared dim {dim!r} of view {name!r} must be in both {self.dim_names} and {dim_names}")
        for subset in [[d] for d in shared] + ([shared] if len(shared) > 1 else []):
            base = self._gen_rank_enum_for(self.shape, self.dim_names, self._order_dims_for(self.dim_names, subset)[0])
            mine = self._gen_rank_enum_for(shape, dim_names, self._order_dims_for(dim_names, subset)[0])
            if base != mine:
                raise ValueError(f"shared dims {subset} of view {name!r} group ranks {mine}, the base grid {base}")
        self._views[name] = _RankViewSpec(name, list(shape), list(dim_names), shared)

    def create_pg(self, dims: str | list[str], *, view: str | None = None, **kwargs: Any) -> dist.ProcessGroup | None:
        """Create the groups spanning ``dims`` (every rank must call it) and return this rank's.

        Keyword arguments go to ``torch.distributed.new_subgroups_by_enumeration`` (``timeout``,
        ``pg_options``, ``group_desc``). Creating the same groups twice raises ``KeyError``.
        """
        spec = self._resolve_view(view)
        ordered, _ = self._order_dims_for_view(spec, dims)
        key, layout, layout_dims = self._key_and_layout(spec, ordered)
        if key in self._pgs:
            raise KeyError(f"process group {dims} (view {spec.name!r}) was already created; use get_pg")
        enum = self._gen_rank_enum_for(layout.shape, layout.dim_names, layout_dims)
        pg, _ = dist.new_subgroups_by_enumeration(enum, backend=self.backend, **kwargs)
        if dist.get_rank() == 0:
            logger.info("HyperCommGrid: created groups %s with ranks %s", key, enum)
        self._pgs[key] = pg
        return pg

    def get_pg(self, dims: str | list[str], *, view: str | None = None) -> dist.ProcessGroup:
        """This rank's group spanning ``dims``; ``KeyError`` if ``create_pg`` was not called for it."""
        spec = self._resolve_view(view)
        ordered, _ = self._order_dims_for_view(spec, dims)
        key, _, _ = self._key_and_layout(spec, ordered)
        if key not in self._pgs:
            raise KeyError(f"process group {dims} (view {spec.name!r}) has not been created; call create_pg first")
        return self._pgs[key]

    def get_rank_enum(self, dims: str | list[str], *, view: str | None = None) -> list[list[int]]:
        """The rank groups ``create_pg(dims)`` would create (no communication)."""
        spec = self._resolve_view(view)
        ordered, _ = self._order_dims_for_view(spec, dims)
        return self._gen_rank_enum_for(spec.shape, spec.dim_names, ordered)

    def destroy(self) -> None:
        """Destroy every group this grid created that this rank belongs to (each once)."""
        done: set[int] = set()
        for pg in self._pgs.values():
            if _is_process_group_member(pg) and id(pg) not in done:
                dist.destroy_process_group(pg)
                done.add(id(pg))
        self._pgs.clear()

    def is_current_rank_in_grid(self) -> bool:
        """Whether this global rank lies in ``[rank_offset, rank_offset + size)``."""
        return self.rank_offset <= dist.get_rank() < self.rank_offset + self.size
