"""Weight rules for Hugging Face tensors that hold every expert of a layer along dim 0 (``[E, ...]``).

GPT-OSS stores its experts stacked (``mlp.experts.gate_up_proj [E, hidden, 2 * ffn]``,
``down_proj [E, ffn, hidden]`` and their biases), transposed with respect to ``nn.Linear`` and, for
``gate_up_proj``, with the gate and up columns interleaved (gate ``j`` in column ``2j``, up ``j`` in
column ``2j + 1``). A rule here still converts one Megatron parameter, expert ``e``'s (``{e}`` in its
name): ``from_hf`` reads row ``e`` of the stacked tensor and ``to_hf`` returns that row only, which the
exporters write at its place in the stacked tensor (:func:`hf_row`). Both are pure data movement, so a
round trip is bitwise exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_core.models.hf.rules import Index, Reader, WeightRule, fmt

__all__ = ["StackedExpertCopy", "StackedExpertRule", "StackedInterleavedGateUp", "hf_row"]


def _span(total: int, tp_rank: int, tp_size: int) -> slice:
    size = total // tp_size
    return slice(tp_rank * size, (tp_rank + 1) * size)


def _expert(layer: Index) -> int:
    if not isinstance(layer, tuple):
        raise ValueError(f"a stacked-expert rule needs a (layer, expert) index, got {layer!r}")
    return layer[1]


@dataclass(frozen=True)
class StackedExpertRule(WeightRule):
    """Base: ``hf`` (``{i}`` = layer) holds ``num_experts`` experts along dim 0; this parameter is row ``{e}``."""

    hf: str = ""
    num_experts: int = 0

    def hf_names(self, layer: Index) -> list[str]:
        return [fmt(self.hf, layer)]

    def _row(self, read: Reader, layer: Index, shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        name = fmt(self.hf, layer)
        e = _expert(layer)
        rest = [slice(None)] * (len(shapes(name)) - 1)
        return read(name, [slice(e, e + 1), *rest])[0]

    def hf_shapes(self, mcore_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The stacked HF tensor's shape, from the full (TP=1) shape of one expert's parameter."""
        raise NotImplementedError


@dataclass(frozen=True)
class StackedExpertCopy(StackedExpertRule):
    """Row ``e`` of the stacked tensor, maybe transposed (``[in, out]`` in HF), split over TP along ``tp_axis``."""

    tp_axis: int | None = None
    transpose: bool = False

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        row = self._row(read, layer, shapes)
        if self.transpose:
            row = row.t()
        if self.tp_axis is not None and tp_size > 1:
            row = row.narrow(self.tp_axis, _span(row.shape[self.tp_axis], tp_rank, tp_size).start,
                             row.shape[self.tp_axis] // tp_size)
        return row.contiguous()

    def to_hf(self, shards: list[torch.Tensor], layer: Index) -> dict[str, torch.Tensor]:
        full = shards[0] if self.tp_axis is None or len(shards) == 1 else torch.cat(shards, dim=self.tp_axis)
        return {fmt(self.hf, layer): (full.t() if self.transpose else full).contiguous()}

    def hf_shapes(self, mcore_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        row = tuple(reversed(mcore_shape)) if self.transpose else tuple(mcore_shape)
        return {self.hf: (self.num_experts, *row)}


@dataclass(frozen=True)
class StackedInterleavedGateUp(StackedExpertRule):
    """A gated ``linear_fc1`` (``[gate_r; up_r]`` on TP rank ``r``) from interleaved gate/up columns.

    The weight row is ``[hidden, 2 * ffn]`` (``transpose`` of ``nn.Linear``), the bias row ``[2 * ffn]``.
    """

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        row = self._row(read, layer, shapes)
        gate, up = row[..., 0::2], row[..., 1::2]
        span = _span(gate.shape[-1], tp_rank, tp_size)
        gate, up = gate[..., span], up[..., span]
        if row.dim() == 2:  # weight: HF [hidden, ffn] halves -> Megatron [ffn, hidden]
            gate, up = gate.t(), up.t()
        return torch.cat((gate, up), dim=0).contiguous()

    def to_hf(self, shards: list[torch.Tensor], layer: Index) -> dict[str, torch.Tensor]:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        gate, up = torch.cat(gates, dim=0), torch.cat(ups, dim=0)
        if gate.dim() == 2:
            gate, up = gate.t(), up.t()
        interleaved = torch.stack((gate, up), dim=-1).flatten(-2)
        return {fmt(self.hf, layer): interleaved.contiguous()}

    def hf_shapes(self, mcore_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        if len(mcore_shape) == 2:
            return {self.hf: (self.num_experts, mcore_shape[1], mcore_shape[0])}
        return {self.hf: (self.num_experts, *mcore_shape)}


def hf_row(rule: WeightRule, layer: Index) -> int | None:
    """The row of the stacked HF tensor that ``rule.to_hf`` returns for ``layer``, or None (a whole tensor)."""
    return _expert(layer) if isinstance(rule, StackedExpertRule) else None
