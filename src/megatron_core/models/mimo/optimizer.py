"""``MimoOptimizer``: one Megatron optimizer per MIMO module, stepped as one (Megatron-Core's
``models.mimo.optimizer``).

``get_mimo_optimizer`` builds each module's optimizer with ``get_megatron_optimizer`` on the process groups
of that module's ``HyperCommGrid``, so an encoder and the language model may use different TP / DP layouts
(colocated) or different ranks (non-colocated). The step is global: the inf/nan check and the update's
success are agreed over every rank of the world, the gradient norm is ``sqrt(sum over modules of
norm_m^2)`` (each module's norm is the same on all of its ranks; a world MAX hands it to the ranks that do
not run the module), and every module is clipped with that norm. A non-finite norm skips the step on every
rank. Checkpoints keep each module's state under its name (``mimo.<module>.`` key prefix); the step
count and a grad scaler's state travel as ``ShardedObject``\\ s so that ranks without rank 0's modules
(non-colocated) save theirs too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank
from megatron_core.device import get_current_device
from megatron_core.dist_checkpointing.mapping import ShardedObject
from megatron_core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron_core.distributed import collectives
from megatron_core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY
from megatron_core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron_core.process_groups_config import ProcessGroupCollection

if TYPE_CHECKING:
    from megatron_core.hyper_comm_grid import HyperCommGrid
    from megatron_core.models.mimo.model.base import MimoModel

_EXPERT_VIEW = "expert"
# Parts of a leaf optimizer's sharded state that are not sharded tensors: saved as ShardedObjects.
_OBJECT_ENTRIES = ("step", "grad_scaler")


@dataclass
class ModuleOptimizerInfo:
    """One module's optimizer (``None`` where this rank does not run the module), grid and groups."""

    optimizer: MegatronOptimizer | None
    grid: HyperCommGrid | None
    pg_collection: ProcessGroupCollection | None
    is_active: bool


def _world() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else collectives.LOCAL


class MimoOptimizer(MegatronOptimizer):
    """Steps the optimizers of ``module_infos`` (module name -> ``ModuleOptimizerInfo``) as one optimizer.

    ``step()`` returns ``(update_successful, grad_norm, num_zeros)`` alike on every rank; unlike Megatron-Core,
    a non-finite global norm skips the update (as ``MegatronOptimizer.step`` does) instead of clipping with it.
    """

    def __init__(self, module_infos: dict[str, ModuleOptimizerInfo], config: OptimizerConfig) -> None:
        super().__init__(None, config)
        self.module_infos = module_infos
        self._active_optimizers: list[MegatronOptimizer] = [
            info.optimizer for info in module_infos.values() if info.is_active and info.optimizer is not None]
        self.is_stub_optimizer = not self._active_optimizers

    def _world_reduce(self, values: list[float], op: str) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=get_current_device())
        collectives.all_reduce(tensor, _world(), op)
        return tensor.tolist()

    def get_parameters(self) -> list[torch.Tensor]:
        """Every active module optimizer's parameters."""
        return [p for opt in self._active_optimizers for p in opt.get_parameters()]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every active module optimizer's param groups, concatenated."""
        return [g for opt in self._active_optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """Every active module optimizer's per-parameter state, merged."""
        merged: dict[Any, Any] = {}
        for opt in self._active_optimizers:
            merged.update(opt.state)
        return merged

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Prepare every active module's gradients; True if any of them (on this rank) holds inf/nan."""
        found = [opt.prepare_grads() for opt in self._active_optimizers]
        return any(found)

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global gradient norm over all modules (the same on every rank)."""
        squares = [0.0] * len(self.module_infos)
        for i, (_, info) in enumerate(sorted(self.module_infos.items())):
            if info.is_active and info.optimizer is not None:
                squares[i] = float(info.optimizer.get_grad_norm() or 0.0) ** 2
        return math.sqrt(sum(self._world_reduce(squares, "max")))

    def count_zeros(self) -> int:
        """Zero gradient elements over all modules (each module's count shared by a world MAX)."""
        counts = [0.0] * len(self.module_infos)
        for i, (_, info) in enumerate(sorted(self.module_infos.items())):
            if info.is_active and info.optimizer is not None:
                counts[i] = float(info.optimizer.count_zeros())
        return int(sum(self._world_reduce(counts, "max")))

    @torch.no_grad()
    def step_on_device(self, skip_unless_finite: torch.Tensor | None = None, outcome_known: Any = None,
                       ) -> tuple[bool, float | None, float | None]:
        """What ``step`` returns, ``(update_successful, grad_norm, num_zeros)``, the same on every rank (host
        values: the world-wide agreement reads them, so ``outcome_known`` is never called).

        Skipped everywhere when any rank's module finds inf/nan gradients (``(False, None, None)``) or the
        global norm (or ``skip_unless_finite``, as in ``MegatronOptimizer.step``) is not finite.
        """
        found_inf = self._world_reduce([float(self.prepare_grads())], "max")[0] > 0
        if found_inf:
            return False, None, None
        grad_norm = self.get_grad_norm()
        if not math.isfinite(grad_norm) or (
                skip_unless_finite is not None and not bool(torch.isfinite(skip_unless_finite).all())):
            return False, grad_norm, None
        for opt in self._active_optimizers:
            params = opt.get_parameters()
            if params and opt.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, grad_norm,
                                             use_decoupled_grad=opt.config.use_precision_aware_optimizer)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        success = self.step_with_ready_grads()
        success = self._world_reduce([float(success)], "min")[0] > 0
        return success, grad_norm, num_zeros

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step every active module optimizer on its prepared (and clipped) gradients."""
        results = [opt.step_with_ready_grads() for opt in self._active_optimizers]
        return all(results)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every active module optimizer."""
        for opt in self._active_optimizers:
            opt.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """The first active module optimizer's loss scale (1.0 without one)."""
        if self._active_optimizers:
            return self._active_optimizers[0].get_loss_scale()
        return torch.tensor([1.0], dtype=torch.float32, device=get_current_device())

    def reload_model_params(self, state_dict: dict | None = None) -> None:
        """Refresh every active module optimizer's main params from the model (``state_dict`` is unused)."""
        for opt in self._active_optimizers:
            opt.reload_model_params()

    # --- checkpointing ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{module name: its optimizer's state_dict() (None where this rank does not run it)}``."""
        return {name: info.optimizer.state_dict() if info.is_active and info.optimizer is not None else None
                for name, info in self.module_infos.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore each active module from ``state_dict[name]`` (a ``state_dict()`` or a loaded
        ``sharded_state_dict``); modules missing from it are left as they are."""
        for name, info in self.module_infos.items():
            module_sd = state_dict.get(name)
            if not (info.is_active and info.optimizer is not None) or module_sd is None:
                continue
            for leaf_key, leaf in _leaves(module_sd):
                for entry in _OBJECT_ENTRIES:
                    key = f"_mimo_{entry}{_suffix(leaf_key)}"
                    if key in module_sd:
                        leaf[entry] = module_sd.pop(key)
            info.optimizer.load_state_dict(module_sd)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           **kwargs: Any) -> dict[str, Any]:
        """``{module name: its optimizer's sharded state, keys prefixed "mimo.<name>."}`` (``{}`` for modules
        this rank does not run); ``kwargs`` (``state_names``, ``metadata``) go to each module optimizer."""
        out: dict[str, Any] = {}
        for name, info in self.module_infos.items():
            if not (info.is_active and info.optimizer is not None):
                out[name] = {}
                continue
            module_sd = info.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            replica_id = _replica_id(name, info.pg_collection)
            for leaf_key, leaf in _leaves(module_sd):
                for entry in _OBJECT_ENTRIES:
                    if entry in leaf:
                        module_sd[f"_mimo_{entry}{_suffix(leaf_key)}"] = ShardedObject(
                            f"optimizer.mimo.{name}{_suffix(leaf_key)}.{entry}", leaf.pop(entry), (1,), (0,),
                            replica_id=replica_id)
            add_prefix_for_sharding(module_sd, f"mimo.{name}.")
            out[name] = module_sd
        return out


def _leaves(module_sd: dict[str, Any]) -> list[tuple[str, dict]]:
    """The leaf optimizer states of one module's sharded state: ``optimizer``, ``optimizer1``, ..."""
    return [(k, v) for k, v in module_sd.items() if k.startswith("optimizer") and isinstance(v, dict)]


def _suffix(leaf_key: str) -> str:
    index = leaf_key.removeprefix("optimizer")
    return f".{index}" if index else ""


def _replica_id(name: str, pg_collection: ProcessGroupCollection | None) -> tuple[int, int, int]:
    """``(tp rank, pp rank, dp rank)`` in the module's groups: only ``(0, 0, 0)`` writes its objects."""
    if pg_collection is None:
        raise ValueError(f"MimoOptimizer.sharded_state_dict: module '{name}' has no pg_collection")
    return (get_pg_rank(pg_collection.tp), get_pg_rank(pg_collection.pp), get_pg_rank(pg_collection.dp))


def _grid_group(module_name: str, grid: HyperCommGrid, dims: list[str], view: str | None = None) -> Any:
    """The grid's group over those of ``dims`` it has (``None`` for none); ``ValueError`` if not created."""
    names = grid.dim_names if view is None else None
    present = [d for d in dims if names is None or d in names]
    if not present:
        return None
    try:
        return grid.get_pg(present if len(present) > 1 else present[0], view=view)
    except KeyError as err:
        raise ValueError(f"get_mimo_optimizer: the grid of module '{module_name}' has no process group over "
                         f"{present}{'' if view is None else f' (view {view!r})'}; create it with "
                         f"grid.create_pg({present}{'' if view is None else f', view={view!r}'})") from err


def _has_expert_view(grid: HyperCommGrid) -> bool:
    try:
        grid.get_rank_enum("ep", view=_EXPERT_VIEW)
    except (KeyError, ValueError):
        return False
    return True


def _get_pg_collection_for_optimizer(module_name: str, grid: HyperCommGrid) -> ProcessGroupCollection:
    """The optimizer's groups from a grid whose groups were created: dense ones from the base view, expert
    ones (``tp_ep_pp``, ``expt_dp``) from the grid's ``"expert"`` view when it has one."""
    pg = ProcessGroupCollection()
    pg.dp = _grid_group(module_name, grid, ["dp"])
    pg.dp_cp = _grid_group(module_name, grid, ["dp", "cp"])
    pg.tp = _grid_group(module_name, grid, ["tp"])
    pg.pp = _grid_group(module_name, grid, ["pp"])
    pg.mp = _grid_group(module_name, grid, ["tp", "pp"])
    pg.intra_dist_opt = _grid_group(module_name, grid, ["tp", "cp", "dp", "pp"])
    if _has_expert_view(grid):
        pg.tp_ep_pp = _grid_group(module_name, grid, ["expt_tp", "ep", "pp"], view=_EXPERT_VIEW)
        pg.expt_dp = _grid_group(module_name, grid, ["expt_dp"], view=_EXPERT_VIEW)
    return pg


def get_mimo_optimizer(mimo_model: MimoModel, config: OptimizerConfig) -> MimoOptimizer:
    """A ``MimoOptimizer`` with one ``get_megatron_optimizer`` per module of ``module_to_grid_map``, each on
    its grid's groups (the grids' groups must exist: ``grid.create_pg``)."""
    grid_map = mimo_model.mimo_config.module_to_grid_map
    if not grid_map:
        raise ValueError("get_mimo_optimizer needs MimoModelConfig.module_to_grid_map (one HyperCommGrid per "
                         "module); without grids every module shares one layout: use get_megatron_optimizer")
    infos: dict[str, ModuleOptimizerInfo] = {}
    for name, grid in grid_map.items():
        is_active = grid.is_current_rank_in_grid()
        optimizer, pg_collection = None, None
        module = None
        if is_active:
            module = (mimo_model.language_model if name == MIMO_LANGUAGE_MODULE_KEY
                      else mimo_model.modality_submodules[name] if name in mimo_model.modality_submodules else None)
        if module is not None:
            ddp_config = getattr(module, "ddp_config", None)
            instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
            if instances != 1:
                raise ValueError(f"get_mimo_optimizer: module '{name}' has num_distributed_optimizer_instances="
                                 f"{instances}; the MIMO optimizer supports 1")
            pg_collection = _get_pg_collection_for_optimizer(name, grid)
            optimizer = get_megatron_optimizer(config, [module], pg_collection=pg_collection,
                                               use_gloo_process_groups=False)
        infos[name] = ModuleOptimizerInfo(optimizer=optimizer, grid=grid, pg_collection=pg_collection,
                                          is_active=is_active)
    return MimoOptimizer(infos, config)


__all__ = ["MimoOptimizer", "ModuleOptimizerInfo", "get_mimo_optimizer"]
