"""Megatron-Core's module path for :class:`PipelineParallelLayerLayout` (defined in ``pipeline_layout``)."""

from megatron_core.transformer.pipeline_layout import PipelineParallelLayerLayout

__all__ = ["PipelineParallelLayerLayout"]
