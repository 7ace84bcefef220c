"""The colocated DP bridge: move encoder outputs from an encoder's TP x DP layout to the language model's
(Megatron-Core's ``models.mimo.comm.colocated_communicator``).

Both grids cover the same ranks but factor them differently, e.g. encoder TP=1 x DP=4 and language model
TP=2 x DP=2. Each encoder DP replica encodes its own slice of the batch; each language-model replica needs
the slice that belongs to it.

- ``FAN_IN`` (encoder DP = ``scale`` x language DP): the forward all-gathers, along the batch dimension, the
  outputs of the ``scale`` encoder replicas inside one language replica; the backward keeps this rank's
  slice of the gradient.
- ``FAN_OUT`` (language DP = ``scale`` x encoder DP): the forward keeps this rank's ``1/scale`` of its
  encoder replica's batch; the backward all-gathers the slices' gradients across the sibling language
  replicas, so every encoder rank gets the gradient of its whole batch (every slice feeds some rank).
- ``EQUAL``: the identity.

The caller feeds each rank the matching data: in fan-in the language model's batch with the encoder's
inputs narrowed to slot ``encoder_dp_rank % scale``; in fan-out the encoder's batch with the language
model's inputs narrowed to slot ``language_dp_rank % scale``. The bridge is an exact adjoint and applies no
gradient scaling: averaging each module's gradients over its own DP group does not give the gradient of one
global loss; sum-reduce both (``calculate_per_token_loss``) and divide by the global token count.
Encoder outputs must be replicated over the encoder's TP group. Every collective of the bridge is here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.distributed import collectives
from megatron_core.hyper_comm_grid import HyperCommGrid, _is_process_group_member

logger = logging.getLogger(__name__)


@dataclass
class SliceInfo:
    """A contiguous slice ``[start, start + size)`` of the batch dimension."""

    start: int
    size: int


class BridgeDirection(str, Enum):
    """Which side of a colocated bridge has more DP replicas: the source (``FAN_IN``), the destination
    (``FAN_OUT``) or neither (``EQUAL``)."""

    FAN_IN = "fan_in"
    FAN_OUT = "fan_out"
    EQUAL = "equal"


def _dim(grid: HyperCommGrid, name: str) -> int:
    return grid.shape[grid.dim_names.index(name)]


class ColocatedBridgeCommunicator:
    """Redistributes tensors from ``src_grid``'s TP/DP layout to ``dest_grid``'s on the same ranks.

    ``dim_mapping`` names the batch (``'b'``) axis among others (default ``{'b': 0, 's': 1, 'h': 2}``);
    ``MimoModel`` passes ``{'b': 0, 'h': 1}`` for its ``[tokens, h]`` encoder outputs, whose dim 0 then
    splits evenly only when every sample has the same number of tokens. Every rank of the world must
    construct it (fan-in and fan-out create process groups); ``destroy`` releases them.
    """

    def __init__(self, src_grid: HyperCommGrid, dest_grid: HyperCommGrid, src_module_name: str = "src",
                 dest_module_name: str = "dest", dim_mapping: dict[str, int] | None = None) -> None:
        self.src_grid = src_grid
        self.dest_grid = dest_grid
        self.src_module_name = src_module_name
        self.dest_module_name = dest_module_name
        self.dim_mapping = dim_mapping or {"b": 0, "s": 1, "h": 2}
        if "b" not in self.dim_mapping:
            raise ValueError(f"ColocatedBridgeCommunicator: dim_mapping {self.dim_mapping} must name the batch "
                             f"axis 'b'")
        self._validate_grids()
        self._extract_parallelism_info()
        # Without a default group (one process, grids sized by WORLD_SIZE) this process is rank 0.
        self.current_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._build_rank_mappings()
        self.gather_pg: Any = None
        self.gather_group_ranks: list[list[int]] = []
        if self.src_dp_size > self.dest_dp_size:
            self.direction, self.scale = BridgeDirection.FAN_IN, self.src_dp_size // self.dest_dp_size
            self.gather_group_ranks = self._build_gather_groups(self.dest_dp_size, self.src_tp_size, self.scale,
                                                                self.rank_to_src_pos)
        elif self.dest_dp_size > self.src_dp_size:
            self.direction, self.scale = BridgeDirection.FAN_OUT, self.dest_dp_size // self.src_dp_size
            self.gather_group_ranks = self._build_gather_groups(self.src_dp_size, self.dest_tp_size, self.scale,
                                                                self.rank_to_dest_pos)
        else:
            self.direction, self.scale = BridgeDirection.EQUAL, 1
        if self.gather_group_ranks:
            self._check_groups_stay_in_replicas()
            self.gather_pg, _ = dist.new_subgroups_by_enumeration(self.gather_group_ranks,
                                                                  backend=self.src_grid.backend)
            if _is_process_group_member(self.gather_pg) and dist.get_backend(self.gather_pg) == "gloo":
                # gloo's pairs connect asynchronously: a member that returns first and destroys the group at once
                # (a short-lived bridge) closed the socket of a peer still connecting ("Connection closed by peer")
                dist.barrier(group=self.gather_pg)
        logger.info("ColocatedBridgeCommunicator %s (TP %d x DP %d) -> %s (TP %d x DP %d): %s, scale %d",
                    src_module_name, self.src_tp_size, self.src_dp_size, dest_module_name, self.dest_tp_size,
                    self.dest_dp_size, self.direction.value, self.scale)

    def _names(self) -> str:
        return f"'{self.src_module_name}' -> '{self.dest_module_name}'"

    def _validate_grids(self) -> None:
        """Same ranks, ``tp`` and ``dp`` axes, DP sizes that divide each other; pp = cp = 1 when they differ."""
        src, dest = self.src_grid, self.dest_grid
        if src.size != dest.size or src.rank_offset != dest.rank_offset:
            raise ValueError(f"ColocatedBridgeCommunicator {self._names()}: grids must span the same ranks; "
                             f"src has {src.size} ranks from {src.rank_offset}, dest {dest.size} from "
                             f"{dest.rank_offset}")
        for role, grid in (("src", src), ("dest", dest)):
            for required in ("tp", "dp"):
                if required not in grid.dim_names:
                    raise ValueError(f"ColocatedBridgeCommunicator {self._names()}: the {role} grid needs a "
                                     f"'{required}' axis, got dim_names {grid.dim_names}")
        src_dp, dest_dp = _dim(src, "dp"), _dim(dest, "dp")
        if src_dp % dest_dp and dest_dp % src_dp:
            raise ValueError(f"ColocatedBridgeCommunicator {self._names()}: the DP sizes must divide one another, "
                             f"got src dp {src_dp} and dest dp {dest_dp}")
        if src_dp == dest_dp:
            return  # the identity bridge needs no rank mapping
        for role, grid in (("src", src), ("dest", dest)):
            for axis in ("pp", "cp"):
                if axis in grid.dim_names and _dim(grid, axis) != 1:
                    raise ValueError(f"ColocatedBridgeCommunicator {self._names()}: with different DP sizes "
                                     f"(src dp {src_dp}, dest dp {dest_dp}) the {role} grid's {axis} must be 1, "
                                     f"got {_dim(grid, axis)} (grid shape {grid.shape}, dims {grid.dim_names})")

    def _extract_parallelism_info(self) -> None:
        self.src_tp_size, self.src_dp_size = _dim(self.src_grid, "tp"), _dim(self.src_grid, "dp")
        self.dest_tp_size, self.dest_dp_size = _dim(self.dest_grid, "tp"), _dim(self.dest_grid, "dp")

    def _build_rank_mappings(self) -> None:
        """``rank_to_src_pos`` / ``rank_to_dest_pos``: global rank -> ``(dp index, tp index)`` in each grid."""
        self.rank_to_src_pos: dict[int, tuple[int, int]] = {}
        self.rank_to_dest_pos: dict[int, tuple[int, int]] = {}
        for grid, positions in ((self.src_grid, self.rank_to_src_pos), (self.dest_grid, self.rank_to_dest_pos)):
            for dp_idx, tp_ranks in enumerate(grid.get_rank_enum(["tp"])):
                for tp_idx, rank in enumerate(tp_ranks):
                    positions[rank] = (dp_idx, tp_idx)

    @staticmethod
    def _build_gather_groups(iter_size: int, sibling_tp_size: int, scale: int,
                             rank_to_pos: dict[int, tuple[int, int]]) -> list[list[int]]:
        """For each replica of the smaller-DP side and each TP rank of the larger-DP side, the ``scale`` ranks
        of the larger side (that TP index, consecutive DP indices) in gather order."""
        at = {pos: rank for rank, pos in rank_to_pos.items()}
        return [[at[(dp_idx, tp_idx)] for dp_idx in range(slot * scale, (slot + 1) * scale)]
                for slot in range(iter_size) for tp_idx in range(sibling_tp_size)]

    def _check_groups_stay_in_replicas(self) -> None:
        """Every gather group must lie inside one replica of the smaller-DP side (it exchanges one replica's
        batch); grids whose axis orders differ can break that."""
        narrow_pos = self.rank_to_dest_pos if self.direction is BridgeDirection.FAN_IN else self.rank_to_src_pos
        for slot, ranks in enumerate(self.gather_group_ranks):
            replicas = {narrow_pos[r][0] for r in ranks}
            want = slot // (self.src_tp_size if self.direction is BridgeDirection.FAN_IN else self.dest_tp_size)
            if replicas != {want}:
                raise ValueError(f"ColocatedBridgeCommunicator {self._names()}: ranks {ranks} gather one batch "
                                 f"but belong to replicas {sorted(replicas)} of the smaller-DP grid; the grids "
                                 f"(src shape {self.src_grid.shape} dims {self.src_grid.dim_names}, dest shape "
                                 f"{self.dest_grid.shape} dims {self.dest_grid.dim_names}) must order tp before dp")

    def is_fan_in(self) -> bool:
        """Whether the source has more DP replicas (the forward all-gathers)."""
        return self.direction is BridgeDirection.FAN_IN

    def is_fan_out(self) -> bool:
        """Whether the destination has more DP replicas (the forward narrows)."""
        return self.direction is BridgeDirection.FAN_OUT

    def _check_divisible(self, batch_size: int) -> None:
        if batch_size % self.scale:
            raise ValueError(f"ColocatedBridgeCommunicator {self._names()}: batch dimension {batch_size} is not "
                             f"divisible by the {self.direction.value} scale {self.scale}")

    def get_slice_info(self, batch_size: int) -> SliceInfo:
        """This rank's slice of a ``batch_size`` batch on the narrowing side (fan-out forward, fan-in backward);
        the whole batch for ``EQUAL``. ``ValueError`` when ``batch_size`` is not divisible by ``scale``."""
        if self.direction is BridgeDirection.EQUAL:
            return SliceInfo(start=0, size=batch_size)
        self._check_divisible(batch_size)
        positions = self.rank_to_dest_pos if self.direction is BridgeDirection.FAN_OUT else self.rank_to_src_pos
        size = batch_size // self.scale
        return SliceInfo(start=(positions[self.current_rank][0] % self.scale) * size, size=size)

    def communicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in the source layout -> the destination layout (differentiable)."""
        if self.direction is BridgeDirection.FAN_OUT:
            self._check_divisible(tensor.shape[self.dim_mapping["b"]])
        return _ColocatedCommunicate.apply(tensor, self)

    def destroy(self) -> None:
        """Destroy this bridge's gather groups (this rank's); safe to call twice."""
        if _is_process_group_member(self.gather_pg):
            dist.destroy_process_group(self.gather_pg)
        self.gather_pg = None


def _narrow(tensor: torch.Tensor, comm: ColocatedBridgeCommunicator) -> torch.Tensor:
    dim = comm.dim_mapping["b"]
    piece = comm.get_slice_info(tensor.shape[dim])
    return tensor.narrow(dim, piece.start, piece.size).contiguous()


def _all_gather_batch(tensor: torch.Tensor, comm: ColocatedBridgeCommunicator) -> torch.Tensor:
    """Concatenate the gather group's tensors along the batch axis, in group-rank order."""
    dim = comm.dim_mapping["b"]
    local = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((local.shape[0] * comm.scale, *local.shape[1:]), dtype=local.dtype, device=local.device)
    collectives.all_gather(out, local, comm.gather_pg)
    return out.movedim(0, dim).contiguous()


class _ColocatedCommunicate(torch.autograd.Function):
    """Fan-out: narrow forward, all-gather backward; fan-in: all-gather forward, narrow backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: ColocatedBridgeCommunicator) -> torch.Tensor:
        ctx.comm = comm
        if comm.direction is BridgeDirection.FAN_OUT:
            return _narrow(tensor, comm)
        if comm.direction is BridgeDirection.FAN_IN:
            return _all_gather_batch(tensor, comm)
        return tensor.contiguous()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        comm = ctx.comm
        if comm.direction is BridgeDirection.FAN_OUT:
            return _all_gather_batch(grad_output, comm), None
        if comm.direction is BridgeDirection.FAN_IN:
            return _narrow(grad_output, comm), None
        return grad_output.contiguous(), None


__all__ = ["BridgeDirection", "ColocatedBridgeCommunicator", "SliceInfo"]
