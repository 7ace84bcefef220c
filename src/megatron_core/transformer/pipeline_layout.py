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

import re
from typing import Any

_SYMBOLS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_NAMES = {v: k for k, v in _SYMBOLS.items()}


class PipelineParallelLayerLayout:
    """An explicit assignment of embedding, decoder layers, MTP and loss to model chunks."""

    def __init__(self, layout: str | list[list[str]], pipeline_model_parallel_size: int) -> None:
        self.stages: list[str] = _parse(layout)
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        num_stages = len(self.stages)
        if num_stages % pipeline_model_parallel_size != 0:
            raise ValueError(
                f"pipeline_model_parallel_layout has {num_stages} stages, which is not a multiple of "
                f"pipeline_model_parallel_size ({pipeline_model_parallel_size})"
            )
        self.virtual_pipeline_model_parallel_size = num_stages // pipeline_model_parallel_size
        if any("E" in s for s in self.stages[1:]) or self.stages[0].count("E") > 1:
            raise ValueError(f"pipeline_model_parallel_layout {layout!r}: 'E' (embedding) may only open the first stage")
        if any("L" in s for s in self.stages[:-1]) or self.stages[-1].count("L") > 1:
            raise ValueError(f"pipeline_model_parallel_layout {layout!r}: 'L' (loss) may only close the last stage")

    def chunk_layer_counts(self) -> list[int]:
        """Decoder layers (``t``) per chunk, in chunk order."""
        return [s.count("t") for s in self.stages]

    def __repr__(self) -> str:
        return f"PipelineParallelLayerLayout({'|'.join(self.stages)!r})"


def _parse(layout: str | list[list[str]]) -> list[str]:
    if isinstance(layout, (list, tuple)):
        stages = []
        for stage in layout:
            try:
                stages.append("".join(_NAMES[name] if name in _NAMES else name for name in stage))
            except TypeError as err:
                raise ValueError(f"pipeline_model_parallel_layout stage {stage!r} must be a list of names") from err
    elif isinstance(layout, str):
        text = re.sub(r"[\s,]", "", layout)
        group = re.compile(r"\(([^()]*)\)\*(\d+)")
        while group.search(text):
            text = group.sub(lambda m: m.group(1) * int(m.group(2)), text)
        text = re.sub(r"(\w)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        stages = text.split("|")
    else:
        raise ValueError(f"pipeline_model_parallel_layout must be a str or a list of lists, got {type(layout).__name__}")
    for stage in stages:
        bad = sorted(set(stage) - set(_SYMBOLS))
        if bad:
            raise ValueError(
                f"pipeline_model_parallel_layout {layout!r} has unknown symbols {bad}; "
                f"allowed: {sorted(_SYMBOLS)} ('|' separates stages)"
            )
    return stages


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
            layout = PipelineParallelLayerLayout(getattr(layout, "stages", layout), pp)
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
