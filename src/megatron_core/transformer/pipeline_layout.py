"""Which decoder layers each pipeline stage builds (Megatron-Core's PP layer split and layout).

Model chunks are ordered as the pipeline runs them: chunk ``v * pp_size + p`` is virtual stage
``v`` on pipeline rank ``p``. Three ways to split ``num_layers`` over the chunks:

- even (default): every chunk gets ``num_layers / (pp * vpp)``; with
  ``account_for_embedding/loss_in_pipeline_split`` the embedding and loss count as one layer each
  on the first and last chunk;
- uneven: ``num_layers_in_first/last_pipeline_stage`` fix the first and last rank, the rest is
  split evenly over the middle ranks (each rank's count is then split over its virtual stages);
- explicit: ``pipeline_model_parallel_layout``, a string such as ``"Et*3|(tt|)*2,tL"`` (``E``
  embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` loss, ``|`` chunk boundary, ``x*N`` and
  ``(...)*N`` repeat) or a list of per-chunk lists of those symbols.

A count that cannot be placed raises ``ValueError``; layers are never dropped.
"""

from __future__ import annotations

import copy
import logging
import re
from functools import lru_cache
from typing import Any

from megatron_core.transformer.enums import LayerType

logger = logging.getLogger(__name__)

_SYMBOLS = {"E": LayerType.embedding, "t": LayerType.decoder, "m": LayerType.mtp, "L": LayerType.loss}
_LETTERS = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.mtp: "m", LayerType.loss: "L",
            LayerType.encoder: "e"}


class PipelineParallelLayerLayout:
    """An explicit assignment of embedding, decoder layers, MTP and loss to model chunks (Megatron-Core's).

    Attributes (as in Megatron-Core): ``input_data`` (the layout as given), ``layout`` (``[pp_rank][vp_stage]``
    lists of :class:`LayerType`), ``flatten_layout`` (every layer in layer order),
    ``pipeline_model_parallel_size`` and ``virtual_pipeline_model_parallel_size``; plus ``stages``, one
    symbol string per model chunk in chunk order (``"Ett"``). ``repr`` is the input: the string, or ``str``
    of the list. The constructor checks the format; :meth:`validate_layer_layout` checks the placement.
    """

    def __init__(self, layout: str | list, pipeline_model_parallel_size: int) -> None:
        self.input_data = layout
        chunks = self.parse_str_to_list(layout) if isinstance(layout, str) else _to_layer_types(layout)
        pp = pipeline_model_parallel_size
        if len(chunks) % pp != 0:
            raise ValueError(
                f"pipeline_model_parallel_layout has {len(chunks)} stages, which is not a multiple of "
                f"pipeline_model_parallel_size ({pp})"
            )
        vpp = len(chunks) // pp
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = vpp
        self.layout = [[chunks[v * pp + p] for v in range(vpp)] for p in range(pp)]
        self.flatten_layout = [layer for chunk in chunks for layer in chunk]
        self.stages = ["".join(_LETTERS[layer] for layer in chunk) for chunk in chunks]

    def chunk_layer_counts(self) -> list[int]:
        """Decoder layers per model chunk, in chunk order."""
        return [stage.count("t") for stage in self.stages]

    def __repr__(self) -> str:
        return self.input_data if isinstance(self.input_data, str) else str(self.input_data)

    @staticmethod
    @lru_cache
    def from_str(layout: str, pipeline_model_parallel_size: int) -> PipelineParallelLayerLayout:
        """Parse a layout string (cached per string and size) and log its per-stage table."""
        parsed = PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)
        logger.info("pipeline model parallel layout %s:\n%s", layout, parsed.pretty_repr())
        return parsed

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """The number of model chunks (pipeline x virtual stages) of a layout string."""
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    @staticmethod
    def parse_str_to_list(layout_str: str) -> list[list[LayerType]]:
        """``"Et*3|(tt|)*2,L"`` -> per-chunk lists of :class:`LayerType` (commas and spaces are cosmetic)."""
        text = re.sub(r"[\s,]", "", layout_str)
        group = re.compile(r"\(([^()]*)\)\*(\d+)")
        while group.search(text):
            text = group.sub(lambda m: m.group(1) * int(m.group(2)), text)
        text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        chunks = []
        for stage in text.split("|"):
            bad = sorted(set(stage) - set(_SYMBOLS))
            if bad:
                raise ValueError(
                    f"pipeline_model_parallel_layout {layout_str!r} has unknown symbols {bad}; "
                    f"allowed: {sorted(_SYMBOLS)} ('|' separates stages)"
                )
            chunks.append([_SYMBOLS[c] for c in stage])
        return chunks

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None) -> bool:
        """Check the placement against the model; return whether MTP sits on a stage before the last rank.

        The embedding opens and the loss closes the layout, once each; ``num_layers`` decoder and
        ``mtp_num_layers`` MTP layers, every MTP layer after every decoder layer, all in one model chunk, which
        is the last virtual stage of its pipeline rank (Megatron-Core 0.19's rules). The result is
        ``TransformerConfig.mtp_standalone``: the MTP chunk's rank is not the last one.
        """
        flat = self.flatten_layout
        if not flat or flat[0] != LayerType.embedding or flat.count(LayerType.embedding) != 1:
            raise ValueError(f"pipeline_model_parallel_layout {self!r} must open with the embedding, once")
        if flat[-1] != LayerType.loss or flat.count(LayerType.loss) != 1:
            raise ValueError(f"pipeline_model_parallel_layout {self!r} must close with the loss, once")
        if LayerType.encoder in flat:
            raise NotImplementedError("encoder layers are not supported in a pipeline_model_parallel_layout")
        decoders, mtps = flat.count(LayerType.decoder), flat.count(LayerType.mtp)
        if decoders != num_layers:
            raise ValueError(f"pipeline_model_parallel_layout places {decoders} decoder layers but num_layers is "
                             f"{num_layers}")
        if mtps != (mtp_num_layers or 0):
            raise ValueError(f"pipeline_model_parallel_layout places {mtps} MTP layers but mtp_num_layers is "
                             f"{mtp_num_layers}")
        if mtps:
            first_mtp = flat.index(LayerType.mtp)
            if LayerType.decoder in flat[first_mtp:]:
                raise ValueError("pipeline_model_parallel_layout: decoder layers must come before MTP layers")
            if max(stage.count("m") for stage in self.stages) != mtps:
                raise ValueError("pipeline_model_parallel_layout: all MTP layers must be in one stage")
            for p, stages in enumerate(self.layout):
                earlier = [v for v, stage in enumerate(stages[:-1]) if LayerType.mtp in stage]
                if earlier:
                    raise ValueError(f"pipeline_model_parallel_layout {self!r}: the MTP layers must be in the last "
                                     f"virtual stage of their pipeline rank; rank {p} holds them in virtual stage "
                                     f"{earlier[0]} of {len(stages)}")
        last_rank = self.pipeline_model_parallel_size - 1
        return any(LayerType.mtp in self.layout[p][-1] for p in range(last_rank))

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                                pp_rank: int | None = None) -> int:
        """Layers of ``layer_type`` in the given (default: this rank's) pipeline rank and virtual stage."""
        pp_rank, vp_stage = self._rank_and_stage(vp_stage, pp_rank)
        return self.layout[pp_rank][vp_stage].count(layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                         pp_rank: int | None = None) -> int:
        """Layers of ``layer_type`` in all model chunks before the given one."""
        pp_rank, vp_stage = self._rank_and_stage(vp_stage, pp_rank)
        chunk = vp_stage * self.pipeline_model_parallel_size + pp_rank
        return sum(stage.count(_LETTERS[layer_type]) for stage in self.stages[:chunk])

    def get_layer_id_list(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                          pp_rank: int | None = None) -> list[int]:
        """Global ids (0-based) of the ``layer_type`` layers of the given model chunk."""
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def _rank_and_stage(self, vp_stage: int | None, pp_rank: int | None) -> tuple[int, int]:
        from megatron_core import parallel_state

        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
            vp_stage = 0
        elif vp_stage is None:
            raise ValueError("vp_stage must be passed under virtual pipeline parallelism")
        return pp_rank, vp_stage

    def pretty_repr(self) -> str:
        """A table of the layers each pipeline rank (rows; equal neighbours merged) and virtual stage holds."""
        def stage_text(stage: list[LayerType]) -> str:
            runs: list[list] = []
            for layer in stage:
                if runs and runs[-1][0] == layer:
                    runs[-1][1] += 1
                else:
                    runs.append([layer, 1])
            return ",".join(f"{t.name}*{n}" if n > 1 else t.name for t, n in runs) or "(empty stage)"

        rows: list[list[str]] = []
        if self.virtual_pipeline_model_parallel_size > 1:
            rows.append([""] + [f"VPP rank {v}" for v in range(self.virtual_pipeline_model_parallel_size)])
        start = 0
        texts = [[stage_text(stage) for stage in row] for row in self.layout]
        for p in range(1, len(texts) + 1):
            if p == len(texts) or texts[p] != texts[start]:
                label = f"PP rank {start}" if p - 1 == start else f"PP rank {start}-{p - 1}"
                rows.append([label] + texts[start])
                start = p
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        gap = " " * (8 if self.virtual_pipeline_model_parallel_size <= 4 else 4)
        return "\n".join(gap.join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _to_layer_types(layout: Any) -> list[list[LayerType]]:
    """Per-chunk lists of :class:`LayerType` from lists of LayerType, names (``"decoder"``) or symbols (``"t"``)."""
    if not isinstance(layout, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in layout):
        raise ValueError(f"pipeline_model_parallel_layout must be a str or a list of lists, got {layout!r}")
    chunks = []
    for row in copy.deepcopy(list(layout)):
        chunk = []
        for item in row:
            if isinstance(item, LayerType):
                chunk.append(item)
            elif isinstance(item, str) and item.strip() in _SYMBOLS:
                chunk.append(_SYMBOLS[item.strip()])
            elif isinstance(item, str) and item.strip().lower() in LayerType.__members__:
                chunk.append(LayerType[item.strip().lower()])
            else:
                raise ValueError(f"pipeline_model_parallel_layout: {item!r} is not a valid LayerType "
                                 f"({sorted(LayerType.__members__)} or {sorted(_SYMBOLS)})")
        chunks.append(chunk)
    return chunks


def _vpp(config: Any) -> int:
    return config.virtual_pipeline_model_parallel_size or 1


def chunk_layer_counts(config: Any, pp_size: int | None = None) -> list[int]:
    """Decoder layers of every model chunk in chunk order ``v * pp + p``; raises if they cannot be placed.

    ``pp_size`` is the pipeline group's size (default: ``config.pipeline_model_parallel_size``).
    """
    pp, vpp, num_layers = _pp_size(config, pp_size), _vpp(config), config.num_layers
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        if not isinstance(layout, PipelineParallelLayerLayout) or layout.pipeline_model_parallel_size != pp:
            layout = PipelineParallelLayerLayout(getattr(layout, "input_data", layout), pp)
        counts = layout.chunk_layer_counts()
        if len(counts) != pp * vpp:
            raise ValueError(
                f"pipeline_model_parallel_layout has {len(counts)} stages but pipeline_model_parallel_size ({pp}) x "
                f"virtual_pipeline_model_parallel_size ({vpp}) = {pp * vpp}"
            )
        if sum(counts) != num_layers:
            raise ValueError(f"pipeline_model_parallel_layout places {sum(counts)} decoder layers but num_layers is {num_layers}")
        return counts
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        return _uneven_counts(num_layers, pp, vpp, first, last)
    return _even_counts(config, num_layers, pp, vpp)


def _even_counts(config: Any, num_layers: int, pp: int, vpp: int) -> list[int]:
    extra_first = int(config.account_for_embedding_in_pipeline_split)
    extra_last = int(config.account_for_loss_in_pipeline_split)
    total = num_layers + extra_first + extra_last
    chunks = pp * vpp
    if total % chunks != 0:
        accounted = f" (+{extra_first + extra_last} for embedding/loss accounting)" if extra_first + extra_last else ""
        raise ValueError(
            f"num_layers ({num_layers}){accounted} must be divisible by pipeline_model_parallel_size ({pp}) x "
            f"virtual_pipeline_model_parallel_size ({vpp}) = {chunks}; use num_layers_in_first/last_pipeline_stage "
            f"or pipeline_model_parallel_layout for an uneven split"
        )
    counts = [total // chunks] * chunks
    counts[0] -= extra_first
    counts[-1] -= extra_last
    return counts


def _uneven_counts(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    if pp == 1:
        raise ValueError("num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1")
    for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if value is not None and (value <= 0 or value % vpp != 0):
            raise ValueError(
                f"{name} ({value}) must be > 0 and divisible by virtual_pipeline_model_parallel_size ({vpp})"
            )
    middle_ranks = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_ranks == 0 and middle_layers != 0):
        raise ValueError(
            f"num_layers ({num_layers}) does not match num_layers_in_first_pipeline_stage ({first}) + "
            f"num_layers_in_last_pipeline_stage ({last}) with {middle_ranks} middle stages"
        )
    per_middle = middle_layers // middle_ranks if middle_ranks else 0
    if middle_ranks and (middle_layers % middle_ranks != 0 or per_middle % vpp != 0):
        raise ValueError(
            f"the {middle_layers} layers left for the {middle_ranks} middle pipeline stages (num_layers {num_layers} - "
            f"first {first or 0} - last {last or 0}) must split evenly over them and over "
            f"virtual_pipeline_model_parallel_size ({vpp})"
        )
    per_rank = [per_middle] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return [per_rank[p] // vpp for _ in range(vpp) for p in range(pp)]


def _pp_size(config: Any, pp_size: int | None) -> int:
    """The pipeline size: the group's (``pp_size``) when known, checked against the config field."""
    field = config.pipeline_model_parallel_size
    if pp_size is None:
        return field
    if field not in (1, pp_size):
        raise ValueError(
            f"config.pipeline_model_parallel_size is {field} but the pipeline-parallel process group has "
            f"{pp_size} ranks; parallel sizes come from the process groups (pg_collection, else parallel_state): "
            f"leave pipeline_model_parallel_size at 1 or make it equal the group size"
        )
    return pp_size


def _resolve_ranks(
    config: Any, vp_stage: int | None, pp_rank: int | None, pp_size: int | None
) -> tuple[int, int, int]:
    """``(pp_rank, vp_stage, pp_size)``; unknown pipeline rank and size come from ``parallel_state``'s group."""
    if pp_rank is None:
        from megatron_core import parallel_state
        from megatron_core._ground import get_pg_rank, get_pg_size
        from megatron_core.process_groups_config import resolve_process_group

        group = resolve_process_group("pp")
        if group is not None:
            pp_rank = get_pg_rank(group)
            pp_size = get_pg_size(group) if pp_size is None else pp_size
        else:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank() if config.pipeline_model_parallel_size > 1 else 0
    pp_size = _pp_size(config, pp_size)
    if vp_stage is None:
        if _vpp(config) > 1:
            raise ValueError(
                f"vp_stage must be given when virtual_pipeline_model_parallel_size is "
                f"{config.virtual_pipeline_model_parallel_size}"
            )
        vp_stage = 0
    if not 0 <= pp_rank < pp_size or not 0 <= vp_stage < _vpp(config):
        raise ValueError(
            f"pp_rank ({pp_rank}) / vp_stage ({vp_stage}) out of range for pipeline size ({pp_size}) and "
            f"virtual_pipeline_model_parallel_size ({_vpp(config)})"
        )
    return pp_rank, vp_stage, pp_size


def get_num_layers_to_build(
    config: Any, vp_stage: int | None = None, pp_rank: int | None = None, *, pp_size: int | None = None
) -> int:
    """Number of decoder layers the given (or current) pipeline rank / virtual stage builds.

    ``pp_size`` is the pipeline group's size; by default the size of ``parallel_state``'s pipeline
    group when ``pp_rank`` is not given, else ``config.pipeline_model_parallel_size``.
    """
    pp_rank, vp_stage, pp_size = _resolve_ranks(config, vp_stage, pp_rank, pp_size)
    return chunk_layer_counts(config, pp_size)[vp_stage * pp_size + pp_rank]


def get_transformer_layer_offset(
    config: Any, vp_stage: int | None = None, pp_rank: int | None = None, *, pp_size: int | None = None
) -> int:
    """Global index of the first decoder layer of the given (or current) chunk (0-based)."""
    pp_rank, vp_stage, pp_size = _resolve_ranks(config, vp_stage, pp_rank, pp_size)
    return sum(chunk_layer_counts(config, pp_size)[: vp_stage * pp_size + pp_rank])
