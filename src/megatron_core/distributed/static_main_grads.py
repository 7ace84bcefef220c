"""Gradient buffers at fixed addresses for layers recorded as CUDA graphs (``cuda_graph_impl="local"``).

A layer recorded as a CUDA graph (:mod:`megatron_core.transformer.layer_cuda_graphs`) writes its weight
gradients straight into ``param.main_grad`` (the GEMMs that accumulate into the DDP gradient buffer). A graph may
only write to memory whose address it recorded: Inductor's CUDA graph trees copy every input they do not know to
be static into their own pool, and skip the graph for one that is written. The buffer views never move
(``zero_grad_buffer`` zeroes them in place), so :func:`mark_main_grads_static` tells Dynamo so, once, when
``DistributedDataParallel`` builds them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["LOCAL_CUDA_GRAPH_IMPL", "check_ddp_config_for_cuda_graphs", "local_cuda_graphs_enabled",
           "mark_main_grads_static"]

LOCAL_CUDA_GRAPH_IMPL = "local"  # TransformerConfig.cuda_graph_impl of per-layer graphs


def local_cuda_graphs_enabled(config: Any) -> bool:
    """Whether ``config`` (a ``TransformerConfig``, or any config) asks for per-layer CUDA graphs."""
    return getattr(config, "cuda_graph_impl", "none") == LOCAL_CUDA_GRAPH_IMPL


def check_ddp_config_for_cuda_graphs(config: Any, ddp_config: Any) -> None:
    """Refuse DDP settings a recorded layer cannot honour: ``overwrite_main_grad_on_first_wgrad`` decides on the
    host, per step, whether a weight-gradient GEMM overwrites or adds; a graph would replay one decision for
    every micro-batch (wrong gradients), so it raises a ``ValueError`` naming both fields."""
    if local_cuda_graphs_enabled(config) and getattr(ddp_config, "overwrite_main_grad_on_first_wgrad", False):
        raise ValueError("DistributedDataParallelConfig.overwrite_main_grad_on_first_wgrad=True cannot be used with "
                         "TransformerConfig.cuda_graph_impl='local': a recorded backward would replay its first "
                         "weight-gradient GEMM's overwrite-or-add decision for every micro-batch; set it to False")


def mark_main_grads_static(params: Iterable[torch.nn.Parameter]) -> None:
    """Mark each parameter's ``main_grad`` buffer view as a static address for compiled (graphed) code.

    Not guarded (``guard=False``): the layers share one compiled graph and each has its own buffer views; the
    CUDA graph trees record each layer's call as its own node with its own addresses.
    """
    for param in params:
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            torch._dynamo.mark_static_address(main_grad, guard=False)
