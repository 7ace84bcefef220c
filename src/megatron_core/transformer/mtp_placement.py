"""Which pipeline stage builds the multi-token prediction layers (Megatron-Core's placement helpers of
``transformer.multi_token_prediction``, which re-exports them).

Without a ``pipeline_model_parallel_layout`` all ``mtp_num_layers`` depths live on the last pipeline stage (the
last virtual stage under virtual pipeline parallelism). A layout places them with its ``"m"`` entries, chunk
``vp_stage * pp + pp_rank``, and all of them must land on one chunk. Every stage with MTP layers holds a copy of
the word embedding, synchronised over the embedding group (:func:`get_mtp_embedding_ranks`).
"""

from __future__ import annotations

from typing import Any

from megatron_core import parallel_state
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["get_mtp_embedding_ranks", "get_mtp_layer_offset", "get_mtp_num_layers_to_build", "get_mtp_ranks",
           "mtp_on_this_rank"]


def _layout_counts(layout: Any) -> list[list[int]]:
    """``[pp_rank][vp_stage] -> MTP layers`` of a ``PipelineParallelLayerLayout`` (chunk ``v * pp + p``)."""
    pp = layout.pipeline_model_parallel_size
    vpp = len(layout.stages) // pp
    return [[layout.stages[v * pp + p].count("m") for v in range(vpp)] for p in range(pp)]


def _chunk_index(layout: Any, vp_stage: int | None) -> int:
    return (vp_stage or 0) * layout.pipeline_model_parallel_size + parallel_state.get_pipeline_model_parallel_rank()


def mtp_on_this_rank(layout: Any = None, mtp_num_layers: int | None = None, ignore_virtual: bool | None = True,
                     vp_stage: int | None = None) -> bool:
    """Whether this pipeline rank (and ``vp_stage`` when ``ignore_virtual`` is False) holds MTP layers: those of
    ``layout`` when given, else the last stage when ``mtp_num_layers`` is set."""
    if layout is None:
        return bool(mtp_num_layers) and parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual,
                                                                               vp_stage=vp_stage)
    counts = _layout_counts(layout)[parallel_state.get_pipeline_model_parallel_rank()]
    if not ignore_virtual and parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        if vp_stage is None:
            raise ValueError("mtp_on_this_rank needs vp_stage under virtual pipeline parallelism")
        return counts[vp_stage] > 0
    return any(count > 0 for count in counts)


def get_mtp_ranks(pp_ranks: list[int], config: TransformerConfig) -> list[int]:
    """The global ranks among ``pp_ranks`` (one pipeline group) whose stage holds MTP layers."""
    if not config.mtp_num_layers:  # None or 0: no MTP
        return []
    layout = config.pipeline_model_parallel_layout
    if layout is None:
        return [pp_ranks[-1]]
    return [pp_ranks[r] for r, counts in enumerate(_layout_counts(layout)) if any(counts)]


def get_mtp_embedding_ranks(pp_ranks: list[int], config: TransformerConfig,
                            share_embeddings_and_output_weights: bool) -> list[int]:
    """The ranks of one pipeline group (``pp_ranks``) that hold a word-embedding copy: the first stage, every stage
    with MTP layers and, with tied output weights, the last stage (sorted). This is the embedding group Megatron-LM's
    ``pretrain_gpt.get_embedding_ranks`` builds; pass ``partial(get_mtp_embedding_ranks, config=...,
    share_embeddings_and_output_weights=...)`` as ``initialize_model_parallel(get_embedding_ranks=...)``.
    """
    ranks = {pp_ranks[0], *get_mtp_ranks(pp_ranks, config)}
    if share_embeddings_and_output_weights:
        ranks.add(pp_ranks[-1])
    return sorted(ranks)


def get_mtp_layer_offset(config: TransformerConfig, vp_stage: int | None = None) -> int:
    """How many MTP layers earlier model chunks hold (0 unless a pipeline layout spreads them)."""
    layout = config.pipeline_model_parallel_layout
    if config.pipeline_model_parallel_size > 1 and layout is not None:
        return sum(stage.count("m") for stage in layout.stages[:_chunk_index(layout, vp_stage)])
    return 0


def get_mtp_num_layers_to_build(config: TransformerConfig, vp_stage: int | None = None,
                                pp_rank: int | None = None) -> int:
    """The number of MTP layers this (pipeline, virtual) stage builds: all of them on the stage that has them."""
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        chunk = (vp_stage or 0) * layout.pipeline_model_parallel_size + (
            parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank)
        count = layout.stages[chunk].count("m")
        if count not in (0, config.mtp_num_layers or 0):
            raise ValueError(f"all {config.mtp_num_layers} MTP layers must be on one pipeline stage; the layout puts "
                             f"{count} on this one")
        return count
    if pp_rank is not None:
        last = pp_rank == config.pipeline_model_parallel_size - 1
        vpp = config.virtual_pipeline_model_parallel_size
        last = last and (vpp is None or vp_stage is None or vp_stage == vpp - 1)
    else:
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return (config.mtp_num_layers or 0) if last else 0
