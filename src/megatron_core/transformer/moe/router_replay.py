"""Record the experts each MoE router chose and force them again later (``megatron.core.transformer.moe.router_replay``).

With ``moe_enable_routing_replay`` every :class:`~.router.TopKRouter` owns a :class:`RouterReplay`. The
instances live in one process-wide list in construction order (one per MoE layer), and class-level calls act on
all of them at once:

* ``RECORD``: routing runs as usual and each layer keeps its top-k expert indices ``[num_tokens, topk]``
  (:meth:`RouterReplay.get_recorded_data` collects them), e.g. while generating rollouts for RL.
* ``REPLAY_FORWARD``: routing uses the indices given to :meth:`RouterReplay.set_replay_data` instead of its own
  top-k; the probabilities are still computed from this pass's scores at those indices, so the router trains.
* ``REPLAY_BACKWARD``: for a forward pass rerun in the backward (activation recompute), each layer takes the
  indices it was given, oldest first, once per rerun.

No action (the default) routes as usual. Tensor shapes follow Megatron-Core: indices are ``[num_tokens, topk]``
per layer, and a static buffer is ``[max_tokens, num_layers, topk]``.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch

__all__ = ["RouterReplay", "RouterReplayAction"]

TopKFunction = Callable[[torch.Tensor, int, "int | None", "int | None"], tuple[torch.Tensor, torch.Tensor]]


class RouterReplayAction(Enum):
    """What the routers do with their top-k: record it, or replay given indices in the forward or the backward."""

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


class RouterReplay:
    """One MoE layer's recorded and target top-k indices; the class methods act on every layer's instance."""

    global_router_replay_instances: list[RouterReplay] = []

    # --- every layer at once -------------------------------------------------------------------------------
    @staticmethod
    def set_replay_data(all_layers_topk_indices: list[torch.Tensor]) -> None:
        """Give layer ``i`` (construction order) the indices ``all_layers_topk_indices[i]`` to replay."""
        instances = RouterReplay.global_router_replay_instances
        if len(all_layers_topk_indices) != len(instances):
            raise ValueError(f"set_replay_data got indices for {len(all_layers_topk_indices)} layers; there are "
                             f"{len(instances)} routers with routing replay")
        for instance, indices in zip(instances, all_layers_topk_indices):
            instance.set_target_indices(indices)

    @staticmethod
    def get_recorded_data() -> list[torch.Tensor | None]:
        """Each layer's recorded indices ``[num_tokens, topk]`` (None where nothing was recorded)."""
        return [instance.get_recorded_indices() for instance in RouterReplay.global_router_replay_instances]

    @staticmethod
    def clear_global_indices() -> None:
        """Forget every layer's recorded and target indices."""
        for instance in RouterReplay.global_router_replay_instances:
            instance.clear_indices()

    @staticmethod
    def set_global_router_replay_action(router_replay_action: RouterReplayAction) -> None:
        """Set the action of every layer."""
        for instance in RouterReplay.global_router_replay_instances:
            instance.set_router_replay_action(router_replay_action)

    @staticmethod
    def clear_global_router_replay_action() -> None:
        """Route as usual again in every layer."""
        for instance in RouterReplay.global_router_replay_instances:
            instance.clear_router_replay_action()

    @staticmethod
    def clear_global_router_replay_instances() -> None:
        """Drop every registered instance (before building another model in the same process)."""
        RouterReplay.global_router_replay_instances.clear()

    @staticmethod
    def set_global_static_buffers(static_buffer: torch.Tensor) -> None:
        """Record into ``static_buffer [max_tokens, num_layers, topk]``: layer ``i`` writes ``[:, i, :]`` (so a
        captured CUDA graph records into fixed memory)."""
        instances = RouterReplay.global_router_replay_instances
        if static_buffer.dim() != 3 or static_buffer.shape[1] != len(instances):
            raise ValueError(f"the static buffer must be [max_tokens, {len(instances)} layers, topk]; got shape "
                             f"{tuple(static_buffer.shape)}")
        for layer, instance in enumerate(instances):
            instance.set_static_buffer(static_buffer[:, layer, :])

    @staticmethod
    def clear_global_static_buffers() -> None:
        """Record into fresh tensors again."""
        for instance in RouterReplay.global_router_replay_instances:
            instance.clear_static_buffer()

    # --- one layer -----------------------------------------------------------------------------------------
    def __init__(self) -> None:
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[torch.Tensor] = []
        self.static_buffer: torch.Tensor | None = None
        self.layer_number: int | None = None
        RouterReplay.global_router_replay_instances.append(self)

    def set_target_indices(self, topk_indices: torch.Tensor) -> None:
        """Indices ``[num_tokens, topk]`` to replay in the next forward (and, queued, in its recompute)."""
        self.target_topk_idx = topk_indices
        self.replay_backward_list.append(topk_indices)

    def get_recorded_indices(self) -> torch.Tensor | None:
        """The indices recorded by the last ``RECORD`` forward."""
        return self.recorded_topk_idx

    def clear_indices(self) -> None:
        """Forget the recorded and target indices, and the backward queue."""
        self.recorded_topk_idx = None
        self.target_topk_idx = None
        self.replay_backward_list = []

    def set_router_replay_action(self, router_replay_action: RouterReplayAction) -> None:
        """Set this layer's action."""
        self.router_replay_action = router_replay_action

    def clear_router_replay_action(self) -> None:
        """Route as usual again."""
        self.router_replay_action = None

    def set_static_buffer(self, buffer: torch.Tensor) -> None:
        """Record into ``buffer [max_tokens, topk]`` instead of keeping the router's tensor."""
        self.static_buffer = buffer

    def clear_static_buffer(self) -> None:
        """Record into fresh tensors again."""
        self.static_buffer = None

    def record_indices(self, topk_indices: torch.Tensor) -> None:
        """Keep ``topk_indices`` (copied into the static buffer's first rows when one is set)."""
        if self.static_buffer is None:
            self.recorded_topk_idx = topk_indices
            return
        num_tokens = topk_indices.shape[0]
        if num_tokens > self.static_buffer.shape[0]:
            raise ValueError(f"layer {self.layer_number}: {num_tokens} tokens do not fit the static buffer of "
                             f"{self.static_buffer.shape[0]} rows")
        rows = self.static_buffer[:num_tokens]
        rows.copy_(topk_indices)
        self.recorded_topk_idx = rows

    def _replayed(self, scores: torch.Tensor, indices: torch.Tensor | None, topk: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        if indices is None:
            raise ValueError(f"layer {self.layer_number}: {self.router_replay_action.name} without indices: call "
                             "RouterReplay.set_replay_data first")
        indices = indices.to(device=scores.device, dtype=torch.long)
        if indices.shape != (scores.shape[0], topk):
            raise ValueError(f"layer {self.layer_number}: replayed indices have shape {tuple(indices.shape)}; this "
                             f"pass routes {scores.shape[0]} tokens to top-{topk}, so [{scores.shape[0]}, {topk}]")
        return scores.gather(1, indices), indices

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopKFunction | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of the top-k of ``scores [num_tokens, num_experts]`` under this layer's action:
        ``default_compute_topk(scores, topk, num_groups, group_topk)`` (recorded under ``RECORD``), or the
        scores at the replayed indices."""
        action = self.router_replay_action
        if action is RouterReplayAction.REPLAY_FORWARD:
            return self._replayed(scores, self.target_topk_idx, topk)
        if action is RouterReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise ValueError(f"layer {self.layer_number}: REPLAY_BACKWARD with no indices left to replay")
            return self._replayed(scores, self.replay_backward_list.pop(0), topk)
        values, indices = default_compute_topk(scores, topk, num_groups, group_topk)
        if action is RouterReplayAction.RECORD:
            self.record_indices(indices)
        return values, indices
