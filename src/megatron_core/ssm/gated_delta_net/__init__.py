"""Gated delta net layers (Megatron-Core's ``ssm.gated_delta_net``): Qwen3-Next-style linear attention.

:class:`GatedDeltaNet` is the layer (``G`` in hybrid layer patterns, or the linear-attention layers of a GPT decoder
with ``experimental_attention_variant="gated_delta_net"``); :func:`torch_chunk_gated_delta_rule` its pure-PyTorch
recurrence; :func:`tensor_a2a_cp2hp` / :func:`tensor_a2a_hp2cp` its context-parallel all-to-alls.
"""

from megatron_core.ssm.gated_delta_net.common import (
    HAVE_FLA,
    GatedDeltaNetSubmodules,
    causal_conv1d,
    chunk_gated_delta_rule,
    get_parameter_local_cp,
    l2norm,
    tensor_a2a_cp2hp,
    tensor_a2a_hp2cp,
    torch_chunk_gated_delta_rule,
)
from megatron_core.ssm.gated_delta_net.gdn import GatedDeltaNet

__all__ = [
    "HAVE_FLA",
    "GatedDeltaNet",
    "GatedDeltaNetSubmodules",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "get_parameter_local_cp",
    "l2norm",
    "tensor_a2a_cp2hp",
    "tensor_a2a_hp2cp",
    "torch_chunk_gated_delta_rule",
]
