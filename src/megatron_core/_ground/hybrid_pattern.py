"""Hybrid layer patterns (Megatron-Core's ``models.hybrid.hybrid_layer_allocation``).

A pattern is one character per layer (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE, ...), ``|``
between pipeline segments and ``/`` before each multi-token-prediction depth's pattern:
``"M-M*|M-M*/MM/MM"``. These functions parse, count and split patterns; bad symbols raise ValueError.
Pure string handling, so it sits on the ground floor: the hybrid model, the Mamba stack and the
checkpoint interop of the storage layer all read patterns with it. Megatron-Core's paths
(``models.hybrid.hybrid_layer_allocation``, ``ssm.mamba_hybrid_layer_allocation``) re-export it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from megatron_core._ground import get_pg_rank, get_pg_size

__all__ = [
    "ParsedHybridPattern",
    "Symbols",
    "get_hybrid_layer_counts",
    "get_hybrid_total_layer_count",
    "get_hybrid_total_pipeline_segment_count",
    "get_layer_maps_from_layer_type_list",
    "parse_hybrid_pattern",
    "pattern_from_ratios",
    "select_pipeline_segment",
    "validate_segment_layers",
]

logger = logging.getLogger(__name__)


class Symbols:
    """The characters of a hybrid layer pattern."""

    MAMBA = "M"
    GDN = "G"
    ATTENTION = "*"
    DS_ATTENTION = "D"
    MLA = "+"
    MLP = "-"
    MOE = "E"
    PIPE = "|"
    MTP_SEPARATOR = "/"
    VALID_LAYERS = {MAMBA, GDN, ATTENTION, DS_ATTENTION, MLA, MLP, MOE}

    @classmethod
    def name_sorted_valid_layer_symbols(cls) -> list[str]:
        """The layer symbols ordered by the name of their attribute (``ATTENTION``, ``DS_ATTENTION``, ...)."""
        named = sorted((name, value) for name, value in vars(cls).items()
                       if not name.startswith("_") and isinstance(value, str) and value in cls.VALID_LAYERS)
        return [value for _, value in named]


@dataclass
class ParsedHybridPattern:
    """A pattern split into its main part (may hold ``|``) and the per-depth MTP part."""

    main_pattern: str | None
    mtp_pattern: str | None
    mtp_num_depths: int


def _check_symbols(pattern: str, where: str, allowed: set[str]) -> None:
    for position, char in enumerate(pattern):
        if char not in allowed:
            raise ValueError(f"{where} {pattern!r}: symbol {char!r} at position {position} is not a valid layer "
                             f"symbol; valid symbols are {sorted(allowed)}")
    if Symbols.ATTENTION in pattern and (Symbols.DS_ATTENTION in pattern or Symbols.MLA in pattern):
        raise ValueError(f"{where} {pattern!r} mixes attention ('*') with MLA ('+') or DSA ('D'), which is "
                         "not supported in one model")


def _validate_pattern(pattern: str, pattern_name: str, allow_pipe: bool = False) -> None:
    """Raise ValueError when ``pattern`` holds a symbol that is not a layer (or ``|`` when allowed)."""
    allowed = Symbols.VALID_LAYERS | {Symbols.PIPE} if allow_pipe else set(Symbols.VALID_LAYERS)
    _check_symbols(pattern, f"the {pattern_name} hybrid layer pattern", allowed)


def pattern_from_ratios(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0) -> str:
    """An evenly spaced pattern with about ``attention_ratio`` attention and ``mlp_ratio`` MLP layers
    (the deprecated ``hybrid_attention_ratio`` / ``hybrid_mlp_ratio`` arguments)."""
    if num_layers <= 0:
        raise ValueError(f"num_layers ({num_layers}) must be positive")
    if not (0.0 <= attention_ratio <= 1.0 and 0.0 <= mlp_ratio <= 1.0 and attention_ratio + mlp_ratio <= 1.0):
        raise ValueError(f"attention_ratio ({attention_ratio}) and mlp_ratio ({mlp_ratio}) must lie in [0, 1] "
                         "and sum to at most 1")
    layers = [Symbols.MAMBA] * num_layers
    n_attention = round(num_layers * attention_ratio)
    n_mamba = num_layers - n_attention
    gap = n_mamba / (n_attention + 1)  # Mamba layers between consecutive attention layers
    budget = gap
    for i in range(num_layers):
        if budget < 0.5:
            layers[i] = Symbols.ATTENTION
            budget += gap
        else:
            budget -= 1
    n_mlp = round(num_layers * mlp_ratio)
    if n_mlp > 0:
        gap = (n_mamba - n_mlp) / n_mlp
        budget = gap
        for i in range(num_layers):
            if layers[i] != Symbols.MAMBA:
                continue
            if budget < 0.5:
                layers[i] = Symbols.MLP
                budget += gap
            else:
                budget -= 1
    return "".join(layers)


def parse_hybrid_pattern(pattern: str | None) -> ParsedHybridPattern:
    """Split ``"<main>/<mtp>/<mtp>..."``; every MTP part must be the same pattern (one per depth)."""
    if pattern is None:
        return ParsedHybridPattern(None, None, 0)
    main, *mtp_parts = pattern.split(Symbols.MTP_SEPARATOR)
    if main or not mtp_parts:
        _validate_pattern(main, "main", allow_pipe=True)
    if not mtp_parts:
        return ParsedHybridPattern(main, None, 0)
    if all(part == "" for part in mtp_parts):
        return ParsedHybridPattern(main or None, None, 0)
    first = mtp_parts[0]
    for depth, part in enumerate(mtp_parts[1:], start=2):
        if part != first:
            raise ValueError(f"hybrid layer pattern {pattern!r}: every MTP depth must use the same pattern, but "
                             f"depth 1 is {first!r} and depth {depth} is {part!r}")
    _validate_pattern(first, "MTP", allow_pipe=False)
    return ParsedHybridPattern(main or None, first, len(mtp_parts))


def get_hybrid_total_layer_count(pattern: str) -> int:
    """Number of main decoder layers (``|`` and the MTP part not counted)."""
    main = pattern.split(Symbols.MTP_SEPARATOR)[0]
    _validate_pattern(main, "main", allow_pipe=True)
    return len(main.replace(Symbols.PIPE, ""))


def get_hybrid_total_pipeline_segment_count(pattern: str) -> int:
    """Number of ``|``-separated pipeline segments of the main pattern."""
    return pattern.split(Symbols.MTP_SEPARATOR)[0].count(Symbols.PIPE) + 1


def get_hybrid_layer_counts(pattern: str) -> dict[str, int]:
    """Layers of each symbol over the main pattern and every MTP depth (all layer symbols as keys)."""
    parsed = parse_hybrid_pattern(pattern)
    counts = {symbol: 0 for symbol in Symbols.name_sorted_valid_layer_symbols()}
    for char in parsed.main_pattern or "":
        if char in counts:
            counts[char] += 1
    for char in parsed.mtp_pattern or "":
        counts[char] += parsed.mtp_num_depths
    return counts


def validate_segment_layers(segment: str) -> list[str]:
    """The layer symbols of one pipeline segment (no ``|``); ValueError on an unknown symbol."""
    _check_symbols(segment, "hybrid layer pattern segment", set(Symbols.VALID_LAYERS))
    return list(segment)


def _auto_split(pattern: str, pp_rank: int, pp_size: int, first: int | None, last: int | None) -> tuple[int, int]:
    """(offset, count) of this rank's layers for a pattern without ``|`` cut evenly (or with uneven ends)."""
    total = len(pattern)
    if first is None and last is None:
        if total % pp_size:
            raise ValueError(f"the hybrid layer pattern's {total} layers must be divisible by the pipeline size "
                             f"({pp_size}) when the pattern has no '|' separators")
        return pp_rank * (total // pp_size), total // pp_size
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle_layers = total - (first or 0) - (last or 0)
    if middle_stages > 0 and middle_layers % middle_stages:
        raise ValueError(f"the {middle_layers} middle layers must be divisible by the {middle_stages} middle "
                         "pipeline stages")
    per_middle = middle_layers // middle_stages if middle_stages > 0 else 0
    if first is not None and pp_rank == 0:
        return 0, first
    if last is not None and pp_rank == pp_size - 1:
        return total - last, last
    middle_rank = pp_rank - (1 if first is not None else 0)
    return (first or 0) + middle_rank * per_middle, per_middle


def select_pipeline_segment(main_pattern: str, pp_group: object, vp_stage: int | None,
                            first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                            tp_group: object = None, dp_cp_group: object = None) -> tuple[list[str], int]:
    """This pipeline rank's (and virtual stage's) layer symbols and the global index of its first layer.

    With ``|`` separators the segments are assigned round-robin (segment ``vp_stage * pp_size + pp_rank``);
    without them the pattern is cut evenly (or by ``first_stage_layers`` / ``last_stage_layers``).
    """
    segments = main_pattern.split(Symbols.PIPE) if main_pattern else [""]
    pp_rank = get_pg_rank(pp_group) if pp_group is not None else 0
    pp_size = get_pg_size(pp_group) if pp_group is not None else 1
    if len(segments) > 1 and (first_stage_layers is not None or last_stage_layers is not None):
        raise ValueError(f"num_layers_in_first_pipeline_stage ({first_stage_layers}) / "
                         f"num_layers_in_last_pipeline_stage ({last_stage_layers}) cannot be set when the hybrid "
                         f"layer pattern {main_pattern!r} has '|' separators (they already define the stages)")
    if len(segments) == 1 and pp_size > 1:
        if vp_stage is not None:
            raise ValueError(f"vp_stage={vp_stage}: virtual pipeline parallelism needs '|' separators in the "
                             f"hybrid layer pattern {main_pattern!r}")
        layers = validate_segment_layers(segments[0])
        offset, count = _auto_split(segments[0], pp_rank, pp_size, first_stage_layers, last_stage_layers)
        return layers[offset: offset + count], offset
    if len(segments) > 1 and len(segments) % pp_size:
        raise ValueError(f"the hybrid layer pattern {main_pattern!r} has {len(segments)} '|'-separated segments, "
                         f"which must be divisible by the pipeline size ({pp_size})")
    index = (vp_stage or 0) * pp_size + pp_rank
    if index >= len(segments):
        raise ValueError(f"pipeline segment {index} (pp_rank={pp_rank}, vp_stage={vp_stage or 0}) does not exist: "
                         f"the hybrid layer pattern {main_pattern!r} has {len(segments)} segments")
    logger.debug("hybrid pattern segment %d of %d: %r", index, len(segments), segments[index])
    return validate_segment_layers(segments[index]), sum(len(s) for s in segments[:index])


def get_layer_maps_from_layer_type_list(layer_type_list: list[str]) -> dict[str, dict[int, int]]:
    """For each layer symbol, the map from a layer's global index to its index among layers of that kind."""
    maps: dict[str, dict[int, int]] = {symbol: {} for symbol in Symbols.name_sorted_valid_layer_symbols()}
    for index, symbol in enumerate(layer_type_list):
        maps[symbol][index] = len(maps[symbol])
    return maps
