"""Per-request Mamba state slots of the dynamic context (Megatron-Core's Mamba state cache of
``DynamicInferenceContext``: ``mamba_states_cache`` and the slot free list of ``MambaMetadata``).

A hybrid model's Mamba layers carry, for every sequence, a convolution state and an SSM state
(shapes and dtypes from :class:`~megatron_core.inference.config.MambaInferenceStateConfig`). For each
Mamba layer this holds two buffers of ``max_requests`` slots and one scratch slot (``[slots, *conv_states_shape]``
and ``[slots, *ssm_states_shape]``, allocated zeroed on the layer's first use on the activations' device); the
padding rows of a CUDA-graph decode step read and write the scratch slot, which no request owns.
A request gets a free slot when it enters the context (its states zeroed: a fresh sequence) and gives
it back when it leaves (finished, cancelled or evicted), so requests join and leave between steps.

While the engine is suspended (OFFLOAD or RECOMPUTE, :mod:`.buffer_offload`) the buffers are released
(:meth:`MambaStateSlots.release_buffers`) and brought back by :meth:`MambaStateSlots.restore_buffers`.

Unlike KV blocks, a slot holds the state after *all* of a request's tokens: it cannot be shared
between requests with a common prefix, which is why the dynamic context refuses prefix caching for
hybrid models.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from megatron_core._ground.hybrid_pattern import Symbols
from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts.buffer_offload import ReleasedBuffer, release_tensors, restore_tensors
from megatron_core.inference.contexts.overflow_errors import TensorStateDeallocatedError

__all__ = ["MambaStateSlots", "check_hybrid_inference_config", "count_attention_layers", "reserve_mamba_memory"]

_ATTENTION_SYMBOLS = (Symbols.ATTENTION, Symbols.DS_ATTENTION, Symbols.MLA)


def count_attention_layers(config: MambaInferenceStateConfig) -> int:
    """Layers of ``config.layer_type_list`` that keep a KV cache (attention, DSA, MLA)."""
    return sum(symbol in _ATTENTION_SYMBOLS for symbol in config.layer_type_list)


def check_hybrid_inference_config(inference_config: InferenceConfig) -> None:
    """Refuse what the Mamba state slots cannot serve: prefix caching (``ValueError``)."""
    if inference_config.enable_prefix_caching:
        raise ValueError("InferenceConfig.enable_prefix_caching=True cannot serve a hybrid model "
                         "(mamba_inference_state_config is set): a request's Mamba state is the state after all of its "
                         "tokens, not per KV block, so a shared prefix's blocks would leave the Mamba layers without "
                         "their state at the end of the prefix; turn prefix caching off")


def reserve_mamba_memory(inference_config: InferenceConfig, buffer_bytes: float,
                         max_requests: int) -> tuple[float, int]:
    """``(bytes left for KV blocks, max_requests)`` after the Mamba slots are taken out of ``buffer_bytes``.

    With ``mamba_memory_ratio`` the slots get that share of the buffer and ``max_requests`` is capped to the
    requests it holds; otherwise they take exactly ``max_requests`` requests' worth. Either way one more
    request's worth is the scratch slot. A buffer that leaves nothing for either raises ``ValueError``.
    """
    per_request = MambaStateSlots.bytes_per_request(inference_config.mamba_inference_state_config)
    ratio = inference_config.mamba_memory_ratio
    if ratio is not None:
        budget = buffer_bytes * ratio
        fit = int(budget // per_request) - 1 if per_request else max_requests
        if fit < 1:
            raise ValueError(f"InferenceConfig.mamba_memory_ratio ({ratio}) of buffer_size_gb "
                             f"({inference_config.buffer_size_gb}) holds no request's Mamba states "
                             f"({per_request} bytes) beside the scratch slot")
        return buffer_bytes - budget, min(max_requests, fit)
    needed = (max_requests + 1) * per_request
    if needed >= buffer_bytes:
        raise ValueError(f"InferenceConfig.buffer_size_gb ({inference_config.buffer_size_gb}) cannot hold the Mamba "
                         f"states of max_requests ({max_requests}) requests and the scratch slot ({per_request} bytes each) and any KV "
                         "block; raise buffer_size_gb or lower max_requests")
    return buffer_bytes - needed, max_requests


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
        self.scratch_slot = max_requests
        self._graph_slots: dict[int, torch.Tensor] = {}
        self._released: tuple[dict[int, ReleasedBuffer], dict[int, ReleasedBuffer]] | None = None

    @property
    def chunk_size(self) -> int:
        """The SSD scan chunk of the prefill steps (``MambaInferenceStateConfig.mamba_chunk_size``)."""
        return self.config.mamba_chunk_size

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

    def release_buffers(self, keep_data: bool) -> list[torch.device]:
        """Drop every layer's state buffers (engine suspend), keeping host copies with ``keep_data`` (OFFLOAD) or
        only their shapes (RECOMPUTE); returns the devices they were on. Slot ownership is unchanged."""
        if self._released is not None:
            raise RuntimeError("MambaStateSlots.release_buffers: the buffers are already released")
        self._released = (release_tensors(self.conv_states, keep_data), release_tensors(self.ssm_states, keep_data))
        return [buffer.device for released in self._released for buffer in released.values()]

    def restore_buffers(self) -> list[torch.device]:
        """Bring back what :meth:`release_buffers` dropped (host copies, or zeros); returns their devices."""
        if self._released is None:
            raise RuntimeError("MambaStateSlots.restore_buffers: no buffers were released")
        conv, ssm = self._released
        self._released = None
        self.conv_states.update(restore_tensors(conv))
        self.ssm_states.update(restore_tensors(ssm))
        return [tensor.device for tensor in (*self.conv_states.values(), *self.ssm_states.values())]

    def states(self, layer_number: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv states [slots + 1, *conv shape], ssm states [slots + 1, *ssm shape])`` of one Mamba layer (the
        last row is the scratch slot)."""
        conv = self.conv_states.get(layer_number)
        if conv is None:
            if self._released is not None:
                raise TensorStateDeallocatedError(None, f"Mamba states of layer {layer_number}: the buffers are "
                                                  "released (engine suspended); restore_buffers() first")
            if len(self.conv_states) >= self.num_mamba_layers:
                raise ValueError(f"MambaStateSlots: layer {layer_number} asks for Mamba states, but "
                                 f"mamba_inference_state_config.layer_type_list has only {self.num_mamba_layers} "
                                 f"Mamba layers ({sorted(self.conv_states)} already hold states): is the config "
                                 "the served model's?")
            cfg = self.config
            conv = self.conv_states[layer_number] = torch.zeros(
                self.max_requests + 1, *cfg.conv_states_shape, dtype=cfg.conv_states_dtype, device=device)
            self.ssm_states[layer_number] = torch.zeros(
                self.max_requests + 1, *cfg.ssm_states_shape, dtype=cfg.ssm_states_dtype, device=device)
        return conv, self.ssm_states[layer_number]

    def graph_slots(self, batch: int, request_ids: list[Any], device: torch.device) -> torch.Tensor:
        """The slots of a padded decode step of ``batch`` rows, in a tensor at a fixed address per ``batch`` (what a
        captured CUDA graph reads): the requests' slots, then the scratch slot for the padding rows."""
        slots = self._graph_slots.get(batch)
        if slots is None:
            slots = self._graph_slots[batch] = torch.full((batch,), self.scratch_slot, dtype=torch.long, device=device)
        values = [self.request_slot[r] for r in request_ids] + [self.scratch_slot] * (batch - len(request_ids))
        slots.copy_(torch.tensor(values, dtype=torch.long))
        return slots

    def snapshot(self, slots: torch.Tensor) -> Callable[[], None]:
        """Copies of every layer's states at ``slots``; returns the function that writes them back."""
        saved = [(self.conv_states[layer], self.ssm_states[layer], self.conv_states[layer][slots].clone(),
                  self.ssm_states[layer][slots].clone()) for layer in self.conv_states]

        def restore() -> None:
            for conv, ssm, conv_rows, ssm_rows in saved:
                conv.index_copy_(0, slots, conv_rows)
                ssm.index_copy_(0, slots, ssm_rows)

        return restore
