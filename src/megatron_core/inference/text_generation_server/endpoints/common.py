"""The legacy server's multi-rank protocol (Megatron-Core's ``text_generation_server.endpoints.common``).

Rank 0 serves HTTP; before each generation it broadcasts :data:`GENERATE_NUM` over the default
process group (:func:`send_do_generate`) so that every other rank, waiting in a loop on the same
broadcast, joins :func:`~megatron_core.inference.text_generation_server.run_mcore_engine.run_mcore_engine`
(which broadcasts the sampling settings and the prompt tokens). :data:`LOCK` keeps concurrent
HTTP requests from interleaving their broadcasts. The broadcast tensor lives on
:func:`megatron_core.device.get_current_device`, so the protocol runs on gloo (CPU) as on NCCL.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from megatron_core.device import get_current_device

__all__ = ["GENERATE_NUM", "LOCK", "send_do_generate"]

GENERATE_NUM = 0
LOCK = threading.Lock()


def send_do_generate() -> None:
    """Tell the other ranks to run a generation (a no-op without ``torch.distributed``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    choice = torch.tensor([GENERATE_NUM], dtype=torch.long, device=get_current_device())
    dist.broadcast(choice, 0)
