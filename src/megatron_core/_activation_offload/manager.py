"""``PipelineOffloadManager``: the process-wide coordinator of activation offloading (Megatron-Core's name).

The model calls :meth:`~PipelineOffloadManager.init_model_chunk_offload_handler` at the start of each model
chunk's forward (one :class:`~.chunk_handler.ChunkOffloadHandler` per micro-batch and virtual stage) and the
schedules call :meth:`~PipelineOffloadManager.reset` at the end of each iteration.

The first iteration is a warmup that records every chunk's groups, their sizes and the order the backward
visits chunks in (a virtual pipeline runs the backward of its last stage's chunks first: chunks are staged
per virtual stage and released to the backward order as the interleaved schedule would). After it,
:meth:`~PipelineOffloadManager.post_warmup_callback` fixes the policy, in this order:

1. the last group of each name in the first backward chunk stays on the device (reloading it would stall
   the backward right away);
2. ``delta_offload_bytes_across_pp_ranks * pp_rank`` bytes stay on the device, earliest groups first (later
   pipeline ranks hold fewer micro-batches in flight);
3. of the remaining groups of each chunk that moved bytes, only the first ``activation_offload_fraction``
   (in forward order) are offloaded;

then prints the per-rank summary table. Later iterations replay the recorded chunks in the same order, so
every iteration must run the same micro-batches through the same layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from megatron_core import device
from megatron_core._activation_offload.chunk_handler import ChunkOffloadHandler
from megatron_core._activation_offload.streams import new_event, new_stream
from megatron_core._activation_offload.summary import print_offload_summary_table
from megatron_core._activation_offload.tensor_pool import OffloadTensorPool

__all__ = ["PipelineOffloadManager"]


class PipelineOffloadManager:
    """The singleton (:meth:`get_instance`) that owns the transfer streams, the host buffer pool and every
    chunk handler, hooks autograd's saved tensors inside offload groups and applies the offload policy."""

    OFFLOAD_MGR: PipelineOffloadManager | None = None

    @classmethod
    def get_instance(cls) -> PipelineOffloadManager:
        """The process's manager (made on first use)."""
        if cls.OFFLOAD_MGR is None:
            cls.OFFLOAD_MGR = PipelineOffloadManager()
        return cls.OFFLOAD_MGR

    @classmethod
    def reset_instance(cls) -> None:
        """Replace the manager by a fresh one (forgets the warmup's record)."""
        cls.OFFLOAD_MGR = PipelineOffloadManager()

    def __init__(self) -> None:
        self._stages: list[list[ChunkOffloadHandler]] | None = None
        self._vpp = 1
        self._streams: dict[str, tuple[Any, Any]] = {}
        self._graph_stream: Any = None
        self._graph_event: Any = None
        self._cpu_tensor_pool = OffloadTensorPool(device="cpu", pin_memory=device.cuda_available())
        self._is_warmup = True
        self._in_replay = False
        self._cached_chunks_forward: list[ChunkOffloadHandler] = []
        self._cached_chunks_backward: list[ChunkOffloadHandler] = []
        self._cached_chunks_index_forward = 0
        self._cached_chunks_index_backward = 0
        self.do_offload = True
        self._offload_margin = 0
        self._delayed_offload_groups: list[tuple[Callable, str, list]] = []
        self._pp_rank = 0
        self._delta_offload_bytes_across_pp_ranks = 0
        self._activation_offload_fraction = 1.0
        self._offload_summary_bytes: dict[str, int] = {}
        self._offload_summary_total_bytes = 0
        self.inside_context = False
        self._hooks_entered: list[bool] = []  # per open offload scope: whether it pushed the hooks
        self._cur_forward_chunk: ChunkOffloadHandler | None = None
        self._cur_backward_chunk: ChunkOffloadHandler | None = None
        self._saved_tensors_hooks = saved_tensors_hooks(self.on_save_for_backward, self.on_get_saved_tensor)

    # ----- streams and pool --------------------------------------------------------------------------------
    def transfer_streams(self, device_type: str) -> tuple[Any, Any]:
        """The (offload, reload) streams for activations on ``device_type``, made on first use."""
        if device_type not in self._streams:
            self._streams[device_type] = (new_stream(device_type), new_stream(device_type))
        return self._streams[device_type]

    def _default_device_type(self) -> str:
        return "cuda" if device.cuda_available() else "cpu"

    @property
    def d2h_stream(self) -> Any:
        """The device-to-host stream of this process's device."""
        return self.transfer_streams(self._default_device_type())[0]

    @property
    def h2d_stream(self) -> Any:
        """The host-to-device stream of this process's device."""
        return self.transfer_streams(self._default_device_type())[1]

    @property
    def cuda_graph_stream(self) -> Any:
        """A side stream kept for CUDA-graph integrations (made on first use)."""
        if self._graph_stream is None:
            self._graph_stream = new_stream(self._default_device_type())
        return self._graph_stream

    @property
    def cuda_graph_event(self) -> Any:
        """An event kept for CUDA-graph integrations (made on first use)."""
        if self._graph_event is None:
            self._graph_event = new_event(self._default_device_type())
        return self._graph_event

    @property
    def cpu_tensor_pool(self) -> OffloadTensorPool:
        """The host buffer pool every chunk shares (pinned when CUDA is available)."""
        return self._cpu_tensor_pool

    # ----- iteration boundaries ----------------------------------------------------------------------------
    def reset(self) -> None:
        """End of an iteration: fix the policy after the warmup, rewind every chunk, free the host buffers."""
        self._cur_forward_chunk = None
        self._cur_backward_chunk = None
        self._cpu_tensor_pool.reset()
        if self._is_warmup and self._cached_chunks_forward:
            self.post_warmup_callback()
        self._cached_chunks_index_backward = 0
        self._cached_chunks_index_forward = 0
        for chunk in self._cached_chunks_forward:
            chunk.reset()
        self._delayed_offload_groups = []

    @property
    def offload_summary_bytes(self) -> dict[str, int]:
        """Offloaded bytes per group name (the warmup's micro-batches up to the first backward chunk)."""
        return self._offload_summary_bytes

    @property
    def offload_summary_total_bytes(self) -> int:
        """The sum of :attr:`offload_summary_bytes`."""
        return self._offload_summary_total_bytes

    def disable_offload(self) -> None:
        """Stop offloading (every chunk keeps its activations) until :meth:`enable_offload`."""
        self.do_offload = False
        for chunk in self._cached_chunks_forward:
            chunk.do_offload = False

    def enable_offload(self) -> None:
        """Offload again after :meth:`disable_offload`."""
        self.do_offload = True
        for chunk in self._cached_chunks_forward:
            chunk.do_offload = True

    def post_warmup_callback(self) -> None:
        """Fix which groups are offloaded from the warmup's record (see the module docstring) and print the
        summary table."""
        self._is_warmup = False
        missing = [c for c in self._cached_chunks_forward if c not in self._cached_chunks_backward]
        if missing or len(self._cached_chunks_forward) != len(self._cached_chunks_backward):
            raise RuntimeError(
                f"fine-grained activation offloading: {len(self._cached_chunks_forward)} chunks ran forward but "
                f"{len(self._cached_chunks_backward)} were ordered for the backward; the virtual pipeline stages "
                "must each run the same number of micro-batches")
        for chunk in self._cached_chunks_forward:
            chunk.is_warmup = False
            self._offload_margin = max(self._offload_margin, chunk.get_max_deduplicated_groups())
        last_of_name: dict[str, Any] = {}
        for chunk in reversed(self._cached_chunks_backward):
            for group in chunk.offload_groups:
                last_of_name[group._name] = group
        for group in last_of_name.values():
            if self._offload_margin <= 0:
                break
            group.offload = False
            self._offload_margin -= 1
        self._offload_margin = 0
        keep_on_device = self._pp_rank * self._delta_offload_bytes_across_pp_ranks
        for chunk in self._cached_chunks_backward:
            for group in chunk.offload_groups:
                if group.offload and keep_on_device > 0:
                    keep_on_device -= group.total_offload_bytes
                    group.offload = False
        for chunk in self._cached_chunks_backward:
            eligible = [g for g in chunk.offload_groups if g.offload and g.total_offload_bytes > 0]
            to_disable = int(len(eligible) * (1 - self._activation_offload_fraction))
            for group in reversed(eligible[len(eligible) - to_disable:]):
                group.offload = False
        summary: dict[str, int] = {}
        for chunk in self._cached_chunks_forward:
            for group in chunk.offload_groups:
                if group.offload:
                    summary[group._name] = summary.get(group._name, 0) + group.total_offload_bytes
            if chunk is self._cached_chunks_backward[0]:  # from here on 1F1B frees as much as it offloads
                break
        self._offload_summary_bytes = summary
        self._offload_summary_total_bytes = int(sum(summary.values()))
        print_offload_summary_table(summary)

    # ----- chunk order -------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Release the staged chunks of every virtual stage to the backward order, last stage first."""
        if self._stages is None or len(self._stages[0]) != len(self._stages[-1]):
            return
        lengths = {len(chunks) for chunks in self._stages}
        if len(lengths) != 1:
            raise RuntimeError(f"fine-grained activation offloading: virtual stages staged {sorted(lengths)} "
                               "chunks; each must stage the same number")
        self._stages[-1] = []  # the last stage's chunks were ordered when they ran
        for chunks in reversed(self._stages):
            for chunk in chunks:
                self.push(chunk)
        self._stages = [[] for _ in range(self._vpp)]

    def push(self, handler: ChunkOffloadHandler) -> None:
        """Append ``handler`` to the backward order (recorded during the warmup)."""
        if self._is_warmup:
            self._cached_chunks_backward.append(handler)

    def init_model_chunk_offload_handler(
        self, pp_rank: int, vp_size: int | None, vp_stage: int | None, min_offloaded_tensor_size: int = 1024 * 1024,
        delta_offload_bytes_across_pp_ranks: int = 0, activation_offload_fraction: float = 1.0,
        max_inflight_offloads: int | None = None,
    ) -> None:
        """A model chunk (virtual stage ``vp_stage``) starts a micro-batch's forward: during the warmup, make
        and order its handler; afterwards the recorded handlers are replayed (:meth:`pop_forward_chunk`)."""
        if not self._is_warmup:
            return
        vp_size = 1 if vp_size is None else vp_size
        if self._stages is None:
            self._vpp = vp_size
            self._stages = [[] for _ in range(vp_size)]
        self._pp_rank = pp_rank
        self._delta_offload_bytes_across_pp_ranks = delta_offload_bytes_across_pp_ranks
        self._activation_offload_fraction = activation_offload_fraction
        stage = 0 if vp_stage is None else vp_stage
        last_stage = stage == self._vpp - 1
        if last_stage:
            self.flush()
        chunk = ChunkOffloadHandler(min_offloaded_tensor_size, self._cpu_tensor_pool,
                                    max_inflight_offloads=max_inflight_offloads, manager=self)
        chunk.vpp_rank = stage
        chunk.do_offload = self.do_offload
        self._stages[stage].append(chunk)
        if last_stage:
            self.push(chunk)
            self.flush()
        self._cur_forward_chunk = chunk
        self._cached_chunks_forward.append(chunk)

    def pop_forward_chunk(self, name: str | None = None) -> ChunkOffloadHandler | None:
        """The chunk the next group ``name`` belongs to (after the warmup: the next recorded chunk once the
        current one has no such group left)."""
        if not self.do_offload:
            return self._cur_forward_chunk
        while not self._is_warmup and (self._cur_forward_chunk is None
                                       or self._cur_forward_chunk.finish_all_groups(name)):
            if self._cached_chunks_index_forward >= len(self._cached_chunks_forward):
                self._cur_forward_chunk = None
                break
            self._cur_forward_chunk = self._cached_chunks_forward[self._cached_chunks_index_forward]
            self._cached_chunks_index_forward += 1
        return self._cur_forward_chunk

    def cur_forward_chunk(self) -> ChunkOffloadHandler | None:
        """The chunk whose forward runs now."""
        return self._cur_forward_chunk

    def cur_backward_chunk(self) -> ChunkOffloadHandler | None:
        """The chunk whose backward runs now."""
        return self._cur_backward_chunk

    def front_backward_chunk(self, name: str | None = None) -> ChunkOffloadHandler | None:
        """The next chunk in backward order (with a group ``name``), not yet started."""
        for handler in self._cached_chunks_backward[self._cached_chunks_index_backward:]:
            if not handler.is_empty_chunk(name):
                return handler
        return None

    def pop_backward_chunk(self, name: str | None = None) -> None:
        """Advance the backward order to the next chunk (with a group ``name``) and make it current."""
        self._cur_backward_chunk = None
        while self._cached_chunks_index_backward < len(self._cached_chunks_backward):
            handler = self._cached_chunks_backward[self._cached_chunks_index_backward]
            self._cached_chunks_index_backward += 1
            if not handler.is_empty_chunk(name):
                self._cur_backward_chunk = handler
                return
        raise RuntimeError(f"fine-grained activation offloading: no chunk with a group {name!r} left in the "
                           "backward order")

    def activate_backward_chunk(self, handler: ChunkOffloadHandler, name: str) -> None:
        """The backward of ``handler`` runs (its group ``name`` ends): make it current, advancing the
        backward order past it when it is found there."""
        if self._cur_backward_chunk is handler:
            return
        if handler in self._cached_chunks_backward[self._cached_chunks_index_backward:]:
            while self._cur_backward_chunk is not handler:
                self.pop_backward_chunk(name)
        self._cur_backward_chunk = handler

    def mark_not_offload(self, tensor: torch.Tensor | None) -> None:
        """Keep ``tensor`` on the device whenever it is saved for backward (parameters, for instance)."""
        if tensor is not None:
            tensor._do_not_offload = True

    # ----- delayed commits (CUDA-graph replay) -------------------------------------------------------------
    def push_offload_groups(self, group_hook: Callable, name: str, forced_released_tensors: list) -> None:
        """Queue a group commit (while a graph replays) for :meth:`flush_delayed_groups`."""
        self._delayed_offload_groups.append((group_hook, name, forced_released_tensors))

    def flush_delayed_groups(self) -> None:
        """Run the queued group commits in the order they were made."""
        for group_hook, name, forced_released_tensors in self._delayed_offload_groups:
            group_hook(name, forced_released_tensors)
        self._delayed_offload_groups = []

    # ----- saved-tensor hooks ------------------------------------------------------------------------------
    def __enter__(self) -> None:
        """Route the tensors autograd saves to the current chunk (inside an offload group)."""
        entered = self._cur_forward_chunk is not None and self._cur_forward_chunk.do_offload
        self._hooks_entered.append(entered)
        if entered:
            self.inside_context = True
            self._saved_tensors_hooks.__enter__()

    def __exit__(self, *args: Any) -> None:
        """Stop routing saved tensors (if the matching :meth:`__enter__` started it)."""
        if self._hooks_entered.pop():
            self._saved_tensors_hooks.__exit__(*args)
        self.inside_context = any(self._hooks_entered)

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        """Pack hook: hand the saved tensor to the current forward chunk (returns its tag)."""
        return self._cur_forward_chunk.tensor_push(tensor)

    def on_get_saved_tensor(self, saved_state: Any) -> torch.Tensor:
        """Unpack hook: the saved tensor back on the device, from the chunk that saved it."""
        if isinstance(saved_state, torch.Tensor):
            return saved_state
        return saved_state[0].tensor_pop(saved_state)
