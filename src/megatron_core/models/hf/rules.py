"""How one GPTModel parameter is made from Hugging Face tensors, for one tensor-parallel rank, and back.

Each :class:`WeightRule` maps one Megatron parameter name (``{i}`` marks the global layer index)
to the Hugging Face tensors it is built from:

- :class:`Copy`: one HF tensor, optionally stored transposed (GPT-2's ``Conv1D`` keeps ``[in, out]``),
  split over TP along ``tp_axis`` (0 column-parallel, 1 row-parallel, ``None`` replicated);
  ``vocab=True`` rows may be padded past the HF vocabulary.
- :class:`FusedQKV`: query, key and value projections fused into ``linear_qkv`` **per query group**
  (for each group, its ``np/ng`` query heads, then its key head, then its value head); a TP rank
  holds whole groups, so its shard is built from the matching rows of q, k and v only.
- :class:`GateUp`: SwiGLU's ``linear_fc1`` is ``[gate_r; up_r]`` on each TP rank ``r``.
- :class:`SectionedRows`: one HF tensor stacked from sections along dim 0 (the Mamba mixer's ``in_proj``
  ``[z, x, B, C, dt]``, its convolution over ``[x, B, C]``); TP rank ``r`` holds its slice of every
  section, ``[z_r; x_r; B_r; C_r; dt_r]``, not one contiguous block.

``from_hf(read, layer, tp_rank, tp_size)`` reads only the rows/columns of this rank's shard;
``to_hf(shards, layer)`` turns the TP shards (in rank order) back into the HF tensors. Both are
pure data movement, so a round trip is bitwise exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# read(hf_name, index) -> tensor; index is one slice per leading dimension of the stored tensor.
Reader = Callable[[str, Sequence[slice]], torch.Tensor]
# Where a rule applies: None (not in a layer), a global layer index, or (layer, global expert index).
Index = int | tuple[int, int] | None


def _span(total: int, tp_rank: int, tp_size: int) -> slice:
    size = total // tp_size
    return slice(tp_rank * size, (tp_rank + 1) * size)


@dataclass(frozen=True)
class WeightRule:
    """Base class: ``mcore`` is the GPTModel parameter name, ``{i}`` the global layer index."""

    mcore: str

    def hf_names(self, layer: Index) -> list[str]:
        """The HF tensors this parameter is built from."""
        raise NotImplementedError

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        """This TP rank's shard of the parameter."""
        raise NotImplementedError

    def to_hf(self, shards: list[torch.Tensor], layer: Index) -> dict[str, torch.Tensor]:
        """The HF tensors, from the parameter's TP shards in rank order."""
        raise NotImplementedError


def _fmt(template: str, layer: Index) -> str:
    """Fill ``{i}`` (layer) and ``{e}`` (global expert) in a name; ``layer`` is ``i`` or ``(i, e)``."""
    if isinstance(layer, tuple):
        return template.format(i=layer[0], e=layer[1])
    return template.format(i=layer) if "{i}" in template else template


@dataclass(frozen=True)
class Copy(WeightRule):
    """One HF tensor, maybe transposed, split over TP along ``tp_axis`` of the Megatron tensor."""

    hf: str = ""
    tp_axis: int | None = None
    transpose: bool = False
    vocab: bool = False

    def hf_names(self, layer: Index) -> list[str]:
        return [_fmt(self.hf, layer)]

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]], padded_rows: int | None = None) -> torch.Tensor:
        name = _fmt(self.hf, layer)
        shape = list(shapes(name))
        if self.vocab and padded_rows is not None and padded_rows != shape[0]:
            return self._padded_rows(read, name, shape, tp_rank, tp_size, padded_rows)
        if self.transpose:
            shape.reverse()
        index = [slice(None)] * len(shape)
        if self.tp_axis is not None and tp_size > 1:
            index[self.tp_axis] = _span(shape[self.tp_axis], tp_rank, tp_size)
        if self.transpose:
            return read(name, index[::-1]).t().contiguous()
        return read(name, index)

    def _padded_rows(self, read: Reader, name: str, shape: list[int], tp_rank: int, tp_size: int,
                     padded_rows: int) -> torch.Tensor:
        """A vocabulary shard of a table padded to ``padded_rows`` rows (rows past the HF vocab are zero)."""
        span = _span(padded_rows, tp_rank, tp_size) if self.tp_axis == 0 else slice(0, padded_rows)
        out = torch.zeros(span.stop - span.start, *shape[1:], dtype=torch.float32)
        stop = min(span.stop, shape[0])
        if stop > span.start:
            piece = read(name, [slice(span.start, stop)])
            out = out.to(piece.dtype)
            out[: stop - span.start] = piece
        return out

    def to_hf(self, shards: list[torch.Tensor], layer: Index, hf_rows: int | None = None
              ) -> dict[str, torch.Tensor]:
        full = shards[0] if self.tp_axis is None or len(shards) == 1 else torch.cat(shards, dim=self.tp_axis)
        if self.vocab and hf_rows is not None and full.shape[0] != hf_rows:
            full = full[:hf_rows].contiguous()
        return {_fmt(self.hf, layer): full.t().contiguous() if self.transpose else full}


@dataclass(frozen=True)
class ModelDtypeCopy(Copy):
    """A :class:`Copy` of a parameter Megatron keeps in fp32 whatever the model's dtype (the Mamba mixer's ``A_log``
    and ``D``); export writes it in the model's ``params_dtype``, as the HF model holds one dtype throughout."""


@dataclass(frozen=True)
class SharedCopy(Copy):
    """An HF tensor that repeats another parameter (``source``, a GPTModel parameter name outside any layer), e.g.
    the ``embed_tokens`` / ``shared_head.head`` copies that DeepSeek-V3 stores in each multi-token-prediction layer.
    Export writes it from ``source``; import reads it only to check that it equals the tensor ``source`` is loaded
    from, and it may be absent. ``mcore`` is a unique key ending like ``source`` (for its shape)."""

    source: str = ""


@dataclass(frozen=True)
class FusedQKV(WeightRule):
    """``linear_qkv`` weight or bias from q, k, v (three tensors, or one ``[q|k|v]`` tensor for GPT-2).

    ``parts`` names the HF tensor of q, k and v; when all three are the same tensor the parts are
    consecutive blocks of it (along dim 0, or dim 1 when ``transpose``). With ``output_gate`` (Qwen3-Next's gated
    attention) the q tensor holds ``[query; gate]`` rows per head, and Megatron's group is
    ``[query heads | their gates | key | value]`` (``attention_output_gate``).
    """

    parts: tuple[str, str, str] = ("", "", "")
    num_heads: int = 1
    num_groups: int = 1
    head_dim: int = 1
    transpose: bool = False
    output_gate: bool = False

    def hf_names(self, layer: Index) -> list[str]:
        return list(dict.fromkeys(_fmt(p, layer) for p in self.parts))

    def _blocks(self) -> tuple[int, int, int]:
        """Rows of the HF q (with its gates), k and v tensors."""
        q = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        return q, self.num_groups * self.head_dim, self.num_groups * self.head_dim

    def _offsets(self) -> tuple[int, int, int]:
        if len(set(self.parts)) == 1:
            q, k, _ = self._blocks()
            return 0, q, q + k
        return 0, 0, 0

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        groups = self.num_groups // tp_size
        per_group = self.num_heads // self.num_groups
        g0 = tp_rank * groups
        rows = (per_group * self.head_dim * (2 if self.output_gate else 1), self.head_dim, self.head_dim)
        pieces = []
        for part, offset, row in zip(self.parts, self._offsets(), rows):
            name = _fmt(part, layer)
            ndim = len(shapes(name))
            span = slice(offset + g0 * row, offset + (g0 + groups) * row)
            if self.transpose:
                piece = read(name, [slice(None), span]).t()
            else:
                piece = read(name, [span] + [slice(None)] * (ndim - 1))
            pieces.append(piece.reshape(groups, row, *piece.shape[1:]))
        if self.output_gate:  # [groups, per_group * (query; gate) rows] -> query heads, then their gates
            q_gate = pieces[0].reshape(groups, per_group, 2, self.head_dim, *pieces[0].shape[2:])
            pieces[:1] = [q_gate[:, :, 0].flatten(1, 2), q_gate[:, :, 1].flatten(1, 2)]
        return torch.cat(pieces, dim=1).reshape(-1, *pieces[0].shape[2:]).contiguous()

    def to_hf(self, shards: list[torch.Tensor], layer: Index) -> dict[str, torch.Tensor]:
        per_group = self.num_heads // self.num_groups
        qs, ks, vs = [], [], []
        query_rows = [per_group * self.head_dim] * (2 if self.output_gate else 1)
        for shard in shards:
            grouped = shard.reshape(-1, sum(query_rows) + 2 * self.head_dim, *shard.shape[1:])
            *q_gate, k, v = torch.split(grouped, [*query_rows, self.head_dim, self.head_dim], dim=1)
            q = q_gate[0]
            if self.output_gate:  # back to HF's per-head [query; gate] rows
                heads = [t.reshape(t.shape[0], per_group, self.head_dim, *t.shape[2:]) for t in q_gate]
                q = torch.stack(heads, dim=2).flatten(1, 3)
            for out, t in ((qs, q), (ks, k), (vs, v)):
                out.append(t.reshape(-1, *shard.shape[1:]))
        q, k, v = (torch.cat(x, dim=0) for x in (qs, ks, vs))
        if len(set(self.parts)) == 1:
            fused = torch.cat((q, k, v), dim=0)
            return {_fmt(self.parts[0], layer): fused.t().contiguous() if self.transpose else fused.contiguous()}
        return {_fmt(p, layer): t.contiguous() for p, t in zip(self.parts, (q, k, v))}


@dataclass(frozen=True)
class GateUp(WeightRule):
    """SwiGLU ``linear_fc1`` from the gate and up projections: ``[gate_r; up_r]`` on TP rank ``r``."""

    gate: str = ""
    up: str = ""

    def hf_names(self, layer: Index) -> list[str]:
        return [_fmt(self.gate, layer), _fmt(self.up, layer)]

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        pieces = []
        for name in self.hf_names(layer):
            shape = shapes(name)
            pieces.append(read(name, [_span(shape[0], tp_rank, tp_size)] + [slice(None)] * (len(shape) - 1)))
        return torch.cat(pieces, dim=0)

    def to_hf(self, shards: list[torch.Tensor], layer: Index) -> dict[str, torch.Tensor]:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        gate, up = self.hf_names(layer)
        return {gate: torch.cat(gates, dim=0).contiguous(), up: torch.cat(ups, dim=0).contiguous()}


@dataclass(frozen=True)
class SectionedRows(WeightRule):
    """One HF tensor made of ``sections`` (full sizes along dim 0); each TP rank holds its even slice of every
    section, in section order."""

    hf: str = ""
    sections: tuple[int, ...] = ()

    def hf_names(self, layer: Index) -> list[str]:
        return [_fmt(self.hf, layer)]

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        name = _fmt(self.hf, layer)
        rest = [slice(None)] * (len(shapes(name)) - 1)
        pieces, offset = [], 0
        for size in self.sections:
            span = _span(size, tp_rank, tp_size)
            pieces.append(read(name, [slice(offset + span.start, offset + span.stop), *rest]))
            offset += size
        return torch.cat(pieces, dim=0).contiguous()

    def to_hf(self, shards: list[torch.Tensor], layer: Index) -> dict[str, torch.Tensor]:
        local = [size // len(shards) for size in self.sections]
        split = [shard.split(local, dim=0) for shard in shards]
        full = torch.cat([torch.cat([parts[k] for parts in split], dim=0) for k in range(len(local))], dim=0)
        return {_fmt(self.hf, layer): full.contiguous()}

    def hf_shapes(self, mcore_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The HF tensor has the full Megatron shape."""
        return {self.hf: tuple(mcore_shape)}


def fmt(template: str, index: Index) -> str:
    """Public form of the name filling used by the bridge (``{i}`` layer, ``{e}`` expert)."""
    return _fmt(template, index)


def expected_hf_shape(rule: WeightRule, mcore_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes implied by the full (TP=1) Megatron shape of ``rule``'s parameter."""
    if hasattr(rule, "hf_shapes"):  # a rule that knows its HF shapes (stacked_rules)
        return rule.hf_shapes(mcore_shape)
    if isinstance(rule, Copy):
        return {rule.hf: tuple(reversed(mcore_shape)) if rule.transpose else tuple(mcore_shape)}
    if isinstance(rule, GateUp):
        half = (mcore_shape[0] // 2, *mcore_shape[1:])
        return {rule.gate: half, rule.up: half}
    assert isinstance(rule, FusedQKV)
    q, k, v = rule._blocks()
    tail = tuple(mcore_shape[1:])
    if len(set(rule.parts)) == 1:
        shape = (q + k + v, *tail)
        return {rule.parts[0]: tuple(reversed(shape)) if rule.transpose else shape}
    return {rule.parts[0]: (q, *tail), rule.parts[1]: (k, *tail), rule.parts[2]: (v, *tail)}
