"""Which piece of the KV cache each rank holds, and the moves that take one layout's pieces to another's
(Megatron-Core 0.19's ``inference.disaggregation.kv_reshard``).

A model's KV cache is a grid of global attention layers x KV heads (the query groups under GQA). A rank of
a shard holds one rectangle of it: the layers of its pipeline stage (an even split by default, or an explicit
window for models whose stages hold uneven attention-layer counts, such as hybrid ones) times the heads of its
tensor-parallel rank (always an even split). Expert parallelism does not split the KV cache, so ranks that
differ only in their EP / expert-TP coordinates hold identical KV; the planner reads each rectangle from one
of them, the lowest global rank. Each (source, destination) pair then exchanges at most one rectangle, their
intersection: nothing outside the overlap moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_core.inference.disaggregation.utils import intersect

__all__ = ["KVReshardTransfer", "KVShardLayout", "plan_kv_reshard"]


def _check_rank(name: str, rank: int, size_name: str, size: int) -> None:
    if size < 1:
        raise ValueError(f"KVShardLayout: {size_name}={size} must be >= 1")
    if not 0 <= rank < size:
        raise ValueError(f"KVShardLayout: {name}={rank} must be in [0, {size_name}={size})")


@dataclass(frozen=True)
class KVShardLayout:
    """The KV rectangle of one rank: ``num_layers`` and ``num_heads`` are the global attention-layer and KV-head
    counts, ``global_rank`` the rank's ``torch.distributed`` rank (the peer of the sends).

    ``layer_start`` / ``num_local_layers`` (both or neither) give this stage's global attention layers
    explicitly; without them the ``num_layers`` are split evenly over ``pp_size`` stages. ``ep_*`` / ``etp_*``
    only mark replicas (they do not split the KV cache). ``ValueError`` when ``tp_size`` does not divide
    ``num_heads``, the even split does not divide, or a rank is outside its size.
    """

    num_layers: int
    num_heads: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    global_rank: int
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    layer_start: int | None = None
    num_local_layers: int | None = None

    def __post_init__(self) -> None:
        for name, rank, size_name, size in (("tp_rank", self.tp_rank, "tp_size", self.tp_size),
                                            ("pp_rank", self.pp_rank, "pp_size", self.pp_size),
                                            ("ep_rank", self.ep_rank, "ep_size", self.ep_size),
                                            ("etp_rank", self.etp_rank, "etp_size", self.etp_size)):
            _check_rank(name, rank, size_name, size)
        if self.num_heads % self.tp_size:
            raise ValueError(f"KVShardLayout: num_heads={self.num_heads} must be divisible by tp_size={self.tp_size} "
                             "(each tensor-parallel rank holds an equal share of the KV heads)")
        if (self.layer_start is None) != (self.num_local_layers is None):
            raise ValueError(f"KVShardLayout: layer_start={self.layer_start} and num_local_layers="
                             f"{self.num_local_layers} must be set together or both left None")
        if self.layer_start is None:
            if self.num_layers % self.pp_size:
                raise ValueError(f"KVShardLayout: num_layers={self.num_layers} must be divisible by pp_size="
                                 f"{self.pp_size} for the even split; pass layer_start and num_local_layers for "
                                 "uneven stages")
        elif (self.layer_start < 0 or self.num_local_layers < 0
              or self.layer_start + self.num_local_layers > self.num_layers):
            raise ValueError(f"KVShardLayout: layers [layer_start={self.layer_start}, +num_local_layers="
                             f"{self.num_local_layers}) must lie in [0, num_layers={self.num_layers})")

    def kv_shard_key(self) -> tuple[int, int]:
        """``(tp_rank, pp_rank)``: ranks with the same key hold the same KV (expert-parallel replicas)."""
        return (self.tp_rank, self.pp_rank)

    def layer_range(self) -> tuple[int, int]:
        """This rank's global attention layers, ``[lo, hi)``."""
        if self.layer_start is not None:
            return (self.layer_start, self.layer_start + self.num_local_layers)
        per_stage = self.num_layers // self.pp_size
        return (self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage)

    def head_range(self) -> tuple[int, int]:
        """This rank's global KV heads, ``[lo, hi)``."""
        per_rank = self.num_heads // self.tp_size
        return (self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    def local_num_layers(self) -> int:
        """Attention layers this rank holds."""
        lo, hi = self.layer_range()
        return hi - lo

    def local_num_heads(self) -> int:
        """KV heads this rank holds."""
        lo, hi = self.head_range()
        return hi - lo


@dataclass(frozen=True)
class KVReshardTransfer:
    """The rectangle ``src_rank`` sends ``dst_rank``: global layers ``[global_layer_lo, global_layer_hi)`` x
    global KV heads ``[global_head_lo, global_head_hi)``; the ``*_slice`` methods give it in either side's
    local coordinates."""

    src_rank: int
    dst_rank: int
    global_layer_lo: int
    global_layer_hi: int
    global_head_lo: int
    global_head_hi: int

    def _local(self, lo: int, hi: int, start: int) -> slice:
        return slice(lo - start, hi - start)

    def src_layer_slice(self, src: KVShardLayout) -> slice:
        """The layers of the rectangle among the source's local layers."""
        return self._local(self.global_layer_lo, self.global_layer_hi, src.layer_range()[0])

    def src_head_slice(self, src: KVShardLayout) -> slice:
        """The heads of the rectangle among the source's local KV heads."""
        return self._local(self.global_head_lo, self.global_head_hi, src.head_range()[0])

    def dst_layer_slice(self, dst: KVShardLayout) -> slice:
        """The layers of the rectangle among the destination's local layers."""
        return self._local(self.global_layer_lo, self.global_layer_hi, dst.layer_range()[0])

    def dst_head_slice(self, dst: KVShardLayout) -> slice:
        """The heads of the rectangle among the destination's local KV heads."""
        return self._local(self.global_head_lo, self.global_head_hi, dst.head_range()[0])


def _representatives(srcs: list[KVShardLayout]) -> set[int]:
    """The lowest global rank of every distinct KV rectangle among ``srcs``."""
    best: dict[tuple[int, int], int] = {}
    for src in srcs:
        key = src.kv_shard_key()
        best[key] = min(best.get(key, src.global_rank), src.global_rank)
    return set(best.values())


def plan_kv_reshard(srcs: list[KVShardLayout], dsts: list[KVShardLayout]) -> list[KVReshardTransfer]:
    """Every move from the ``srcs`` layouts (all ranks of the sending shard) to the ``dsts`` layouts.

    One transfer per (destination, source) pair whose rectangles overlap, destinations in the given order and
    sources in theirs, each source rectangle read from its lowest-ranked replica. The plan depends only on
    the layouts, so every rank computes the same one and keeps its own part (:func:`~.utils.transfers_for_src`,
    :func:`~.utils.transfers_for_dst`). ``ValueError`` when the two sides describe different global caches.
    """
    for dst in dsts:
        for src in srcs[:1]:
            if (src.num_layers, src.num_heads) != (dst.num_layers, dst.num_heads):
                raise ValueError(f"plan_kv_reshard: sources hold num_layers={src.num_layers}, num_heads="
                                 f"{src.num_heads} but destination rank {dst.global_rank} holds num_layers="
                                 f"{dst.num_layers}, num_heads={dst.num_heads}; both sides must serve one model")
    sources = _representatives(srcs)
    plan = []
    for dst in dsts:
        for src in srcs:
            if src.global_rank not in sources:
                continue
            layers = intersect(src.layer_range(), dst.layer_range())
            heads = intersect(src.head_range(), dst.head_range())
            if layers is not None and heads is not None:
                plan.append(KVReshardTransfer(src.global_rank, dst.global_rank, *layers, *heads))
    return plan
