"""Per-request Mamba state slots of the dynamic context (Megatron-Core's Mamba state cache of
``DynamicInferenceContext``: ``mamba_states_cache`` and the slot free list of ``MambaMetadata``).

A hybrid model's Mamba layers carry, for every sequence, a convolution state and an SSM state
(shapes and dtypes from :class:`~megatron_core.inference.config.MambaInferenceStateConfig`). For each
Mamba layer this holds two buffers of ``max_requests`` slots (``[slots, *conv_states_shape]`` and
``[slots, *ssm_states_shape]``, allocated zeroed on the layer's first use on the activations' device).
A request gets a free slot when it enters the context (its states zeroed: a fresh sequence) and gives
it back when it leaves (finished, cancelled or evicted), so requests join and leave between steps.

Unlike KV blocks, a slot holds the state after *all* of a request's tokens: it cannot be shared
between requests with a common prefix, which is why the dynamic context refuses prefix caching for
hybrid models.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_core._ground.hybrid_pattern import Symbols
from megatron_core.inference.config import MambaInferenceStateConfig

__all__ = ["MambaStateSlots"]


class MambaStateSlots:
    """``max_requests`` slots of convolution and SSM state for every Mamba layer of this rank."""

    def __init__(self, config: MambaInferenceStateConfig, max_requests: int) -> None:
        if max_requests < 1:
            raise ValueError(f"MambaStateSlots: max_requests ({max_requests}) must be >= 1")
        self.config = config
        self.max_requests = max_requests
        self.num_mamba_layers = sum(symbol == Symbols.MAMBA for symbol in config.layer_type_list)
        self.conv_states: dict[int, torch.Tensor] = {}
        self.ssm_states: dict[int, torch.Tensor] = {}
        self.request_slot: dict[Any, int] = {}
        self._free = list(range(max_requests - 1, -1, -1))  # popped from the end: slot 0 first

    @staticmethod
    def bytes_per_request(config: MambaInferenceStateConfig) -> int:
        """Bytes of one request's states over every Mamba layer of ``config``."""
        layers = sum(symbol == Symbols.MAMBA for symbol in config.layer_type_list)
        conv = math.prod(config.conv_states_shape) * torch.empty((), dtype=config.conv_states_dtype).element_size()
        ssm = math.prod(config.ssm_states_shape) * torch.empty((), dtype=config.ssm_states_dtype).element_size()
        return layers * (conv + ssm)

    @property
    def free_count(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def allocate(self, request_id: Any) -> int:
        """Give ``request_id`` a free slot with zeroed states; returns the slot."""
        if request_id in self.request_slot:
            raise ValueError(f"MambaStateSlots: request {request_id} already holds slot {self.request_slot[request_id]}")
        if not self._free:
            raise RuntimeError(f"MambaStateSlots: all {self.max_requests} slots are held (the context admits at "
                               "most max_requests requests, so this is a bookkeeping error)")
        slot = self._free.pop()
        for buffers in (self.conv_states, self.ssm_states):
            for states in buffers.values():
                states[slot].zero_()
        self.request_slot[request_id] = slot
        return slot

    def release(self, request_id: Any) -> None:
        """Give the slot of ``request_id`` back (nothing if it holds none)."""
        slot = self.request_slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, request_id: Any) -> int:
        """The slot of ``request_id``."""
        return self.request_slot[request_id]

    def reset(self) -> None:
        """Free every slot (the buffers are kept)."""
        self.request_slot.clear()
        self._free = list(range(self.max_requests - 1, -1, -1))

    def states(self, layer_number: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv states [slots, *conv shape], ssm states [slots, *ssm shape])`` of one Mamba layer."""
        conv = self.conv_states.get(layer_number)
        if conv is None:
            if len(self.conv_states) >= self.num_mamba_layers:
                raise ValueError(f"MambaStateSlots: layer {layer_number} asks for Mamba states, but "
                                 f"mamba_inference_state_config.layer_type_list has only {self.num_mamba_layers} "
                                 f"Mamba layers ({sorted(self.conv_states)} already hold states): is the config "
                                 "the served model's?")
            cfg = self.config
            conv = self.conv_states[layer_number] = torch.zeros(
                self.max_requests, *cfg.conv_states_shape, dtype=cfg.conv_states_dtype, device=device)
            self.ssm_states[layer_number] = torch.zeros(
                self.max_requests, *cfg.ssm_states_shape, dtype=cfg.ssm_states_dtype, device=device)
        return conv, self.ssm_states[layer_number]
