"""Pipeline communication for a model made of several modules on separate rank grids (Megatron-Core's
``multimodule_communicator``), e.g. a vision encoder on ranks {0, 1} feeding a language model on {2, 3}.

``topology`` is a DAG of module names (each maps to the modules its output feeds). Inside a module,
stages talk through a :class:`~megatron_core.pipeline_parallel.p2p_communication.P2PCommunicator`
over the module grid's ``pp`` group; across modules, the last stage of a producer talks to the
first stage of a consumer through a :class:`~megatron_core.pipeline_parallel.bridge_communicator.BridgeCommunicator`
(shape negotiation, batch split/concatenation over differing DP sizes). Every operation takes and
returns dicts: keyed by the local module inside a module, by the producer's name across a bridge.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist

from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.pipeline_parallel.bridge_communicator import BridgeCommunicator
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator

logger = logging.getLogger(__name__)

__all__ = ["MultiModulePipelineCommunicator", "RankModuleInfo"]

Shape = Union[Sequence[int], torch.Size]
_Tensors = Union[torch.Tensor, list, None]


@dataclass
class RankModuleInfo:
    """This rank's place in one module: its stage, the module's stage count, the intra-module P2P
    communicator and the bridges it drives as producer (last stage) or consumer (first stage)."""

    pp_rank: int
    pp_size: int
    p2p_communicator: P2PCommunicator | None
    bridge_comms_as_src_module: list[BridgeCommunicator] | None
    bridge_comms_as_dest_module: list[BridgeCommunicator] | None
    is_source_stage: bool | None = True
    is_terminal_stage: bool | None = True


def _prepare_tensor_for_comm(tensor: _Tensors) -> _Tensors:
    """Give a 2-D tensor a trailing unit axis for the intra-module P2P path (3-D passes through)."""
    if isinstance(tensor, list):
        return [_prepare_tensor_for_comm(t) for t in tensor]
    if isinstance(tensor, torch.Tensor):
        if tensor.dim() == 2:
            return tensor.unsqueeze(-1)
        if tensor.dim() == 3 and tensor.shape[-1] == 1:
            raise ValueError(
                f"a 3-D tensor of shape {tuple(tensor.shape)} (last axis 1) cannot travel between stages of a "
                f"module: the receiver would take it for a 2-D tensor; send it 2-D or with a last axis > 1"
            )
    return tensor


def _restore_tensor_from_comm(tensor: _Tensors) -> _Tensors:
    """Undo :func:`_prepare_tensor_for_comm`: drop a trailing unit axis of a 3-D tensor."""
    if isinstance(tensor, list):
        return [_restore_tensor_from_comm(t) for t in tensor]
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and tensor.shape[-1] == 1:
        if tensor.is_leaf and tensor.requires_grad:  # keep a received activation a leaf, so .grad fills
            return tensor.detach().squeeze(-1).requires_grad_(True)
        return tensor.squeeze(-1)
    return tensor


class MultiModulePipelineCommunicator:
    """Forward/backward exchange of a multi-module pipeline; see the module docstring.

    ``module_to_grid_map`` maps module names to their grids (each with a ``pp`` axis whose group has
    been created with ``grid.create_pg('pp')``); ``config`` supplies ``pipeline_dtype`` and the P2P
    options; ``dim_mapping`` gives the ``'s'``/``'b'``/``'h'`` axes for bridges; ``module_output_ndim``
    says which producers emit 2-D ``[b*s, h]`` tensors (default 3). Every rank must construct it.
    """

    def __init__(
        self,
        module_to_grid_map: dict[str, HyperCommGrid],
        topology: dict[str, list[str]],
        config: Any,
        dim_mapping: dict[str, int] | None = None,
        module_output_ndim: dict[str, int] | None = None,
    ) -> None:
        named = set(topology) | {dest for dests in topology.values() for dest in dests}
        unknown = sorted(named - set(module_to_grid_map))
        if unknown:
            raise ValueError(
                f"topology names modules {unknown} that are not in module_to_grid_map {list(module_to_grid_map)}"
            )
        self.module_to_grid_map = module_to_grid_map
        self.topology = topology
        self.config = config
        self.dim_mapping = dim_mapping
        self.module_output_ndim = module_output_ndim or {}
        self.current_rank = dist.get_rank()
        self.bridge_comms: list[BridgeCommunicator] = []
        self._build_bridge_comms()
        self.rank_module_map: dict[str, RankModuleInfo] = {}
        self._build_rank_module_info_map()

    # --- construction ---------------------------------------------------------------------------
    def _build_bridge_comms(self) -> None:
        """One bridge per topology edge, in ``module_to_grid_map`` order (the same on every rank)."""
        for src_name, src_grid in self.module_to_grid_map.items():
            for dest_name in self.topology.get(src_name, []):
                self.bridge_comms.append(BridgeCommunicator(
                    src_grid=src_grid,
                    dest_grid=self.module_to_grid_map[dest_name],
                    dim_mapping=self.dim_mapping,
                    comm_dtype=getattr(self.config, "pipeline_dtype", None),
                    src_module_name=src_name,
                    dest_module_name=dest_name,
                    tensor_ndim=self.module_output_ndim.get(src_name, 3),
                ))

    def _build_rank_module_info_map(self) -> None:
        """A :class:`RankModuleInfo` for each module whose grid holds this rank (several when colocated)."""
        for name, grid in self.module_to_grid_map.items():
            if not self.is_current_rank_in_grid(grid):
                continue
            pp_group = grid.get_pg("pp")
            pp_size = dist.get_world_size(pp_group)
            pp_rank = dist.get_group_rank(pp_group, self.current_rank) % pp_size
            as_dest = [b for b in self.bridge_comms if b.dest_module_name == name] if pp_rank == 0 else []
            as_src = [b for b in self.bridge_comms if b.src_module_name == name] if pp_rank == pp_size - 1 else []
            self.rank_module_map[name] = RankModuleInfo(
                pp_rank=pp_rank,
                pp_size=pp_size,
                p2p_communicator=P2PCommunicator(pp_group, self.config),
                bridge_comms_as_src_module=as_src,
                bridge_comms_as_dest_module=as_dest,
            )

    # --- stage queries ----------------------------------------------------------------------------
    @property
    def is_pp_first_stage(self) -> bool:
        """Whether this rank holds the first stage of a module that nothing feeds."""
        return any(i.pp_rank == 0 and self._is_source_module(m) for m, i in self.rank_module_map.items())

    @property
    def is_pp_last_stage(self) -> bool:
        """Whether this rank holds the last stage of a module that feeds nothing."""
        return any(i.pp_rank == i.pp_size - 1 and self._is_sink_module(m) for m, i in self.rank_module_map.items())

    def _is_source_module(self, module_name: str) -> bool:
        return not any(module_name in dests for dests in self.topology.values())

    def _is_sink_module(self, module_name: str) -> bool:
        return not self.topology.get(module_name, [])

    def is_current_rank_in_grid(self, grid: HyperCommGrid) -> bool:
        """Whether this global rank lies in ``grid``."""
        return grid.rank_offset <= self.current_rank < grid.rank_offset + grid.size

    @property
    def total_stages(self) -> int:
        """Stages of the whole pipeline: the longest topology path weighted by each module's PP size."""
        return self.compute_total_pipeline_stages(self.topology, self.module_to_grid_map)

    @property
    def current_stage(self) -> int:
        """This rank's 0-based stage in the whole pipeline (from its first module; 0 on no module)."""
        if not self.rank_module_map:
            return 0
        module_name = next(iter(self.rank_module_map))
        return self.compute_total_pipeline_stages(
            self.topology, self.module_to_grid_map, rank=self.current_rank, module_name=module_name
        ) - 1

    # --- communication ----------------------------------------------------------------------------
    def recv_forward(self, tensor_shape: Shape | None = None, is_first_stage: bool = False) -> dict[str, Any]:
        """Receive activations: from each producer (first stage, keyed by producer) or the previous stage."""
        out: dict[str, Any] = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == 0:
                for bridge in info.bridge_comms_as_dest_module:
                    out[bridge.src_module_name] = bridge.recv_forward()
            else:
                received = info.p2p_communicator.recv_forward(tensor_shapes=tensor_shape, is_first_stage=False)
                out[name] = _restore_tensor_from_comm(received)
        return out

    def send_forward(self, output_dict: dict[str, Any], is_last_stage: bool = False) -> None:
        """Send each local module's output to its consumers (last stage) or to its next stage."""
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    bridge.send_forward(output_dict[name])
            else:
                info.p2p_communicator.send_forward(_prepare_tensor_for_comm(output_dict[name]), is_last_stage=False)

    def send_forward_recv_backward(
        self, output_dict: dict[str, Any], tensor_shape: Shape | None = None, is_last_stage: bool = False
    ) -> dict[str, Any]:
        """Send outputs forward and receive their gradients (keyed by the local module name)."""
        grads: dict[str, Any] = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    grads[bridge.src_module_name] = bridge.send_forward_recv_backward(output_dict[name])
            else:
                grad = info.p2p_communicator.send_forward_recv_backward(
                    _prepare_tensor_for_comm(output_dict[name]), tensor_shapes=tensor_shape, is_last_stage=False
                )
                grads[name] = _restore_tensor_from_comm(grad)
        return grads

    def send_backward_recv_forward(
        self, grad_dict: dict[str, Any], tensor_shape: Shape | None = None, is_first_stage: bool = False
    ) -> dict[str, Any]:
        """Send input gradients back (keyed by producer across bridges) and receive the next activations."""
        out: dict[str, Any] = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == 0:
                for bridge in info.bridge_comms_as_dest_module:
                    out[bridge.src_module_name] = bridge.send_backward_recv_forward(grad_dict[bridge.src_module_name])
            else:
                received = info.p2p_communicator.send_backward_recv_forward(
                    _prepare_tensor_for_comm(grad_dict[name]), tensor_shapes=tensor_shape, is_first_stage=False
                )
                out[name] = _restore_tensor_from_comm(received)
        return out

    def recv_backward(self, tensor_shape: Shape | None = None, is_last_stage: bool = False) -> dict[str, Any]:
        """Receive the gradients of the outputs sent earlier (keyed by the local module name)."""
        grads: dict[str, Any] = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    grads[bridge.src_module_name] = bridge.recv_backward()
            else:
                grad = info.p2p_communicator.recv_backward(tensor_shapes=tensor_shape, is_last_stage=False)
                grads[name] = _restore_tensor_from_comm(grad)
        return grads

    def send_backward(self, grad_dict: dict[str, Any], is_first_stage: bool = False) -> None:
        """Send input gradients to the producers (first stage, keyed by producer) or the previous stage."""
        for name, info in self.rank_module_map.items():
            if info.pp_rank == 0:
                for bridge in info.bridge_comms_as_dest_module:
                    bridge.send_backward(grad_dict[bridge.src_module_name])
            else:
                info.p2p_communicator.send_backward(_prepare_tensor_for_comm(grad_dict[name]), is_first_stage=False)

    # --- stage arithmetic -------------------------------------------------------------------------
    @staticmethod
    def compute_total_pipeline_stages(
        topology: dict[str, list[str]],
        module_to_grid_map: dict[str, HyperCommGrid],
        rank: int | None = None,
        module_name: str | None = None,
    ) -> int:
        """Longest path through the module DAG, each module weighing its PP size.

        Without ``rank``: the maximum over sink modules. With ``rank`` (and ``module_name``, the
        module of ``rank`` to count in): the path ending at that module, which weighs only up to and
        including ``rank``'s stage. ``ValueError`` on a cycle, on a DAG without a sink, or when
        ``module_name`` is missing or does not hold ``rank``.
        """
        nodes = list(module_to_grid_map)
        preds: dict[str, list[str]] = {n: [] for n in nodes}
        for src in nodes:
            for dst in topology.get(src, []):
                preds[dst].append(src)
        sinks = [n for n in nodes if not topology.get(n, [])]

        def pp_size(name: str) -> int:
            grid = module_to_grid_map[name]
            return grid.shape[grid.dim_names.index("pp")]

        partial: int | None = None
        if rank is not None:
            if module_name not in module_to_grid_map:
                raise ValueError(f"module_name {module_name!r} must name a module of {nodes} when rank is given")
            groups = [g for g in module_to_grid_map[module_name]._gen_rank_enum(["pp"]) if rank in g]
            if not groups:
                raise ValueError(f"rank {rank} is not in the grid of module {module_name!r}")
            partial = groups[0].index(rank) + 1
        elif not sinks:
            raise ValueError(f"topology {topology} has no module without outgoing edges; it must be a DAG")

        def longest(target: str) -> int:
            on_path: set[str] = set()

            def walk(node: str) -> int:
                if node in on_path:
                    raise ValueError(f"topology {topology} has a cycle through {node!r}; it must be a DAG")
                on_path.add(node)
                best = max((walk(p) for p in preds[node]), default=0)
                on_path.discard(node)
                weight = partial if partial is not None and node == target else pp_size(node)
                return weight + best

            return walk(target)

        if rank is None:
            return max(longest(s) for s in sinks)
        return longest(module_name)
