"""Expert routing of the dynamic engine's tokens, for rollout routing replay (Megatron-Core's
``contexts.routing_metadata``).

With ``moe_enable_routing_replay`` the :class:`~.dynamic_context.DynamicInferenceContext` owns a
:class:`RoutingMetadata`. Around each forward of the engine, :meth:`RoutingMetadata.recording` puts the
model's routers (:class:`~megatron_core.transformer.moe.router_replay.RouterReplay`) in ``RECORD`` and
points them at one static device buffer ``[max_tokens, num_moe_layers, topk]``, so a captured CUDA graph
records too; afterwards the routers are exactly as before. :meth:`RoutingMetadata.store_step` then copies
the step's rows to the host into a routing cache laid out like the KV cache (one row per token slot:
``block * block_size + position % block_size``), so each token's routing stays with the KV block that
holds it: chunked prefill, pausing and re-prefill after an eviction need no bookkeeping, and a request that
shares cached prefix blocks finds the routing of that prefix there.
:meth:`RoutingMetadata.request_routing_indices` reads a request's rows back in token order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from megatron_core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

__all__ = ["RoutingMetadata"]

INT16_MAX_EXPERTS = 32768  # expert ids below this fit the int16 of the returned routing


class RoutingMetadata:
    """Records the top-k experts of every token the dynamic engine feeds, and serves them per request.

    ``router_replays`` passed to the methods are the instances to record, one per MoE layer in layer
    order; ``None`` means every registered instance (``RouterReplay.global_router_replay_instances``).
    """

    def __init__(self, context: Any, moe_router_topk: int,
                 num_moe_experts: int | None = None) -> None:
        self.context = context
        self.max_tokens = context.max_tokens
        self.moe_router_topk = moe_router_topk
        self.dtype = np.int16 if (num_moe_experts or 0) <= INT16_MAX_EXPERTS else np.int32
        self.routing_indices_buffer: torch.Tensor | None = None  # [max_tokens, num_moe_layers, topk], device
        self.num_moe_layers: int | None = None
        self._layer_views: list[torch.Tensor] = []  # fixed views of the buffer, one per layer
        self._slot_routing: np.ndarray | None = None  # [token slots, num_moe_layers, topk], host

    # ---- the device buffer the routers record into ----------------------------------------------------

    @staticmethod
    def _instances(router_replays: Sequence[RouterReplay] | None) -> Sequence[RouterReplay]:
        return RouterReplay.global_router_replay_instances if router_replays is None else router_replays

    def _ensure_buffer_allocated(self, num_layers: int) -> None:
        if self.routing_indices_buffer is not None and self.num_moe_layers == num_layers:
            return
        device = self.context.device or torch.device("cpu")
        self.num_moe_layers = num_layers
        self.routing_indices_buffer = torch.zeros(self.max_tokens, num_layers, self.moe_router_topk,
                                                  dtype=torch.int32, device=device)
        self._layer_views = [self.routing_indices_buffer[:, layer, :] for layer in range(num_layers)]
        self._slot_routing = None

    def enable_static_buffer_recording(self, router_replays: Sequence[RouterReplay] | None = None) -> None:
        """Make the routers record into :attr:`routing_indices_buffer` (allocated on first use)."""
        instances = self._instances(router_replays)
        if not instances:
            return
        self._ensure_buffer_allocated(len(instances))
        for instance, view in zip(instances, self._layer_views):
            instance.set_static_buffer(view)

    def disable_static_buffer_recording(self, router_replays: Sequence[RouterReplay] | None = None) -> None:
        """Make the routers record into fresh tensors again."""
        for instance in self._instances(router_replays):
            instance.clear_static_buffer()

    @contextmanager
    def recording(self, router_replays: Sequence[RouterReplay] | None = None) -> Iterator[None]:
        """Record into the static buffer for the duration; the routers' action, buffer and recorded indices
        are restored afterwards."""
        instances = list(self._instances(router_replays))
        saved = [(r.router_replay_action, r.static_buffer, r.recorded_topk_idx) for r in instances]
        try:
            self.enable_static_buffer_recording(instances)
            for instance in instances:
                instance.set_router_replay_action(RouterReplayAction.RECORD)
            yield
        finally:
            for instance, (action, buffer, recorded) in zip(instances, saved):
                instance.router_replay_action, instance.static_buffer = action, buffer
                instance.recorded_topk_idx = recorded

    def get_routing_indices(self) -> torch.Tensor | None:
        """The routing of the last recorded step's tokens, ``[num_tokens, num_moe_layers, topk]`` on the
        device, in the step's token order (padding rows of a CUDA-graph step left out); ``None`` before
        anything was recorded or without MoE layers."""
        if self.routing_indices_buffer is None:
            return None
        num_tokens = sum(len(entry.tokens) for entry in self.context.step_entries)
        return self.routing_indices_buffer[:num_tokens]

    # ---- the host routing cache, one row per KV token slot --------------------------------------------

    def _slot_of(self, request_id: Any, positions: range) -> list[int]:
        blocks, block_size = self.context.request_blocks[request_id], self.context.block_size_tokens
        return [blocks[p // block_size] * block_size + p % block_size for p in positions]

    def store_step(self) -> None:
        """Copy the last recorded step's routing to the host, each token's row into its KV slot (call after
        the forward, while the step's block tables are current)."""
        routing = self.get_routing_indices()
        if routing is None:
            return
        if self._slot_routing is None:
            slots = (self.context.total_block_count + 1) * self.context.block_size_tokens
            self._slot_routing = np.zeros((slots, self.num_moe_layers, self.moe_router_topk), dtype=self.dtype)
        slots: list[int] = []
        for entry in self.context.step_entries:
            slots.extend(self._slot_of(entry.request_id, range(entry.start, entry.start + len(entry.tokens))))
        self._slot_routing[slots] = routing.cpu().numpy()

    def request_routing_indices(self, request_id: Any, num_tokens: int) -> np.ndarray | None:
        """The routing ``[num_tokens, num_moe_layers, topk]`` of the first ``num_tokens`` tokens of a request
        that still holds its KV blocks (``None`` if nothing was recorded)."""
        if self._slot_routing is None or num_tokens < 1:
            return None
        return self._slot_routing[self._slot_of(request_id, range(num_tokens))]
