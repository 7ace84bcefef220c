"""Moving pipeline tensors between two modules that run on different rank grids (Megatron-Core's
``bridge_communicator``).

A :class:`BridgeCommunicator` links the last pipeline stage of a source grid (say, a vision encoder)
to the first stage of a destination grid (the language model). In each data-parallel replica one
rank is the leader: the last-stage rank ending the replica's tp-cp-pp block on the source side, the
first one on the destination side. Leaders exchange tensors point to point; when the two grids have
different DP sizes the batch dimension is split (fan-out) or concatenated (fan-in) so that replica
``i`` of the smaller grid pairs with a contiguous block of replicas of the larger one. Shapes travel
before every transfer, so microbatches may change size. Inside a grid the leader broadcasts what it
received to the other tp-cp ranks of its boundary stage. Context parallelism is not supported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core.hyper_comm_grid import HyperCommGrid, _is_process_group_member

logger = logging.getLogger(__name__)

__all__ = ["BridgeCommunicator", "CommRole", "RankCommInfo"]


class CommRole(Enum):
    """What a rank does in a bridge: a source leader sends, a destination leader receives, others are members."""

    SENDER = "SENDER"
    RECEIVER = "RECEIVER"
    MEMBER = "MEMBER"


@dataclass
class RankCommInfo:
    """One rank's part in a bridge: its role and the leader ranks it sends to or receives from."""

    role: CommRole = CommRole.MEMBER
    send_to_ranks: list[int] = field(default_factory=list)
    recv_from_ranks: list[int] = field(default_factory=list)


def _grid_axis_size(grid: HyperCommGrid, name: str) -> int:
    return grid.shape[grid.dim_names.index(name)] if name in grid.dim_names else 1


class BridgeCommunicator:
    """Sends activations from ``src_grid``'s last stage to ``dest_grid``'s first stage and gradients back.

    Every rank of the world must construct it (it creates process groups). ``dim_mapping`` names the
    tensor axes of ``'s'``, ``'b'`` and ``'h'`` (default ``{'s': 1, 'b': 0, 'h': 2}``); ``tensor_ndim``
    is 3, or 2 for tensors whose batch is folded into dim 0 (``[b*s, h]``). ``comm_dtype`` is the
    dtype of what travels (default: torch's default dtype).
    """

    _broadcast_pg_cache: dict[str, Any] = {}
    _bridge_pg_cache: dict[str, Any] = {}

    @classmethod
    def destroy_broadcast_pgs(cls) -> None:
        """Destroy the cached intra-grid broadcast groups (those this rank belongs to) and empty the cache."""
        for pg in cls._broadcast_pg_cache.values():
            if _is_process_group_member(pg):
                dist.destroy_process_group(pg)
        cls._broadcast_pg_cache.clear()

    @classmethod
    def destroy_bridge_pgs(cls) -> None:
        """Destroy the cached leader-to-leader groups (those this rank belongs to) and empty the cache."""
        for pg in cls._bridge_pg_cache.values():
            if _is_process_group_member(pg):
                dist.destroy_process_group(pg)
        cls._bridge_pg_cache.clear()

    def __init__(
        self,
        src_grid: HyperCommGrid,
        dest_grid: HyperCommGrid,
        dim_mapping: dict[str, int] | None = None,
        comm_dtype: torch.dtype | None = None,
        src_module_name: str | None = None,
        dest_module_name: str | None = None,
        tensor_ndim: int = 3,
    ) -> None:
        if tensor_ndim not in (2, 3):
            raise ValueError(f"tensor_ndim must be 2 or 3, got {tensor_ndim}")
        for label, grid in (("src_grid", src_grid), ("dest_grid", dest_grid)):
            if "pp" not in grid.dim_names:
                raise ValueError(f"{label} dim_names {grid.dim_names} must include 'pp'")
            if _grid_axis_size(grid, "cp") != 1:
                raise ValueError(f"{label} has cp size {_grid_axis_size(grid, 'cp')}; bridges need cp size 1")
        if dim_mapping is None:
            dim_mapping = {"s": 1, "b": 0, "h": 2}
        if set(dim_mapping) != {"s", "b", "h"} or sorted(dim_mapping.values()) != [0, 1, 2]:
            raise ValueError(f"dim_mapping must map 's', 'b', 'h' onto the axes 0, 1, 2, got {dim_mapping}")
        self.src_grid = src_grid
        self.dest_grid = dest_grid
        self.src_module_name = src_module_name
        self.dest_module_name = dest_module_name
        self.comm_dtype = comm_dtype
        self.tensor_ndim = tensor_ndim
        self.dim_mapping = dict(dim_mapping)
        self.current_rank = dist.get_rank()
        self.comm_map: dict[int, RankCommInfo] = {}

        self.src_grid_broadcast_pg, self.src_grid_broadcast_ranks = self._broadcast_group(src_grid, is_src=True)
        self.dest_grid_broadcast_pg, self.dest_grid_broadcast_ranks = self._broadcast_group(dest_grid, is_src=False)
        self.src_tp_leaders, self.src_local_leader_rank = self.get_leader_rank(src_grid, is_src=True)
        self.dest_tp_leaders, self.dest_local_leader_rank = self.get_leader_rank(dest_grid, is_src=False)
        self.bridge_pg = self._get_or_create_bridge_pg(sorted(set(self.src_tp_leaders) | set(self.dest_tp_leaders)))
        logger.debug(
            "bridge %s->%s rank %d: src leader %s, dest leader %s, src bcast %s, dest bcast %s", src_module_name,
            dest_module_name, self.current_rank, self.src_local_leader_rank, self.dest_local_leader_rank,
            self.src_grid_broadcast_ranks, self.dest_grid_broadcast_ranks,
        )
        self.build_comm_map(self.src_tp_leaders, self.dest_tp_leaders)
        dist.barrier()

    # --- topology ------------------------------------------------------------------------------
    @property
    def _batch_dim(self) -> int:
        """The axis split and concatenated across replicas: ``dim_mapping['b']``, or 0 for 2-D tensors."""
        return 0 if self.tensor_ndim == 2 else self.dim_mapping["b"]

    @property
    def _dtype(self) -> torch.dtype:
        return self.comm_dtype if self.comm_dtype is not None else torch.get_default_dtype()

    @classmethod
    def _get_or_create_broadcast_pg(cls, ranks_list: list[list[int]]) -> Any:
        """This rank's group among ``ranks_list`` (created once per distinct list; every rank must call)."""
        key = str(sorted(tuple(r) for r in ranks_list))
        if key not in cls._broadcast_pg_cache:
            cls._broadcast_pg_cache[key], _ = dist.new_subgroups_by_enumeration(ranks_list)
        return cls._broadcast_pg_cache[key]

    @classmethod
    def _get_or_create_bridge_pg(cls, ranks: list[int]) -> Any:
        """The group of the leader ranks ``ranks`` (created once per set; every rank must call)."""
        key = str(sorted(ranks))
        if key not in cls._bridge_pg_cache:
            cls._bridge_pg_cache[key] = dist.new_group(sorted(ranks))
        return cls._bridge_pg_cache[key]

    def _broadcast_group(self, grid: HyperCommGrid, is_src: bool) -> tuple[Any, list[int]]:
        ranks_list = self.get_boundary_pp_stage_ranks(grid, is_src)
        if not ranks_list:
            return None, []
        pg = self._get_or_create_broadcast_pg(ranks_list)
        return pg, next((ranks for ranks in ranks_list if self.current_rank in ranks), [])

    def get_leader_rank(self, grid: HyperCommGrid, is_src: bool) -> tuple[list[int], int | None]:
        """``(leaders of every DP replica, this rank's replica leader or None)`` of ``grid``.

        A replica's leader is the last rank of its non-DP block on the source side (last pipeline
        stage) and the first rank on the destination side (first stage).
        """
        leaders: list[int] = []
        local: int | None = None
        for group in grid._gen_rank_enum([d for d in grid.dim_names if d != "dp"]):
            leader = group[-1] if is_src else group[0]
            leaders.append(leader)
            if self.current_rank in group:
                local = leader
        return leaders, local

    def get_boundary_pp_stage_ranks(self, grid: HyperCommGrid, is_src: bool) -> list[list[int]]:
        """The tp-cp rank groups of ``grid``'s last (source) or first (destination) pipeline stage."""
        pp_index = grid.dim_names.index("pp")
        boundary = grid.shape[pp_index] - 1 if is_src else 0
        groups = [d for d in ("tp", "cp") if d in grid.dim_names]
        result = []
        for ranks in grid._gen_rank_enum(groups):
            offset = ranks[0] - grid.rank_offset
            for size in grid.shape[:pp_index]:
                offset //= size
            if offset % grid.shape[pp_index] == boundary:
                result.append(ranks)
        return result

    def is_current_rank_in_grid(self, grid: HyperCommGrid) -> bool:
        """Whether this global rank lies in ``grid``."""
        return grid.rank_offset <= self.current_rank < grid.rank_offset + grid.size

    def build_comm_map(self, src_tp_leaders: list[int], dest_tp_leaders: list[int]) -> None:
        """Fill ``comm_map``: pair leader ``i`` of the smaller side with a contiguous block of the larger's."""
        n_src, n_dest = len(src_tp_leaders), len(dest_tp_leaders)
        if n_src % n_dest and n_dest % n_src:
            raise ValueError(
                f"source leaders ({n_src}) and destination leaders ({n_dest}) must divide one another: "
                f"the source and destination DP sizes must be multiples of each other"
            )
        for grid in (self.src_grid, self.dest_grid):
            for rank in range(grid.rank_offset, grid.rank_offset + grid.size):
                self.comm_map[rank] = RankCommInfo()
        if n_src > n_dest:
            k = n_src // n_dest
            for i, dest in enumerate(dest_tp_leaders):
                block = src_tp_leaders[i * k:(i + 1) * k]
                for src in block:
                    self.comm_map[src] = RankCommInfo(CommRole.SENDER, send_to_ranks=[dest])
                self.comm_map[dest] = RankCommInfo(CommRole.RECEIVER, recv_from_ranks=list(block))
        else:
            k = n_dest // n_src
            for i, src in enumerate(src_tp_leaders):
                block = dest_tp_leaders[i * k:(i + 1) * k]
                self.comm_map[src] = RankCommInfo(CommRole.SENDER, send_to_ranks=list(block))
                for dest in block:
                    self.comm_map[dest] = RankCommInfo(CommRole.RECEIVER, recv_from_ranks=[src])

    # --- the public operations ----------------------------------------------------------------
    def send_forward(self, tensor_to_send: torch.Tensor) -> None:
        """Send an activation to the destination grid (a no-op on source ranks that are not leaders)."""
        info = self._info(self.src_grid, "send_forward", "source")
        if info.role is CommRole.SENDER and info.send_to_ranks:
            splits = self._split_tensor_at_batch_dim(self._checked(tensor_to_send), len(info.send_to_ranks))
            self._communicate_shapes(tensor_to_send_next=splits)
            self._run([(True, t, peer) for peer, t in zip(info.send_to_ranks, splits)])

    def recv_forward(self) -> torch.Tensor | None:
        """Receive the activation from the source grid (on the destination's first stage; a leaf that
        requires grad), ``None`` on ranks outside that stage."""
        info = self._info(self.dest_grid, "recv_forward", "destination")
        if info.role is CommRole.RECEIVER:
            shapes, _ = self._communicate_shapes(recv_prev=True)
            parts = [torch.empty(s, dtype=self._dtype, device=device.get_current_device()) for s in shapes]
            self._run([(False, t, peer) for peer, t in zip(info.recv_from_ranks, parts)])
            return self._share(parts, self.dest_grid_broadcast_pg, self.current_rank).requires_grad_(True)
        if self.current_rank in self.dest_grid_broadcast_ranks:
            return self._share(None, self.dest_grid_broadcast_pg, self.dest_local_leader_rank).requires_grad_(True)
        return None

    def send_backward(self, grad_tensor: torch.Tensor) -> None:
        """Send the activation's gradient back to the source grid (a no-op on non-leader ranks)."""
        info = self._info(self.dest_grid, "send_backward", "destination")
        if info.role is CommRole.RECEIVER:
            splits = self._split_tensor_at_batch_dim(self._checked(grad_tensor), len(info.recv_from_ranks))
            self._communicate_shapes(tensor_to_send_prev=splits)
            self._run([(True, t, peer) for peer, t in zip(info.recv_from_ranks, splits)])

    def recv_backward(self) -> torch.Tensor | None:
        """Receive the gradient of the activation sent earlier (on the source's last stage), else ``None``."""
        info = self._info(self.src_grid, "recv_backward", "source")
        if info.role is CommRole.SENDER:
            _, shapes = self._communicate_shapes(recv_next=True)
            parts = [torch.empty(s, dtype=self._dtype, device=device.get_current_device()) for s in shapes]
            self._run([(False, t, peer) for peer, t in zip(info.send_to_ranks, parts)])
            return self._share(parts, self.src_grid_broadcast_pg, self.current_rank)
        if self.current_rank in self.src_grid_broadcast_ranks:
            return self._share(None, self.src_grid_broadcast_pg, self.src_local_leader_rank)
        return None

    def send_forward_recv_backward(
        self, input_tensor: torch.Tensor, grad_shape: tuple[int, ...] | None = None
    ) -> torch.Tensor | None:
        """Send an activation and receive its gradient in one exchange (source grid).

        ``grad_shape`` is accepted for Megatron-Core compatibility; shapes are always negotiated.
        """
        info = self._info(self.src_grid, "send_forward_recv_backward", "source")
        if info.role is CommRole.SENDER:
            splits = self._split_tensor_at_batch_dim(self._checked(input_tensor), len(info.send_to_ranks))
            _, shapes = self._communicate_shapes(tensor_to_send_next=splits, recv_next=True)
            parts = [torch.empty(s, dtype=self._dtype, device=device.get_current_device()) for s in shapes]
            ops = []
            for peer, act, grad in zip(info.send_to_ranks, splits, parts):
                ops += [(True, act, peer), (False, grad, peer)]
            self._run(ops)
            return self._share(parts, self.src_grid_broadcast_pg, self.current_rank)
        if self.current_rank in self.src_grid_broadcast_ranks:
            return self._share(None, self.src_grid_broadcast_pg, self.src_local_leader_rank)
        return None

    def send_backward_recv_forward(
        self, grad_tensor: torch.Tensor, forward_shape: tuple[int, ...] | None = None
    ) -> torch.Tensor | None:
        """Send a gradient back and receive the next activation in one exchange (destination grid).

        ``forward_shape`` is accepted for Megatron-Core compatibility; shapes are always negotiated.
        """
        info = self._info(self.dest_grid, "send_backward_recv_forward", "destination")
        if info.role is CommRole.RECEIVER:
            splits = self._split_tensor_at_batch_dim(self._checked(grad_tensor), len(info.recv_from_ranks))
            shapes, _ = self._communicate_shapes(tensor_to_send_prev=splits, recv_prev=True)
            parts = [torch.empty(s, dtype=self._dtype, device=device.get_current_device()) for s in shapes]
            ops = []
            for peer, grad, act in zip(info.recv_from_ranks, splits, parts):
                ops += [(True, grad, peer), (False, act, peer)]
            self._run(ops)
            return self._share(parts, self.dest_grid_broadcast_pg, self.current_rank).requires_grad_(True)
        if self.current_rank in self.dest_grid_broadcast_ranks:
            return self._share(None, self.dest_grid_broadcast_pg, self.dest_local_leader_rank).requires_grad_(True)
        return None

    # --- internals ------------------------------------------------------------------------------
    def _info(self, grid: HyperCommGrid, op: str, side: str) -> RankCommInfo:
        if not self.is_current_rank_in_grid(grid):
            raise ValueError(
                f"{op} of bridge {self.src_module_name}->{self.dest_module_name} runs on the {side} grid "
                f"(ranks {grid.rank_offset}..{grid.rank_offset + grid.size - 1}), not on rank {self.current_rank}"
            )
        return self.comm_map[self.current_rank]

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() != self.tensor_ndim:
            raise ValueError(
                f"bridge {self.src_module_name}->{self.dest_module_name} carries {self.tensor_ndim}-D tensors, "
                f"got shape {tuple(tensor.shape)}"
            )
        if tensor.dtype != self._dtype:
            raise ValueError(
                f"bridge {self.src_module_name}->{self.dest_module_name} carries {self._dtype} "
                f"(comm_dtype), got a {tensor.dtype} tensor"
            )
        return tensor

    def _run(self, ops: list[tuple[bool, torch.Tensor, int]]) -> None:
        """Post ``(is_send, tensor, peer)`` operations on the bridge group in one batch and wait."""
        if not ops:
            return
        p2p = [dist.P2POp(dist.isend if is_send else dist.irecv, t, peer, self.bridge_pg) for is_send, t, peer in ops]
        for request in dist.batch_isend_irecv(p2p):
            request.wait()

    def _share(self, parts: list[torch.Tensor] | None, group: Any, src: int) -> torch.Tensor:
        """The leader ``src`` (this rank, holding ``parts``) concatenates them along the batch axis and
        broadcasts shape and data to ``group``; a member receives both from ``src``."""
        dev = device.get_current_device()
        leader = src == self.current_rank
        if leader:
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self._batch_dim)
            shape = torch.tensor(out.shape, dtype=torch.int64, device=dev)
        else:
            shape = torch.empty(self.tensor_ndim, dtype=torch.int64, device=dev)
        if _is_process_group_member(group) and dist.get_world_size(group) > 1:
            dist.broadcast(shape, src=src, group=group)
            if not leader:
                out = torch.empty(tuple(shape.tolist()), dtype=self._dtype, device=dev)
            dist.broadcast(out, src=src, group=group)
        return out

    def _communicate_shapes(
        self,
        tensor_to_send_next: torch.Tensor | list[torch.Tensor] | None = None,
        recv_next: bool = False,
        recv_prev: bool = False,
        tensor_to_send_prev: torch.Tensor | list[torch.Tensor] | None = None,
    ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Exchange the shapes of the tensors about to travel between leaders.

        A sender announces ``tensor_to_send_next`` (one tensor for every peer, or a list of one per
        peer) and, with ``recv_next``, learns the gradient shapes; a receiver learns the activation
        shapes (``recv_prev``) and announces ``tensor_to_send_prev``. Returns ``(forward shapes,
        gradient shapes)`` received, empty lists on members.
        """
        info = self.comm_map.get(self.current_rank)
        if info is None or info.role is CommRole.MEMBER:
            return [], []
        dev = device.get_current_device()
        peers = info.send_to_ranks if info.role is CommRole.SENDER else info.recv_from_ranks
        outgoing = tensor_to_send_next if info.role is CommRole.SENDER else tensor_to_send_prev
        wanted = recv_next if info.role is CommRole.SENDER else recv_prev
        ops: list[tuple[bool, torch.Tensor, int]] = []
        if outgoing is not None:
            for peer, t in zip(peers, self._as_per_peer_tensors(outgoing, len(peers))):
                ops.append((True, torch.tensor(t.shape, dtype=torch.int64, device=dev), peer))
        buffers = [torch.empty(self.tensor_ndim, dtype=torch.int64, device=dev) for _ in peers] if wanted else []
        ops += [(False, b, peer) for peer, b in zip(peers, buffers)]
        self._run(ops)
        shapes = [tuple(b.tolist()) for b in buffers]
        return (shapes, []) if info.role is CommRole.RECEIVER else ([], shapes)

    @staticmethod
    def _as_per_peer_tensors(tensors: torch.Tensor | list[torch.Tensor], expected_count: int) -> list[torch.Tensor]:
        """One tensor per peer: ``tensors`` repeated, or the list itself when it has ``expected_count`` items."""
        if isinstance(tensors, torch.Tensor):
            return [tensors] * expected_count
        if len(tensors) != expected_count:
            raise ValueError(f"expected {expected_count} tensors for shape communication, got {len(tensors)}")
        return list(tensors)

    def _split_tensor_at_batch_dim(self, aggregated_tensor: torch.Tensor, num_splits: int) -> list[torch.Tensor]:
        """Split along the batch axis into ``num_splits`` contiguous pieces.

        Pieces are as even as ``torch.tensor_split`` makes them, unless the tensor carries a
        ``_mimo_bridge_split_sizes`` attribute (per-sample sizes of a folded 2-D batch): then the
        sizes, grouped into ``num_splits`` equal runs of samples, decide the cut points.
        """
        if num_splits <= 0:
            raise ValueError(f"num_splits must be positive, got {num_splits}")
        sizes = getattr(aggregated_tensor, "_mimo_bridge_split_sizes", None)
        if sizes is None:
            return [p.contiguous() for p in torch.tensor_split(aggregated_tensor, num_splits, dim=self._batch_dim)]
        if num_splits == 1:
            return [aggregated_tensor.contiguous()]
        sizes = [int(s) for s in sizes]
        if len(sizes) > num_splits and len(sizes) % num_splits == 0:
            per = len(sizes) // num_splits
            sizes = [sum(sizes[i:i + per]) for i in range(0, len(sizes), per)]
        if len(sizes) != num_splits:
            raise ValueError(f"_mimo_bridge_split_sizes has {len(sizes)} entries, the bridge needs {num_splits} splits")
        total = int(aggregated_tensor.shape[self._batch_dim])
        if sum(sizes) != total:
            raise ValueError(f"_mimo_bridge_split_sizes sums to {sum(sizes)}, the batch axis has {total}")
        return [p.contiguous() for p in torch.split(aggregated_tensor, sizes, dim=self._batch_dim)]
