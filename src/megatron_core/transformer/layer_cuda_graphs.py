"""Per-layer CUDA graphs in training (``TransformerConfig.cuda_graph_impl="local"``), recorded by Inductor.

Megatron-Core's local implementation keeps a graph manager per layer that records the layer's forward and backward
as CUDA graphs and replays them. This library gets the same from ``torch.compile(mode="reduce-overhead")``: each
``TransformerLayer`` call goes through one compiled function whose forward and backward graphs Inductor's CUDA
graph trees record at their first runs (one tree node per layer call) and replay afterwards. A replay launches
the layer's kernels with one host call, which is what FP8 layers need: their many small casts and scaled GEMMs
left a 1.1B model's FP8 step bound by the host (benchmarks/RESULTS.md, 2026-12-03).

Which calls are replayed (:func:`wants_cuda_graph`): gradient-enabled forwards of CUDA tensors, outside another
compiled region (a compiled model inlines its layers) and outside a stream capture (the inference engine records
its own decode graphs). Evaluation under ``no_grad`` runs the plain layer, as does everything on the CPU, where
CUDA graphs do not exist. The weight-gradient GEMMs write ``param.main_grad`` in place; ``DistributedDataParallel``
marks those buffer views static (:mod:`megatron_core.distributed.static_main_grads`). What the config refuses
(partial-layer scopes, full recompute, MoE layers) is in ``transformer_validation.check_cuda_graphs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.distributed.static_main_grads import local_cuda_graphs_enabled

__all__ = ["CUDA_GRAPH_COMPILE_MODE", "call_through_cuda_graph", "wants_cuda_graph"]

CUDA_GRAPH_COMPILE_MODE = "reduce-overhead"  # torch.compile's mode that records CUDA graph trees

_compiled: list[Callable[..., Any]] = []  # one compiled function shared by every layer (as Module.compile)


def wants_cuda_graph(config: Any, hidden_states: Any) -> bool:
    """Whether a layer call on ``hidden_states`` goes through the recorded graphs (see the module's docstring)."""
    return (local_cuda_graphs_enabled(config) and isinstance(hidden_states, torch.Tensor) and hidden_states.is_cuda
            and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing())


def _call_layer(layer: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    return layer(*args, **kwargs)  # inside the compiled region: the layer's plain call


def call_through_cuda_graph(layer: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """``layer(*args, **kwargs)`` compiled with Inductor's CUDA graphs (compiled at the first call)."""
    if not _compiled:
        _compiled.append(torch.compile(_call_layer, mode=CUDA_GRAPH_COMPILE_MODE))
    return _compiled[0](layer, args, kwargs)
