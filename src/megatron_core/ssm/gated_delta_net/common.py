"""The shared names of the gated delta net at Megatron-Core's path ``ssm.gated_delta_net.common``; the code lives in
the sibling modules (:mod:`.gdn`, :mod:`.kernels`, :mod:`.gated_delta_rule`, :mod:`.context_parallel`)."""

from megatron_core.ssm.gated_delta_net.context_parallel import (
    get_parameter_local_cp,
    tensor_a2a_cp2hp,
    tensor_a2a_hp2cp,
)
from megatron_core.ssm.gated_delta_net.gated_delta_rule import torch_chunk_gated_delta_rule
from megatron_core.ssm.gated_delta_net.gdn import GatedDeltaNetSubmodules
from megatron_core.ssm.gated_delta_net.kernels import HAVE_FLA, causal_conv1d, chunk_gated_delta_rule, l2norm

__all__ = [
    "HAVE_FLA",
    "GatedDeltaNetSubmodules",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "get_parameter_local_cp",
    "l2norm",
    "tensor_a2a_cp2hp",
    "tensor_a2a_hp2cp",
    "torch_chunk_gated_delta_rule",
]
