"""Enums used to describe models, layers and attention (Megatron-Core's ``transformer/enums.py``).

``ModelType`` and ``AttnMaskType`` are defined in :mod:`megatron_core.enums` (below every subpackage) and
re-exported here.
"""

from __future__ import annotations

import enum

from megatron_core.enums import AttnMaskType as AttnMaskType
from megatron_core.enums import ModelType as ModelType


class LayerType(enum.Enum):
    """Kind of layer: of a block, and of the entries of a ``PipelineParallelLayerLayout`` (Megatron-Core 0.19)."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    """Self- or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnBackend(enum.Enum):
    """Which attention implementation to prefer (``auto`` picks the best available)."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class CudaGraphModule(enum.Enum):
    """A part of a layer that per-layer CUDA graphs may capture on its own.

    Capturing the whole layer is not a member: it is the empty selection (see
    :func:`megatron_core.transformer.cuda_graph_config.normalize_cuda_graph_modules`).
    """

    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


class CudaGraphScope(enum.Enum):
    """Megatron-Core's former name for the parts CUDA graphs capture; kept so objects pickled with it still load.

    A separate class, not an alias of :class:`CudaGraphModule`: its values differ (``full_iteration`` is 1 here).
    New code uses ``CudaGraphModule``; ``full_iteration`` became ``cuda_graph_impl="full_iteration"`` and
    ``full_iteration_inference`` became ``InferenceCudaGraphScope.block``.
    """

    full_iteration = 1
    attn = 2
    mlp = 3
    moe = 4
    moe_router = 5
    moe_preprocess = 6
    mamba = 7
    full_iteration_inference = 8


class InferenceCudaGraphScope(enum.Enum):
    """Which module owns the CUDA graphs of inference: ``none`` (eager), each ``layer``, or the whole ``block``."""

    none = 1
    layer = 2
    block = 3
