"""Which Mamba states each rank holds, and the moves that take one layout's states to another's
(Megatron-Core 0.19's ``inference.disaggregation.mamba_reshard``, the Mamba counterpart of :mod:`.kv_reshard`).

Per request and Mamba layer a rank holds a convolution state ``[conv channels, d_conv]`` and an SSM state
``[heads, headdim, d_state]``. Tensor parallelism splits both: the conv channels are this rank's share of
three bands laid end to end, ``x`` (``nheads * headdim`` channels globally), ``B`` and ``C`` (``ngroups *
d_state`` each), and the SSM state is its share of the heads. A transfer moves one band of one layer between
a source and a destination rank, only the channels (or heads) their shares have in common; its bounds are
local positions on each side (a band's local offset within the conv channels included).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_core.inference.disaggregation.utils import intersect

__all__ = ["MambaReshardTransfer", "MambaShardLayout", "MambaStateDims", "plan_mamba_reshard"]

CONV_BANDS = ("x", "B", "C")
"""The bands of the convolution state's channel axis, in order; ``"ssm"`` names the SSM state's head axis."""


@dataclass(frozen=True)
class MambaStateDims:
    """A Mamba mixer's global (unsplit) sizes: ``nheads`` heads of ``headdim``, state ``d_state``, ``ngroups`` B/C
    groups, convolution width ``d_conv`` (the mixer's ``nheads``, ``headdim``, ``d_state``, ``ngroups``,
    ``d_conv``). Tensor parallelism splits ``nheads`` and ``ngroups``."""

    nheads: int
    headdim: int
    d_state: int
    ngroups: int
    d_conv: int


@dataclass(frozen=True)
class MambaShardLayout:
    """The Mamba states of one rank: global Mamba layers ``[layer_start, layer_start + num_layers)`` (indices
    among the model's Mamba layers) for tensor-parallel rank ``tp_rank`` of ``tp_size``.

    ``dims`` may be given as a dict (a layout sent over the wire). ``ValueError`` when ``tp_size`` does not
    divide ``nheads`` or ``ngroups``.
    """

    global_rank: int
    tp_size: int
    tp_rank: int
    layer_start: int
    num_layers: int
    dims: MambaStateDims

    def __post_init__(self) -> None:
        if isinstance(self.dims, dict):
            object.__setattr__(self, "dims", MambaStateDims(**self.dims))
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"MambaShardLayout: tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")
        for name in ("nheads", "ngroups"):
            value = getattr(self.dims, name)
            if value % self.tp_size:
                raise ValueError(f"MambaShardLayout: {name}={value} must be divisible by tp_size={self.tp_size} "
                                 "(each tensor-parallel rank holds an equal share)")

    @property
    def nheads(self) -> int:
        """Global Mamba heads."""
        return self.dims.nheads

    @property
    def headdim(self) -> int:
        """Width of one head."""
        return self.dims.headdim

    @property
    def d_state(self) -> int:
        """SSM state size."""
        return self.dims.d_state

    @property
    def ngroups(self) -> int:
        """Global B/C groups."""
        return self.dims.ngroups

    @property
    def d_conv(self) -> int:
        """Convolution width."""
        return self.dims.d_conv

    @property
    def d_inner(self) -> int:
        """Global ``x`` channels: ``nheads * headdim``."""
        return self.nheads * self.headdim

    @property
    def nheads_local(self) -> int:
        """Heads on this rank."""
        return self.nheads // self.tp_size

    @property
    def d_inner_local(self) -> int:
        """``x`` channels on this rank."""
        return self.d_inner // self.tp_size

    @property
    def ngroups_local(self) -> int:
        """B/C groups on this rank."""
        return self.ngroups // self.tp_size

    @property
    def conv_dim_local(self) -> int:
        """Channels of this rank's convolution state: ``x`` plus ``B`` plus ``C``."""
        return self.d_inner_local + 2 * self.ngroups_local * self.d_state

    def mamba_shard_key(self) -> tuple[int, int]:
        """``(tp_rank, layer_start)``: ranks with the same key hold the same states (replicas)."""
        return (self.tp_rank, self.layer_start)

    def layer_range(self) -> tuple[int, int]:
        """This rank's global Mamba layers, ``[lo, hi)``."""
        return (self.layer_start, self.layer_start + self.num_layers)

    def band(self, name: str) -> tuple[tuple[int, int], int]:
        """``((global lo, global hi), local offset)`` of band ``name`` (``x``, ``B``, ``C`` or ``ssm``) on this rank:
        the band's global channels (heads for ``ssm``) this rank holds and where they start locally."""
        bc = self.ngroups_local * self.d_state
        local = {"x": (self.d_inner_local, 0), "B": (bc, self.d_inner_local), "C": (bc, self.d_inner_local + bc),
                 "ssm": (self.nheads_local, 0)}
        if name not in local:
            raise ValueError(f"MambaShardLayout.band: name={name!r} must be one of x, B, C, ssm")
        size, offset = local[name]
        return (self.tp_rank * size, (self.tp_rank + 1) * size), offset


@dataclass(frozen=True)
class MambaReshardTransfer:
    """One band of one Mamba layer moving from ``src_rank`` to ``dst_rank``.

    ``band`` is ``x``, ``B`` or ``C`` (a slice of the convolution state's channel axis) or ``ssm`` (a slice of
    the SSM state's head axis); ``src_layer`` / ``dst_layer`` are local Mamba-layer indices and ``[src_lo,
    src_hi)`` / ``[dst_lo, dst_hi)`` the local channel or head bounds on each side.
    """

    src_rank: int
    dst_rank: int
    band: str
    global_layer: int
    src_layer: int
    dst_layer: int
    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int

    @property
    def is_conv(self) -> bool:
        """Whether the transfer moves convolution-state channels (else SSM-state heads)."""
        return self.band in CONV_BANDS


def _representatives(srcs: list[MambaShardLayout]) -> set[int]:
    """The lowest global rank of every distinct Mamba shard among ``srcs``."""
    best: dict[tuple[int, int], int] = {}
    for src in srcs:
        key = src.mamba_shard_key()
        best[key] = min(best.get(key, src.global_rank), src.global_rank)
    return set(best.values())


def plan_mamba_reshard(src_layouts: list[MambaShardLayout], dst_layouts: list[MambaShardLayout]
                       ) -> list[MambaReshardTransfer]:
    """Every band move from the ``src_layouts`` (all ranks of the sending shard) to the ``dst_layouts``.

    One transfer per (source, destination, global layer, band) where the layer ranges and the band's channels
    (heads) overlap; sources outer, then destinations, bands ``x, B, C, ssm``, layers ascending. Replicas
    (same ``mamba_shard_key``) send from the lowest global rank only. ``ValueError`` when the two sides'
    dims differ.
    """
    for dst in dst_layouts:
        for src in src_layouts[:1]:
            if src.dims != dst.dims:
                raise ValueError(f"plan_mamba_reshard: sources have dims {src.dims} but destination rank "
                                 f"{dst.global_rank} has {dst.dims}; both sides must serve one model")
    sources = _representatives(src_layouts)
    plan = []
    for src in src_layouts:
        if src.global_rank not in sources:
            continue
        for dst in dst_layouts:
            layers = intersect(src.layer_range(), dst.layer_range())
            if layers is None:
                continue
            for band in (*CONV_BANDS, "ssm"):
                (src_lo, src_hi), src_offset = src.band(band)
                (dst_lo, dst_hi), dst_offset = dst.band(band)
                common = intersect((src_lo, src_hi), (dst_lo, dst_hi))
                if common is None:
                    continue
                lo, hi = common
                for layer in range(*layers):
                    plan.append(MambaReshardTransfer(
                        src.global_rank, dst.global_rank, band, layer, layer - src.layer_start,
                        layer - dst.layer_start, src_offset + lo - src_lo, src_offset + hi - src_lo,
                        dst_offset + lo - dst_lo, dst_offset + hi - dst_lo))
    return plan
