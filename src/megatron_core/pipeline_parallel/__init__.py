"""Pipeline parallelism: P2P exchange between stages and the forward-backward schedules.

``get_forward_backward_func()`` returns the schedule for the current pipeline (no pipelining,
1F1B or interleaved); every schedule takes the same keyword call as Megatron-Core's.
"""

from megatron_core._wrapped_model import get_attr_wrapped_model, get_model_config
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)

__all__ = [
    "P2PCommunicator",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_attr_wrapped_model",
    "get_forward_backward_func",
    "get_model_config",
]
