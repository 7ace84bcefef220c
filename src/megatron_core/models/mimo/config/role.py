"""Which MIMO modules a rank runs, and at which pipeline stage of each.

``RankRole.build`` reads the ``module_to_grid_map`` of a ``MimoModelConfig``: no map, or every grid on the
same ranks, is the colocated layout (every module on every rank, one stage); grids on disjoint rank ranges
are the non-colocated layout (each rank runs the modules whose grid holds it, at the stage its ``pp``
coordinate gives).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch.distributed as dist

# The key of the language model in ``module_to_grid_map`` and ``RankRole.modules`` (there is exactly one).
MIMO_LANGUAGE_MODULE_KEY = "language"


class ModuleLayout(Enum):
    """How MIMO's modules are laid out over ranks.

    ``COLOCATED``: every module on every rank (no grid map, or grids over the same ranks).
    ``NON_COLOCATED``: grids over disjoint ranks; a rank runs the encoders or the language model.
    """

    COLOCATED = "colocated"
    NON_COLOCATED = "non_colocated"


@dataclass
class ModuleStageInfo:
    """Whether this rank holds the first and/or the last pipeline stage of one module."""

    is_first_stage: bool
    is_last_stage: bool


def _rank_range(grid: Any) -> range:
    return range(grid.rank_offset, grid.rank_offset + grid.size)


@dataclass
class RankRole:
    """The modules this rank takes part in (name -> ``ModuleStageInfo``) and the layout they follow."""

    modules: dict[str, ModuleStageInfo] = field(default_factory=dict)
    mode: ModuleLayout = ModuleLayout.COLOCATED

    @classmethod
    def build(cls, modality_module_names: list[str], module_to_grid_map: dict[str, Any] | None = None) -> RankRole:
        """The role of this rank: colocated without a grid map or when all grids share ranks, else per grid.

        Grids must either all span the same ranks or span pairwise disjoint ranks; a partial overlap
        raises ``ValueError`` naming the grids.
        """
        if not module_to_grid_map or cls._all_grids_colocated(module_to_grid_map):
            return cls._colocated(modality_module_names)
        cls._check_disjoint(module_to_grid_map)
        return cls._from_grid_map(module_to_grid_map)

    @staticmethod
    def _all_grids_colocated(module_to_grid_map: dict[str, Any]) -> bool:
        ranges = [_rank_range(g) for g in module_to_grid_map.values()]
        return all(r == ranges[0] for r in ranges[1:])

    @staticmethod
    def _check_disjoint(module_to_grid_map: dict[str, Any]) -> None:
        items = [(name, _rank_range(g)) for name, g in module_to_grid_map.items()]
        for i, (name_a, ra) in enumerate(items):
            for name_b, rb in items[i + 1:]:
                if ra != rb and max(ra.start, rb.start) < min(ra.stop, rb.stop):
                    raise ValueError(
                        f"module_to_grid_map: grids must span either the same ranks or disjoint ranks; "
                        f"'{name_a}' spans ranks [{ra.start}, {ra.stop}) and '{name_b}' spans "
                        f"[{rb.start}, {rb.stop})")

    @classmethod
    def _colocated(cls, modality_module_names: list[str]) -> RankRole:
        names = [*modality_module_names, MIMO_LANGUAGE_MODULE_KEY]
        return cls(modules={n: ModuleStageInfo(True, True) for n in names}, mode=ModuleLayout.COLOCATED)

    @staticmethod
    def _stage_of(grid: Any, rank: int) -> ModuleStageInfo:
        if "pp" not in grid.dim_names:
            return ModuleStageInfo(True, True)
        for ranks in grid.get_rank_enum("pp"):
            if rank in ranks:
                pos = list(ranks).index(rank)
                return ModuleStageInfo(is_first_stage=pos == 0, is_last_stage=pos == len(ranks) - 1)
        raise RuntimeError(f"rank {rank} is in the rank range of a grid but in none of its pp groups")

    @classmethod
    def _from_grid_map(cls, module_to_grid_map: dict[str, Any], rank: int | None = None) -> RankRole:
        """Non-colocated role of ``rank`` (default: this process's global rank)."""
        rank = dist.get_rank() if rank is None else rank
        modules = {name: cls._stage_of(grid, rank) for name, grid in module_to_grid_map.items()
                   if rank in _rank_range(grid)}
        if not modules:
            spans = {name: f"[{g.rank_offset}, {g.rank_offset + g.size})" for name, g in module_to_grid_map.items()}
            raise RuntimeError(f"rank {rank} is in no module grid of module_to_grid_map (grids span {spans})")
        return cls(modules=modules, mode=ModuleLayout.NON_COLOCATED)

    @property
    def has_modality_modules(self) -> bool:
        """Whether this rank runs any modality (non-language) module."""
        return any(name != MIMO_LANGUAGE_MODULE_KEY for name in self.modules)

    @property
    def has_language_module(self) -> bool:
        """Whether this rank runs the language model."""
        return MIMO_LANGUAGE_MODULE_KEY in self.modules

    @property
    def modality_module_names(self) -> list[str]:
        """The modality (non-language) modules this rank runs."""
        return [name for name in self.modules if name != MIMO_LANGUAGE_MODULE_KEY]

    def is_first_stage(self, module_name: str) -> bool:
        """Whether this rank holds ``module_name``'s first stage (False if it does not run it)."""
        info = self.modules.get(module_name)
        return info is not None and info.is_first_stage

    def is_last_stage(self, module_name: str) -> bool:
        """Whether this rank holds ``module_name``'s last stage (False if it does not run it)."""
        info = self.modules.get(module_name)
        return info is not None and info.is_last_stage

__all__ = ["MIMO_LANGUAGE_MODULE_KEY", "ModuleLayout", "ModuleStageInfo", "RankRole"]
